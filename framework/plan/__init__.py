"""The planner: predicts each layout's memory, communication and step time before launch, picks
the fastest that fits (`parallel=auto`), and every run checks its prediction against what it
measured (`summary.json` `plan`).

    python -m framework.plan [overrides] plan.world_size=N     # the ranked table, no training

The formulas are in `model` (state, saved activations) and `traffic` (collectives); the machine
figures in `profile`. A prediction has the measured figures' names and units, per rank (the rank
holding most, as the summary reports the max over ranks), per optimizer step.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.config.model import model_dims_of, model_spec
from framework.plan.model import Layout, activation_bytes, layout_of, model_shapes, state_bytes
from framework.plan.profile import Profile, machine_profile
from framework.plan.traffic import traffic

FIGURES = ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "wire_bytes", "comm_calls", "step_time_s")


def bubble(layout: Layout) -> float:
    """Idle share of a pipeline step: (p-1)/(v·m + p-1) for v stages per rank and m micro-batches
    (GPipe and 1F1B: v=1); the zero-bubble schedules fill about two thirds of it with the weight
    gradients they split off."""
    if layout.pp == 1:
        return 0.0
    p, m, v = layout.pp, layout.n_microbatches, layout.stages_per_rank
    fill = 3 if "ZeroBubble" in layout.schedule else 1
    return (p - 1) / (fill * v * m + p - 1)


def predict(cfg: DictConfig, world: int, profile: Profile | None = None) -> dict[str, Any]:
    """Per-rank memory by kind, collectives per step, the bubble and (with a profile) the step time
    of the strategy `cfg.parallel` at `world` ranks."""
    layout = layout_of(cfg.parallel, world, *model_dims_of(cfg))
    shapes = model_shapes(cfg, layout)
    memory = state_bytes(shapes, layout, cfg)
    memory["activation_bytes"] = activation_bytes(shapes, cfg, layout)
    memory["gathered_bytes"] = _gathered_bytes(shapes, cfg, layout)
    ranks = traffic(shapes, cfg, layout)
    comm = max((t.totals() for t in ranks), key=lambda c: c["bytes"]) if ranks else None
    out = {
        "layout": layout_name(layout),
        "memory": memory,
        "total_bytes": sum(v or 0 for v in memory.values()),
        "comm": comm,
        "bubble": bubble(layout),
        "step_time_s": None,
        "comm_time_s": None,  # the communication part alone (what ranks models without a FLOP count)
    }
    if profile is not None and ranks is not None:
        out["comm_time_s"] = step_time(cfg, layout, 0.0, ranks, profile)
        if shapes.hardware_flops_per_token:
            out["step_time_s"] = step_time(cfg, layout, shapes.hardware_flops_per_token, ranks, profile)
    return out


def _gathered_bytes(shapes, cfg: DictConfig, layout: Layout) -> int:
    """FSDP's unsharded parameters at once: two units (the one running and the one prefetched)
    when units reshard after forward, else every unit of the rank."""
    if not layout.fsdp:
        return 0
    units: dict[str, int] = {}
    for p in shapes.params:
        units[p.unit] = units.get(p.unit, 0) + math.prod(p.shape) // layout.tp
    size = 2 if cfg.precision.name != "fp32" else 4
    if layout.reshard:
        return size * sum(sorted(units.values())[-2:])
    return size * sum(units.values()) // layout.pp


def step_time(cfg: DictConfig, layout: Layout, flops_per_token: float, ranks: list, profile: Profile) -> float:
    """Seconds per optimizer step: compute (the rank's share of the step's FLOPs at the profile's
    peak, stretched by the bubble) plus collectives (latency per call + wire bytes over the link
    of the group; data-parallel traffic hidden behind up to `overlap` of the compute)."""
    batch = sum(cfg.data.rank_batch_sizes) if cfg.data.rank_batch_sizes else cfg.data.batch_size * layout.dp
    tokens = batch * cfg.accumulation_steps * cfg.data.get("seq_len", 1)
    compute = flops_per_token * tokens / max(layout.world, 1) / profile.peak_flops / (1 - bubble(layout))
    per_node = max(1, layout.world // max(1, cfg.plan.nodes))
    worst = 0.0
    for t in ranks:
        hidden, exposed = 0.0, 0.0
        for _op, calls, wire, group, kind in t.seconds_terms:
            spans_nodes = cfg.plan.nodes > 1 and group > per_node
            seconds = calls * profile.latency_s + wire / (
                profile.inter_bytes_per_s if spans_nodes else profile.intra_bytes_per_s
            )
            if kind == "dp":
                hidden += seconds
            else:
                exposed += seconds
        worst = max(worst, exposed + max(0.0, hidden - profile.overlap * compute))
    return compute + worst


def layout_name(layout: Layout) -> str:
    if layout.name in ("none", "dp", "ddp", "tp"):
        return layout.name
    if layout.name == "fsdp" and layout.tp == layout.pp == 1:
        kind = "fsdp" if layout.reshard else "fsdp(grad_op)"
        return kind if layout.dp_replicate == 1 else f"{kind} {layout.dp_replicate}x{layout.dp_shard}"
    if layout.name == "pp":
        return f"pp {layout.schedule} m={layout.n_microbatches}"
    parts = (
        [f"dp{layout.dp}"] * (layout.dp > 1)
        + [f"pp{layout.pp}"] * (layout.pp > 1)
        + [f"tp{layout.tp}"] * (layout.tp > 1)
    )
    return f"{layout.name} " + "x".join(parts)


# ----------------------------------------------------------------------------- the check


def check(predicted: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any]:
    """`plan` of summary.json: the run's prediction, what it measured, and the relative error of
    each figure ((predicted - measured) / measured; None where either is missing)."""
    memory, comm = summary.get("memory") or {}, summary.get("comm") or {}
    pm, pc = predicted["memory"], predicted["comm"] or {}
    pred = {k: pm.get(k) for k in FIGURES[:4]} | {
        "wire_bytes": pc.get("wire_bytes"), "comm_calls": pc.get("calls"), "step_time_s": predicted["step_time_s"],
    }  # fmt: skip
    meas = {k: memory.get(k) for k in FIGURES[:4]} | {
        "wire_bytes": comm.get("wire_bytes"), "comm_calls": comm.get("calls"), "step_time_s": summary.get("step_time_s"),
    }  # fmt: skip
    if not comm and predicted["comm"] is not None and not pc.get("calls"):  # no collectives, none predicted
        meas["wire_bytes"], meas["comm_calls"] = 0, 0
    error = {k: _rel(pred[k], meas[k]) for k in FIGURES}
    return {"layout": predicted["layout"], "bubble": predicted["bubble"], "predicted": pred, "measured": meas,
            "error": error}  # fmt: skip


def _rel(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None:
        return None
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return (predicted - measured) / measured


# ----------------------------------------------------------------------------- candidates


@dataclass(frozen=True)
class Candidate:
    overrides: tuple[str, ...]  # what selects it on the command line
    cfg: DictConfig  # the run's config with this parallel group


def parallel_group(name: str, settings: dict[str, Any]) -> DictConfig:
    """The `parallel` group `python train.py parallel=NAME parallel.K=V ...` composes."""
    from framework.config import CONF_DIR
    from framework.config.schema import group_schema

    node = OmegaConf.load(CONF_DIR / "parallel" / f"{name}.yaml")
    node.pop("defaults", None)
    return OmegaConf.merge(OmegaConf.structured(group_schema("parallel", name)), node, settings)


def candidates(cfg: DictConfig, world: int) -> list[Candidate]:
    """Every layout `world` ranks admit for this model and batch: ddp, fsdp (full and grad-op),
    and for gpt tp, pp with each schedule, and the hybrid degrees dp x pp x tp.

    Every candidate trains the same job: the global batch stays data.batch_size x world (what
    ddp reads), so a layout with fewer data-parallel ranks takes a larger batch per rank."""
    options: list[tuple[str, dict[str, Any]]] = [("ddp", {}), ("fsdp", {}), ("fsdp", {"reshard_after_forward": False})]
    if model_spec(cfg).tp_plan and not cfg.data.rank_batch_sizes:
        options += [("tp", {"sequence_parallel": cfg.data.seq_len % world == 0})]
        options += [
            ("pp", {"schedule": s})
            for s in ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")
        ]
        for dp, pp, tp in _factorizations(world):
            options.append(("hybrid", {"dp_shard": dp, "pp": pp, "tp": tp}))
    out = []
    for name, settings in options:
        candidate = _candidate(cfg, world, name, settings)
        if candidate is not None:
            out.append(candidate)
    return out


def _candidate(cfg: DictConfig, world: int, name: str, settings: dict[str, Any]) -> Candidate | None:
    """The run's config with this parallel group (and the batch per rank that keeps the global
    batch), or None where the layout cannot run this model or batch."""
    from framework.parallel.dims import ParallelDims

    parallel = parallel_group(name, settings)
    try:
        dims = ParallelDims.from_config(parallel, world, *model_dims_of(cfg))
    except ValueError:
        return None
    global_batch = cfg.data.batch_size * world
    if global_batch % dims.dp:
        return None
    trial = copy.deepcopy(cfg)
    OmegaConf.set_struct(trial, False)
    trial.data.batch_size = global_batch // dims.dp
    if dims.pp > 1:
        m = _microbatches(trial, parallel, dims.pp)
        if m is None:
            return None
        settings = settings | {"n_microbatches": m}
        parallel.n_microbatches = m
    trial.parallel = parallel
    try:
        if name != "ddp":
            dims.check_run(trial)
    except ValueError:
        return None
    flags = [f"parallel.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in settings.items()]
    if trial.data.batch_size != cfg.data.batch_size:
        flags.append(f"data.batch_size={trial.data.batch_size}")
    return Candidate((f"parallel={name}", *flags), trial)


def _factorizations(world: int) -> list[tuple[int, int, int]]:
    """(dp, pp, tp) with dp x pp x tp = world and at least two of them above 1."""
    out = []
    for tp in range(1, world + 1):
        for pp in range(1, world // tp + 1):
            if world % (tp * pp) == 0:
                dp = world // (tp * pp)
                if sum(d > 1 for d in (dp, pp, tp)) >= 2:
                    out.append((dp, pp, tp))
    return out


def _microbatches(cfg: DictConfig, parallel: DictConfig, pp: int) -> int | None:
    """Micro-batches for a pipeline candidate: the group's default if the local batch allows it,
    else the fewest that the batch divides into and the schedule accepts."""
    from framework.parallel.pipeline import SINGLE_STAGE, stages_per_rank

    local = cfg.data.batch_size * cfg.accumulation_steps
    least = 1 if parallel.schedule in SINGLE_STAGE else pp * stages_per_rank(parallel)
    ok = [m for m in range(1, local + 1) if local % m == 0 and m >= least]
    if not ok:
        return None
    return parallel.n_microbatches if parallel.n_microbatches in ok else ok[0]


# ----------------------------------------------------------------------------- the choice


def memory_budget_bytes(cfg: DictConfig, world: int) -> float:
    """Per-rank memory to fit in: `plan.memory_budget_mb`, else the device's memory (CPU: the
    machine's RAM shared by its local ranks)."""
    from framework.config import resolve_device

    if cfg.plan.memory_budget_mb is not None:
        return cfg.plan.memory_budget_mb * 2**20
    if resolve_device(cfg) == "cuda":
        import torch

        return torch.cuda.get_device_properties(0).total_memory
    import os

    local = min(world, cfg.launch.nproc_per_node or world)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / local


@dataclass
class Ranked:
    candidate: Candidate
    prediction: dict[str, Any]
    fits: bool


def rank(cfg: DictConfig, world: int, profile: Profile, budget: float) -> list[Ranked]:
    """Every candidate with its prediction: those that fit the budget first, fastest first."""
    out = []
    for c in candidates(cfg, world):
        p = predict(c.cfg, world, profile)
        out.append(Ranked(c, p, p["total_bytes"] <= budget))
    # models without a FLOP count (their candidates are all data-parallel: the same compute per
    # rank) rank by their communication time
    return sorted(out, key=lambda r: (not r.fits, _seconds(r.prediction), r.prediction["total_bytes"]))


def _seconds(prediction: dict[str, Any]) -> float:
    for key in ("step_time_s", "comm_time_s"):
        if prediction[key] is not None:
            return prediction[key]
    return math.inf


def choose(cfg: DictConfig, world: int, measure: str = "probe") -> tuple[Ranked, list[Ranked], float]:
    """(the layout parallel=auto runs, every candidate ranked, the budget in bytes). Raises
    ConfigError naming plan.memory_budget_mb when no layout fits."""
    from framework.config import ConfigError

    profile = machine_profile(cfg, world, measure)
    budget = memory_budget_bytes(cfg, world)
    ranked = rank(cfg, world, profile, budget)
    if not ranked:
        raise ConfigError("parallel", f"parallel=auto: no layout runs {cfg.model._target_} on {world} ranks")
    if not ranked[0].fits:
        smallest = min(ranked, key=lambda r: r.prediction["total_bytes"])
        raise ConfigError(
            "plan.memory_budget_mb",
            f"no layout fits {budget / 2**20:.0f} MB per rank at {world} ranks; the smallest predicted "
            f"footprint is {smallest.prediction['total_bytes'] / 2**20:.0f} MB ({smallest.prediction['layout']}: "
            f"{' '.join(smallest.candidate.overrides)}). Raise the budget, add ranks, or save memory "
            "(memory=checkpoint, a smaller data.batch_size)",
        )
    return ranked[0], ranked, budget


def resolve_auto(cfg: DictConfig, world: int, measure: str = "probe") -> None:
    """parallel=auto: put the chosen layout's `parallel` group into `cfg` (in place) and record
    the choice and why in `plan.auto`."""
    best, ranked, budget = choose(cfg, world, measure)
    global_batch = cfg.data.batch_size * world
    fitting = [r for r in ranked if r.fits]
    runner_up = f"; next: {fitting[1].prediction['layout']}" if len(fitting) > 1 else ""
    why = (
        f"fastest predicted step of the {len(fitting)} of {len(ranked)} layouts that fit "
        f"{budget / 2**20:.0f} MB per rank, at a global batch of {global_batch} samples{runner_up}"
    )
    cfg.parallel = best.candidate.cfg.parallel
    cfg.data.batch_size = best.candidate.cfg.data.batch_size  # the same global batch, whatever the layout
    cfg.plan.auto = {
        "layout": best.prediction["layout"],
        "overrides": list(best.candidate.overrides),
        "why": why,
        "budget_mb": budget / 2**20,
        "ranked": [
            {
                "layout": r.prediction["layout"],
                "fits": r.fits,
                "total_mb": r.prediction["total_bytes"] / 2**20,
                "step_time_s": r.prediction["step_time_s"],
            }
            for r in ranked
        ],  # fmt: skip
    }
