"""One layout's forecast (memory by kind, the peak, collectives, bubble, step time) and its check
against what a run measured (`summary.json` `plan`)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.components import locate
from framework.config.memory_checks import in_backward_frees
from framework.config.model import meta_model, model_dims_of, model_spec
from framework.optimizers.prices import unpriced
from framework.plan.activations import activation_bytes, gathered_bytes, micro_batch
from framework.plan.convert import converter_prices, owned_modules
from framework.plan.convert import unpriced as converters_unpriced
from framework.plan.model import Layout, Shapes, layout_of, model_shapes
from framework.plan.ops import Trace, trace_forward
from framework.plan.peak import cached_bytes, peak_parts
from framework.plan.profile import Profile
from framework.plan.state import optimizer_price, state_bytes
from framework.plan.timing import bubble, comm_s, step_split
from framework.plan.traffic import traffic
from framework.precision import DTYPES

FIGURES = ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "wire_bytes", "comm_calls",
           "step_time_s", "peak_bytes", "all_to_all_bytes")  # fmt: skip

_SHAPES: dict[tuple, tuple[Any, Any]] = {}  # the meta model held: its id is the key's


def _cached(key: tuple, model, make):
    if key not in _SHAPES:
        if len(_SHAPES) > 1024:
            _SHAPES.clear()
        _SHAPES[key] = model, make()
    return _SHAPES[key][1]


def shapes_of(cfg: DictConfig, layout: Layout, facts: tuple | None = None) -> Shapes:
    """model_shapes, once per model and layout, with the FLOPs of this config's checkpointing (a
    search asks for each many times, and a 96-block model takes a while to walk)."""
    from framework.contract import blocks_of
    from framework.measure.metrics import model_flops, recomputed_blocks

    model, spec = facts[:2] if facts else (meta_model(cfg), model_spec(cfg))
    seq_len = cfg.data.get("seq_len")
    shapes = _cached((id(model), layout, seq_len), model, lambda: model_shapes(cfg, layout))
    recomputed = recomputed_blocks(cfg, len(blocks_of(model, spec)))
    flops = _cached((id(model), "flops", seq_len, recomputed), model,
                    lambda: model_flops(model, spec, seq_len, recomputed))  # fmt: skip
    return replace(
        shapes, flops_per_token=(flops or (None, None))[0], hardware_flops_per_token=(flops or (None, None))[1]
    )


def predict(cfg: DictConfig, world: int, profile: Profile | None = None, facts: tuple | None = None) -> dict[str, Any]:
    """Per-rank memory by kind and its peak, collectives per step, the bubble and (with a profile)
    the step time of the strategy `cfg.parallel` at `world` ranks. `facts`: (the meta model, its
    spec, (n_layer, n_head)), where the caller has them (a search predicts hundreds of times)."""
    layout = layout_of(cfg.parallel, world, *(facts[2] if facts else model_dims_of(cfg)))
    shapes = shapes_of(cfg, layout, facts)
    model = facts[0] if facts else meta_model(cfg)
    key = ("state", id(model), layout, cfg.data.get("seq_len"), OmegaConf.to_yaml(cfg.optim))
    memory = dict(_cached(key, model, lambda: state_bytes(shapes, layout, cfg)))
    if cfg.optim.get("in_backward") and in_backward_frees(cfg.parallel):  # each gradient freed in backward
        memory["grad_bytes"] = 0
    memory["activation_bytes"] = activation_bytes(shapes, cfg, layout)
    memory["gathered_bytes"] = gathered_bytes(shapes, cfg, layout)
    ranks = traffic(shapes, cfg, layout)
    comm = max((t.totals() for t in ranks), key=lambda c: c["bytes"]) if ranks else None
    parts = peak_parts(shapes, cfg, layout, memory, profile) if profile is not None else None
    out = {
        "layout": layout_name(layout),
        "memory": memory,
        "total_bytes": sum(v or 0 for v in memory.values()),
        "peak": parts,
        "peak_bytes": sum(parts.values()) if parts else None,
        # CUDA's reserved peak: the allocated one and the cached blocks nothing live can use
        "reserved_bytes": sum(parts.values()) + cached_bytes(shapes, cfg, layout) if parts else None,
        "comm": comm,
        # expert parallel: the all-to-all bytes the mean rank sends (summary `moe`; exact when dropless)
        "all_to_all_bytes": sum(t.bytes["all_to_all"] for t in ranks) / len(ranks) if layout.ep > 1 and ranks else None,
        "bubble": bubble(layout),
        "step_time_s": None,
        "split": None,  # the step's seconds by term (framework.plan.timing.SPLIT), summing to step_time_s
        "comm_time_s": None,  # the communication part alone (what ranks models without a FLOP count)
        "not_predicted": _not_predicted(memory, ranks, shapes, cfg),
        "hardware_flops_per_token": shapes.hardware_flops_per_token,  # with checkpointing's recomputation
        "model_flops_per_token": shapes.flops_per_token,  # without (what MFU counts)
    }
    if profile is not None and ranks is not None:
        out["comm_time_s"] = comm_s(cfg, layout, ranks, profile)
        if shapes.hardware_flops_per_token:
            spec = facts[1] if facts else model_spec(cfg)
            trace = forward_trace(cfg, layout, model, spec) if profile.kernels is not None else None
            out["split"] = step_split(cfg, layout, shapes, ranks, profile, trace=trace)
            out["step_time_s"] = sum(out["split"].values())
    return out


def forward_trace(cfg: DictConfig, layout: Layout, model, spec) -> Trace | None:
    """One rank's micro-batch forward, traced on meta once per model and shape (framework.plan.ops);
    None for a model that takes no token batch or whose forward does not run on meta."""
    seq_len = cfg.data.get("seq_len")
    if spec.task != "lm" or not seq_len:
        return None
    b, tokens = micro_batch(cfg, layout), seq_len // layout.cp
    autocast = DTYPES[cfg.precision.name]  # the trace prices CPU kernels only (profile.kernels)
    prices = converter_prices(cfg, model, spec)  # the converters' modules, each priced by its converter
    owned = owned_modules(prices)

    def make():
        try:
            return trace_forward(model, spec, b, tokens, autocast, owned)
        except Exception:  # a forward that needs real tensors: priced by its FLOPs instead
            return None

    priced = (len(owned), repr(sorted({repr(e) for e in owned.values()})))  # what the converters' prices say
    return _cached(("trace", id(model), b, tokens, autocast, priced), model, make)


def _not_predicted(memory: dict, ranks, shapes: Shapes, cfg: DictConfig) -> dict[str, str]:
    """figure -> why it is not predicted (a clear word rather than a wrong figure); a component
    without a price: planned as if absent, and said here."""
    why = converters_unpriced(cfg)
    if optimizer_price(cfg.optim) is None:
        why["optim_bytes"] = unpriced(locate(cfg.optim, "optim"))
    if memory["activation_bytes"] is None:
        why["activation_bytes"] = "the model declares no gpt-like block (planner_shape)"
        why["peak_bytes"] = why["activation_bytes"]
    if ranks is None:
        why["wire_bytes"] = "collectives of this strategy are not modelled (powersgd, cp_impl=torch)"
    if not shapes.hardware_flops_per_token:
        why["step_time_s"] = "the model's FLOPs are unknown"
    return why


def layout_name(layout: Layout) -> str:
    if layout.name in ("none", "dp", "ddp", "tp"):
        return layout.name
    ep = f" ep{layout.ep}" if layout.ep > 1 else ""
    if layout.name == "fsdp" and layout.tp == layout.pp == layout.cp == 1:
        kind = "fsdp" if layout.reshard else "fsdp(grad_op)"
        return (kind if layout.dp_replicate == 1 else f"{kind} {layout.dp_replicate}x{layout.dp_shard}") + ep
    if layout.name == "pp":
        return f"pp {layout.schedule} m={layout.n_microbatches}"
    if layout.name == "cp" and layout.dp == 1:
        return f"cp{layout.cp}"
    parts = (
        [f"dp{layout.dp}"] * (layout.dp > 1)
        + [f"pp{layout.pp}"] * (layout.pp > 1)
        + [f"cp{layout.cp}"] * (layout.cp > 1)
        + [f"tp{layout.tp}"] * (layout.tp > 1)
    )
    return f"{layout.name} " + "x".join(parts) + ep


# ----------------------------------------------------------------------------- the check


def measured_peak(summary: dict[str, Any]) -> int | None:
    """The run's peak per rank: the CUDA allocator's, else the resident set's (max over ranks)."""
    memory = summary.get("memory") or {}
    return memory.get("device_peak_bytes") or memory.get("rss_peak_bytes")


def check(predicted: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """`plan` of summary.json: the run's prediction, what it measured, and the relative error of
    each figure ((predicted - measured) / measured; None where either is missing)."""
    memory, comm = summary.get("memory") or {}, summary.get("comm") or {}
    pm, pc = predicted["memory"], predicted["comm"] or {}
    pred = {k: pm.get(k) for k in FIGURES[:4]} | {
        "wire_bytes": pc.get("wire_bytes"), "comm_calls": pc.get("calls"), "step_time_s": predicted["step_time_s"],
        "peak_bytes": predicted.get("peak_bytes"), "all_to_all_bytes": predicted.get("all_to_all_bytes"),
    }  # fmt: skip
    all_to_all = (summary.get("comm_by_op") or {}).get("all_to_all") or {}  # the mean rank's (the forecast's)
    meas = {k: memory.get(k) for k in FIGURES[:4]} | {
        "wire_bytes": comm.get("wire_bytes"), "comm_calls": comm.get("calls"), "step_time_s": summary.get("step_time_s"),
        "peak_bytes": measured_peak(summary), "all_to_all_bytes": all_to_all.get("mean_bytes"),
    }  # fmt: skip
    if not comm and predicted["comm"] is not None and not pc.get("calls"):  # no collectives, none predicted
        meas["wire_bytes"], meas["comm_calls"] = 0, 0
    error = {k: _rel(pred[k], meas[k]) for k in FIGURES}
    return {"layout": predicted["layout"], "bubble": predicted["bubble"], "predicted": pred, "measured": meas,
            "error": error, "peak_parts": predicted.get("peak"),
            "not_predicted": predicted.get("not_predicted") or {}}  # fmt: skip


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None:
        return None
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return (predicted - measured) / measured
