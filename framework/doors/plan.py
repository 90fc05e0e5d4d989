"""`python -m framework.plan [overrides] plan.world_size=N`: every layout N ranks admit for the
composed config, each with its best memory knobs (checkpointing, micro-batch and accumulation,
pipeline micro-batches), ranked (those whose predicted peak fits `plan.memory_budget_mb` first,
fastest first), with predicted memory per rank by kind, the peak, collectives per step, bubble and
step time; then the machine figures and where each came from. Trains nothing."""

from __future__ import annotations

import sys

from omegaconf import DictConfig, open_dict

from framework.config import ConfigError, validate, world_size_of
from framework.config.overrides import compose_checked
from framework.plan.profile import Profile
from framework.plan.search import Ranked, choose
from framework.plan.timing import SPLIT

MB = 2**20


def best_per_layout(ranked: list[Ranked]) -> list[Ranked]:
    """The first (best) combination of each layout candidate, in rank order."""
    seen, out = set(), []
    for r in ranked:
        if id(r.candidate) not in seen:
            seen.add(id(r.candidate))
            out.append(r)
    return out


def table(ranked: list[Ranked], budget: float) -> str:
    head = ("#", "layout", "params", "grads", "optim", "activ.", "gathered", "peak MB", "fits",
            "calls", "wire MB", "bubble", "step ms", "overrides", "split ms")  # fmt: skip
    rows = [head]
    for i, r in enumerate(ranked, start=1):
        p, m = r.prediction, r.prediction["memory"]
        comm = p["comm"] or {}
        step = p["step_time_s"]
        rows.append((
            str(i), p["layout"],
            *(f"{m[k] / MB:.1f}" if m[k] is not None else "-"
              for k in ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "gathered_bytes")),
            f"{r.footprint() / MB:.1f}", "yes" if r.fits else "NO",
            f"{comm.get('calls', 0)}", f"{comm.get('wire_bytes', 0) / MB:.2f}", f"{p['bubble']:.2f}",
            f"{step * 1000:.1f}" if step is not None else f"comm {p['comm_time_s'] * 1000:.1f}",
            " ".join(r.overrides), split_cell(p.get("split")),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines) + f"\nmemory budget: {budget / MB:.0f} MB per rank (plan.memory_budget_mb)"


def split_cell(split: dict | None) -> str:
    """A step's terms in ms, in SPLIT's order: compute / memory-bound / bubble / exposed communication."""
    return "/".join(f"{split[k] * 1000:.1f}" for k in SPLIT) if split else "-"


def forecast_lines(cfg: DictConfig, world: int) -> str:
    """plan.search=false: the configured layout's forecast alone, its step taken apart (SPLIT)."""
    from framework.plan.predict import predict
    from framework.plan.profile import machine_profile

    profile = machine_profile(cfg, world)
    p = predict(cfg, world, profile)
    if p["step_time_s"] is None:
        raise ConfigError("plan.search", f"no step time for this model: {p['not_predicted']}")
    layout_dp = world // (cfg.parallel.get("tp", 1) * cfg.parallel.get("pp", 1) * cfg.parallel.get("cp", 1))
    tokens = cfg.data.batch_size * cfg.accumulation_steps * cfg.data.get("seq_len", 1) * max(1, layout_dp)
    step, rate = p["step_time_s"], tokens / p["step_time_s"] / world
    flops = p.get("model_flops_per_token") or 0
    lines = [
        f"{p['layout']} at {world} ranks: step {step:.4g} s, {rate:,.1f} tokens/s per rank, "
        f"{rate * flops / 1e12:.1f} model TFLOP/s per rank; peak {(p['peak_bytes'] or 0) / 2**30:.1f} GiB per rank",
        "split: " + ", ".join(f"{k.replace('_', ' ')} {v:.4g} s ({v / step:.0%})" for k, v in p["split"].items()),
        machine_lines(profile),
    ]
    if cfg.plan.get("gpu"):
        watts = cfg.plan.gpu_power_w
        lines.insert(2, f"power limit: {f'{watts:g} W' if watts else 'the TDP'} per GPU (plan.gpu_power_w)")
    return "\n".join(lines)


def machine_lines(profile: Profile) -> str:
    """The machine figures the forecast used, each with its source (config, probe, cache, datasheet,
    nominal): a figure this machine cannot measure for the planned job is the config's or nominal."""
    where = profile.sources or {}
    # probed or published kernels price the arithmetic operator by operator (a CPU's whatever
    # plan.peak_tflops says); without them, the FLOPs go at the peak
    priced = ("op by op", where.get("kernels")) if profile.kernels is not None else ("FLOPs at the peak", "no kernels")
    figures = [
        ("arithmetic", *priced),
        ("peak", f"{profile.peak_flops / 1e12:.3g} TFLOP/s per rank", where.get("peak_flops")),
        ("link within a node", f"{profile.intra_bytes_per_s / 1e9:.3g} GB/s", where.get("intra_bytes_per_s")),
        ("link across nodes", f"{profile.inter_bytes_per_s / 1e9:.3g} GB/s", where.get("inter_bytes_per_s")),
        ("latency", _latency(profile), where.get("latency_s")),
        ("overlap", f"{profile.overlap:.2f}", where.get("overlap")),
        ("op overhead", f"{profile.op_overhead_s * 1e6:.3g} us per op", where.get("op_overhead_s", "nominal")),
        ("process baseline", f"{profile.baseline_bytes / MB:.0f} MB", where.get("baseline_bytes")),
    ]
    probe = f"link probed with {profile.probe_ranks} local ranks" if profile.probe_ranks else "no link probe ran"
    return "machine: " + "; ".join(f"{n} {v} ({s})" for n, v, s in figures) + f"; {probe}"


def _latency(profile: Profile) -> str:
    by_op = profile.op_latency_s or {}
    if not by_op:
        return f"{profile.latency_s * 1e6:.3g} us per call"
    bandwidth = profile.op_bytes_per_s or {}
    return "per call " + ", ".join(
        f"{op} {s * 1e6:.3g} us" + (f" at {bandwidth[op] / 1e9:.3g} GB/s" if op in bandwidth else "")
        for op, s in by_op.items()
    )


def check_settings(cfg: DictConfig) -> None:
    """What train.py checks of the config (model, data, optimizer, adapters, paths, plan.gpu) but
    its layout: the planner ranks every layout itself, as if on one process here (the dry run
    checks the layout it is given, role by role)."""
    probe = cfg.copy()
    with open_dict(probe):
        probe.parallel.name, probe.launch.nproc_per_node = "none", 1
    validate(probe)


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    try:  # the overrides composed and checked as train.py does: a typo is one line naming the key
        cfg = compose_checked(argv)
        world = cfg.plan.world_size or world_size_of(cfg)
        if not cfg.plan.dry_run:
            check_settings(cfg)
        if cfg.plan.dry_run:
            from framework.plan.dry_run import report

            print(report(cfg, world))
            return 0
        if not cfg.plan.search:
            print(forecast_lines(cfg, world))
            return 0
        best, ranked, budget, profile = choose(cfg, world, with_profile=True)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    layouts = best_per_layout(ranked)
    print(f"{cfg.model._target_} at {world} ranks: {len(layouts)} layouts x memory knobs = {len(ranked)} "
          "combinations the config check accepts; each layout's best; per rank, per optimizer step")  # fmt: skip
    print(table(layouts, budget))
    print(machine_lines(profile))
    runners = [r for r in ranked if r.fits][1:4]
    print(f"parallel=auto would run: {best.prediction['layout']}  ({' '.join(best.overrides)})")
    for r in runners:
        print(f"  runner-up: {r.prediction['layout']}  ({' '.join(r.overrides)}): "
              f"{r.prediction['step_time_s'] * 1000 if r.prediction['step_time_s'] else float('nan'):.1f} ms, "
              f"peak {r.footprint() / MB:.0f} MB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
