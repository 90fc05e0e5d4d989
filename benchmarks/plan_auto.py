"""`parallel=auto` under a memory budget, against a measured sweep of the same knobs.

A gpt (4 blocks x 256, 4 heads, T=512, 16 samples per rank, fp32, AdamW) at world 2 (gloo), and
a per-rank budget that its own knobs (no checkpointing, the whole batch at once) exceed: what fits
takes gradient accumulation, pipeline micro-batches or activation checkpointing. Then
1. `train.py parallel=auto plan.memory_budget_mb=B`, once per budget: its peak read from outside
   (`/usr/bin/time -f %M` around the whole process tree, as benchmarks/plan_peak.py does) and its
   tokens/s (global tokens per step over the median step time, summary.json);
2. the sweep: what `python -m framework.plan` ranks at the first budget (the same search: the
   layouts times checkpointing every k, micro-batch against accumulation, pipeline micro-batches),
   each combination its own `train.py` (one process tree per run, so no peak is another's): the
   fastest predicted that fit, each layout's best that fits, the fastest with checkpointing, and
   the fastest the planner rejected. Each row: predicted against measured peak, whether it fits,
   predicted against measured step, tokens/s over the best that fits.

    python benchmarks/plan_auto.py [--budgets 1050,900] [--steps 5] [--top 4] [--quick]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from common import table, write_result
from plan_peak import outside_peak

from framework.config import compose
from framework.doors.plan import best_per_layout
from framework.plan import choose
from framework.plan.search import Ranked, merged

MODEL = ["experiment=smoke", "logger=none", "device=cpu", "launch.nproc_per_node=2", "model.n_layer=4",
         "model.n_embd=256", "model.n_head=4", "data.seq_len=512", "data.batch_size=16",
         "data.max_bytes=2000000"]  # fmt: skip
WORLD = 2
MB = 2**20
RATES = {"tokens_per_s": "median step", "fast_tokens_per_s": "fastest step"}


def measured(args: list[str], out: Path, name: str) -> dict:
    """One `train.py ARGS` run in its own process tree: the outside peak, the ranks' own peak,
    the step time, tokens/s (global tokens per step over the median step, and over the fastest
    step after the first: on shared cores, the least slowed by others), and the plan record."""
    run_dir = out / name
    peak = outside_peak(args, run_dir)
    s = json.loads((run_dir / "summary.json").read_text())
    step = s["step_time_s"]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fastest = min(m["step_time_s"] for m in steps if m.get("step_time_s") and m["step"] > 1)
    return {
        "peak_mb": peak / MB,
        "rank_peak_mb": s["memory"]["rss_peak_bytes"] / MB,
        "step_ms": step * 1000,
        "tokens_per_s": s["per_step"]["tokens"] / step,
        "fast_tokens_per_s": s["per_step"]["tokens"] / fastest,  # contention only slows a step
        "predicted_peak_mb": s["plan"]["predicted"]["peak_bytes"] / MB,
        "auto": s["plan"].get("auto"),
    }


def whole_batch(r: Ranked, pipeline_m: int | None = None) -> bool:
    """The layout at the config's own knobs: no checkpointing, no accumulation, the whole batch at
    once; a pipeline at `pipeline_m` micro-batches (None: its fewest)."""
    k, trial = r.knobs, r.candidate.cfg
    own = k.checkpoint_every == 0 and k.batch_size == trial.data.batch_size and k.accumulation_steps == 1
    return own and (k.n_microbatches is None or pipeline_m is None or k.n_microbatches == pipeline_m)


def sweep_rows(ranked: list[Ranked], top: int, quick: bool) -> list[Ranked]:
    """What the sweep measures: the `top` fastest predicted that fit, each layout's best that
    fits, the fastest with checkpointing that fits, and the two fastest the planner rejected."""
    fitting = [r for r in ranked if r.fits]
    rejected = [r for r in ranked if not r.fits][:2]
    if quick:
        return [fitting[0], rejected[0]]
    checkpointed = [r for r in fitting if r.knobs.checkpoint_every][:1]
    rows: list[Ranked] = []
    for r in [*fitting[:top], *best_per_layout(fitting), *checkpointed, *rejected]:
        if all(r is not seen for seen in rows):
            rows.append(r)
    return rows


def defaults_line(ranked: list[Ranked], budget: float) -> str:
    """Each layout's predicted footprint at the config's own knobs, against the budget."""

    def listed(rows: list[Ranked]) -> tuple[str, int]:
        parts = [f"{r.prediction['layout']} {r.footprint() / MB:.0f}{'' if r.fits else ' (over)'}" for r in rows]
        return "; ".join(parts), sum(not r.fits for r in rows)

    own: dict[int, Ranked] = {}  # each layout at its fewest micro-batches, in rank order
    for r in (r for r in ranked if whole_batch(r)):
        kept = own.get(id(r.candidate))
        if kept is None or (r.knobs.n_microbatches or 0) < (kept.knobs.n_microbatches or 0):
            own[id(r.candidate)] = r
    whole, over = listed(list(own.values()))
    group, _ = listed([r for r in ranked if whole_batch(r, 4) and r.knobs.n_microbatches])
    return (f"The planner's footprint per rank (MB) against the {budget / MB:.0f} MB budget, at the config's own knobs "
            f"(memory=none, data.batch_size=16, accumulation_steps=1; a pipeline at its fewest micro-batches): "
            f"{whole}: {over} of {len(own)} over. Pipelines at their group's default n_microbatches=4 (micro-batches "
            f"are the pipeline's accumulation): {group}.")  # fmt: skip


def sweep_table(rows: list[tuple[Ranked, dict]], autos: dict, budgets: list[int]) -> tuple[str, dict]:
    """The measured rows (auto's runs first), each against the best measured row that fits each budget."""
    best = {(b, k): max((m for _, m in rows if m["peak_mb"] <= b), key=lambda m: m[k], default=None)
            for b in budgets for k in RATES}  # fmt: skip
    main = {k: best[budgets[0], k] for k in RATES}
    out = []
    for label, r, m in [*((f"auto @ {b}", None, m) for b, m in autos.items()), *((i, r, m) for i, (r, m) in
                                                                               enumerate(rows, start=1))]:  # fmt: skip
        layout, overrides = (m["auto"]["layout"], " ".join(m["auto"]["overrides"])) if r is None else (
            r.prediction["layout"], " ".join(r.overrides))  # fmt: skip
        predicted_ms = auto_predicted_ms(m) if r is None else r.prediction["step_time_s"] * 1000
        out.append([label, layout, overrides, m["predicted_peak_mb"], m["peak_mb"], m["rank_peak_mb"],
                    " / ".join("yes" if m["peak_mb"] <= b else "NO" for b in budgets), predicted_ms,
                    m["step_ms"], m["tokens_per_s"], *(m[k] / main[k][k] if main[k] else None for k in RATES),
                    m["fast_tokens_per_s"]])  # fmt: skip
    fits = "fits " + " / ".join(f"{b}" for b in budgets)
    head = ["#", "layout", "overrides", "predicted peak MB", "measured peak MB", "rank's own peak MB", fits,
            "predicted ms/step", "measured ms/step (median)", "tokens/s (median step)",
            f"vs best fitting {budgets[0]} (median)", f"vs best fitting {budgets[0]} (fastest step)",
            "tokens/s (fastest step)"]  # fmt: skip
    return table(head, out), best


def auto_predicted_ms(m: dict) -> float | None:
    rows = [r for r in m["auto"]["ranked"] if r["overrides"] == " ".join(m["auto"]["overrides"])]
    return rows[0]["step_time_s"] * 1000 if rows and rows[0]["step_time_s"] is not None else None


def verdicts(autos: dict, best: dict, rows: list[tuple[Ranked, dict]]) -> list[str]:
    lines = []
    for b, m in autos.items():
        fits = m["peak_mb"] <= b
        lines.append(f"budget {b} MB: auto ran {m['auto']['layout']} ({' '.join(m['auto']['overrides'])}); measured "
                     f"peak {m['peak_mb']:.0f} MB (ranks' own {m['rank_peak_mb']:.0f}, predicted "
                     f"{m['predicted_peak_mb']:.0f}): {'fits' if fits else 'EXCEEDS the budget'}")  # fmt: skip
        for k, how in RATES.items():
            top = best[b, k]
            if top is None:
                lines.append(f"budget {b} MB: no measured row fits")
                break
            name = next(f"#{i} {r.prediction['layout']}" for i, (r, mm) in enumerate(rows, start=1) if mm is top)
            ratio = m[k] / top[k]
            lines.append(f"budget {b} MB: auto's tokens/s ({how}) over the best fitting measured ({name}): "
                         f"{m[k]:.0f} / {top[k]:.0f} = {ratio:.2f} (bound >= 0.90: "
                         f"{'PASS' if ratio >= 0.9 else 'FAIL'})")  # fmt: skip
    return lines


def peak_errors(rows: list[tuple[Ranked, dict]]) -> str:
    """The peak forecast's error by kind of knob: where the model is short, a pick near the budget
    can exceed it."""
    kinds: dict[str, list[float]] = {}
    for r, m in rows:
        k = r.knobs
        kind = "checkpointing" if k.checkpoint_every else ("accumulation" if k.accumulation_steps > 1 else (
            "pipeline micro-batches" if k.n_microbatches else "one batch"))  # fmt: skip
        kinds.setdefault(kind, []).append(m["rank_peak_mb"] / m["predicted_peak_mb"] - 1)
    return "ranks' own peak over the predicted, by knob: " + "; ".join(
        f"{kind} median {statistics.median(e):+.0%} (worst {max(e, key=abs):+.0%}, {len(e)} rows)"
        for kind, e in kinds.items())  # fmt: skip


def main(budgets: list[int], steps: int, top: int, quick: bool) -> None:
    base = [*MODEL, f"steps={steps}"]
    best, ranked, budget = choose(compose([*MODEL, f"plan.memory_budget_mb={budgets[0]}"]), WORLD)
    print(defaults_line(ranked, budget), flush=True)
    rows = sweep_rows(ranked, top, quick)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        autos = {}
        for b in budgets:
            autos[b] = measured([*base, "parallel=auto", f"plan.memory_budget_mb={b}"], out, f"auto_{b}")
            print(
                f"auto @ {b}: {autos[b]['auto']['layout']} {autos[b]['auto']['overrides']} {autos[b]}"[:300], flush=True
            )
        done = []
        for i, r in enumerate(rows, start=1):
            done.append((r, measured(list(merged(base, r.overrides)), out, f"row_{i}")))
            print(f"#{i} {r.prediction['layout']} {' '.join(r.overrides)}: {done[-1][1]}", flush=True)
    text, best_fit = sweep_table(done, autos, budgets)
    lines = [*verdicts(autos, best_fit, done), peak_errors(done)]
    text = "\n\n".join([defaults_line(ranked, budget), text, "\n".join(f"- {line}" for line in lines)])
    print(text)
    header = (f"`parallel=auto` under a per-rank memory budget on a gpt of 4 x 256 (4 heads, T=512, 16 samples "
              f"per rank, fp32, AdamW) at world {WORLD} (gloo), {steps} optimizer steps per run. Measured peak: "
              "`/usr/bin/time -f %M` around `python train.py` (the largest process of the tree: a rank, the "
              "launcher or the forkserver, whose own peak is about 800 MB on this machine whatever the model); "
              "the ranks' own: summary.json memory.rss_peak_bytes (the largest rank's VmHWM). Tokens/s: global "
              "tokens per step over the median step time (summary.json), and over the fastest step after the first "
              "(metrics.jsonl; contention from other work on the shared cores only slows a step). Rows: the fastest predicted combinations that fit "
              f"{budgets[0]} MB, each layout's best that fits, the fastest with checkpointing, the two fastest the "
              f"planner rejected. Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
              "(the cores are shared: step times are noisy; peaks are not).")  # fmt: skip
    flags = f"--budgets {','.join(map(str, budgets))} --steps {steps} --top {top}{' --quick' * quick}"
    write_result("plan_auto", f"python benchmarks/plan_auto.py {flags}", header, text)


def arg(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    main([int(b) for b in arg("--budgets", "1050" if quick else "1050,900").split(",")],
         int(arg("--steps", "2" if quick else "5")), int(arg("--top", "4")), quick)  # fmt: skip
