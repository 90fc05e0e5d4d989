"""`python -m framework.plan [overrides] plan.world_size=N`: every layout N ranks admit for the
composed config, ranked (those that fit `plan.memory_budget_mb` first, fastest first), with
predicted memory per rank by kind, collectives per step, bubble and step time. Trains nothing."""

from __future__ import annotations

import sys

from framework.config import ConfigError, compose, world_size_of
from framework.plan import Ranked, choose

MB = 2**20


def table(ranked: list[Ranked], budget: float) -> str:
    head = ("#", "layout", "params", "grads", "optim", "activ.", "gathered", "total MB", "fits",
            "calls", "wire MB", "bubble", "step ms", "overrides")  # fmt: skip
    rows = [head]
    for i, r in enumerate(ranked, start=1):
        p, m = r.prediction, r.prediction["memory"]
        comm = p["comm"] or {}
        step = p["step_time_s"]
        rows.append((
            str(i), p["layout"],
            *(f"{m[k] / MB:.1f}" if m[k] is not None else "-"
              for k in ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "gathered_bytes")),
            f"{p['total_bytes'] / MB:.1f}", "yes" if r.fits else "NO",
            f"{comm.get('calls', 0)}", f"{comm.get('wire_bytes', 0) / MB:.2f}", f"{p['bubble']:.2f}",
            f"{step * 1000:.1f}" if step is not None else f"comm {p['comm_time_s'] * 1000:.1f}",
            " ".join(r.candidate.overrides),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines) + f"\nmemory budget: {budget / MB:.0f} MB per rank (plan.memory_budget_mb)"


def main(argv: list[str]) -> int:
    cfg = compose(argv)
    world = cfg.plan.world_size or world_size_of(cfg)
    try:
        best, ranked, budget = choose(cfg, world)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{cfg.model._target_} at {world} ranks: {len(ranked)} layouts; per rank, per optimizer step")
    print(table(ranked, budget))
    print(f"parallel=auto would run: {best.prediction['layout']}  ({' '.join(best.candidate.overrides)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
