"""The planner against measurement, on this machine.

1. Accuracy: layouts at world sizes 2 and 4 (gpt 4 x 256, T=64, 8 samples per rank, fp32, bf16
   and checkpointing rows), and the same layouts on a second, wider and deeper shape (8 x 384) that
   no figure was calibrated on; each run checks its own prediction (summary.json `plan`): the
   relative error of parameter, gradient, optimizer, saved-activation and wire bytes, calls, step
   time and peak. The step-time errors' median and worst per shape are printed under the table.
2. The pick (`--pick`): every candidate `python -m framework.plan` ranks at world 2 (the default
   gpt, an ample budget), trained in one sweep; the planner's pick against the fastest measured.

    python benchmarks/plan.py [--steps N] [--repeat R] [--quick] [--pick]      # writes docs/results/plan.md
    python benchmarks/plan.py --replan    # the planner as it is now, against the runs last measured
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from common import ROOT, config, run, table, write_result
from omegaconf import OmegaConf

from framework.config import compose
from framework.doors.plan import best_per_layout
from framework.plan import check, choose, predict
from framework.plan.profile import machine_profile

MODEL = ["experiment=smoke", "model.n_layer=4", "model.n_embd=256", "model.n_head=4", "data.seq_len=64",
         "data.batch_size=8", "data.max_bytes=2000000"]  # fmt: skip
WIDER = ["model.n_layer=8", "model.n_embd=384", "model.n_head=8"]  # the shape no figure was calibrated on
FIGURES = ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "wire_bytes", "comm_calls", "step_time_s",
           "peak_bytes")  # fmt: skip

ACCURACY = {
    2: {
        "ddp": ["parallel=ddp"],
        "ddp bf16 checkpoint": ["parallel=ddp", "precision=bf16", "memory=checkpoint"],
        "fsdp": ["parallel=fsdp"],
        "fsdp(grad_op)": ["parallel=fsdp", "parallel.reshard_after_forward=false"],
        "fsdp bf16": ["parallel=fsdp", "precision=bf16"],
        "fsdp1": ["parallel=fsdp", "parallel.version=1"],
        "tp": ["parallel=tp"],
        "tp no sequence parallel": ["parallel=tp", "parallel.sequence_parallel=false"],
        "pp GPipe": ["parallel=pp", "parallel.schedule=GPipe"],
        "pp 1F1B": ["parallel=pp"],
        "pp Interleaved1F1B": ["parallel=pp", "parallel.schedule=Interleaved1F1B"],
        "pp InterleavedZeroBubble": ["parallel=pp", "parallel.schedule=InterleavedZeroBubble"],
        "pp ZBVZeroBubble": ["parallel=pp", "parallel.schedule=ZBVZeroBubble"],
    },
    4: {
        "ddp": ["parallel=ddp"],
        "fsdp checkpoint": ["parallel=fsdp", "memory=checkpoint"],
        "hsdp 2x2": ["parallel=fsdp", "parallel.dp_replicate=2"],
        "tp": ["parallel=tp"],
        "pp 1F1B": ["parallel=pp"],
        "hybrid dp2 x tp2": ["parallel=hybrid", "parallel.tp=2", "parallel.pp=1"],
        "hybrid dp2 x pp2": ["parallel=hybrid", "parallel.tp=1", "parallel.pp=2"],
        "hybrid pp2 x tp2": ["parallel=hybrid", "parallel.tp=2", "parallel.pp=2"],
    },
}


QUICK = {2: ("ddp", "fsdp", "tp", "pp 1F1B"), 4: ("ddp", "fsdp checkpoint", "hybrid dp2 x tp2")}


# what the accuracy runs measured, for --replan (beside the table: HYDRADIST_RESULTS_DIR moves both)
RUNS = Path(os.environ.get("HYDRADIST_RESULTS_DIR", ROOT / "docs" / "results")) / "plan_runs.json"


def measure(steps: int, quick: bool = False, repeat: int = 1) -> dict[str, dict]:
    """Train every layout (`quick`: a few per world, a busy machine's run), the whole sweep
    `repeat` times (a shared machine's speed drifts by 10 to 20% over minutes: each row keeps its
    median run); {"shape|world|layout": the overrides and what the run measured}, also written to RUNS."""
    plan = {w: {k: v for k, v in ls.items() if not quick or k in QUICK[w]} for w, ls in ACCURACY.items()}
    for world in ACCURACY:  # this machine's figures for each world and dtype, probed once (cached) before the runs
        for precision in ("fp32", "bf16"):
            cfg = compose([*MODEL, f"launch.nproc_per_node={world}", "device=cpu", f"precision={precision}"])
            machine_profile(cfg, world, "probe")
    runs = {}
    for _ in range(repeat):
        for shape, extra in (("4 x 256", []), ("8 x 384", WIDER)):
            for world, layouts in plan.items():
                for name, summary in run(layouts, world, [*MODEL, f"steps={steps}", *extra]).items():
                    row = runs.setdefault(f"{shape}|{world}|{name}", {
                        "overrides": [*MODEL, f"steps={steps}", *extra, f"launch.nproc_per_node={world}", *layouts[name]],
                        "repeats": []})  # fmt: skip
                    row["repeats"].append({k: summary.get(k) for k in ("step_time_s", "memory", "comm")})
    for row in runs.values():
        row["measured"] = sorted(row["repeats"], key=lambda m: m["step_time_s"])[(len(row["repeats"]) - 1) // 2]
        row["step_times_s"] = [m["step_time_s"] for m in row.pop("repeats")]
    measured = {"steps": steps, "quick": quick, "repeat": repeat, "load": os.getloadavg()[0], "runs": runs}
    RUNS.write_text(json.dumps(measured, indent=1) + "\n")
    return measured


def accuracy(measured: dict) -> str:
    """The error table: each run's figures against the planner's prediction for its config, made
    now (so --replan reads a changed planner against the same measurements)."""
    rows, step_errors = [], {}
    for key, r in measured["runs"].items():
        shape, world, name = key.split("|")
        cfg = OmegaConf.create(config(r["overrides"]))
        block = check(predict(cfg, int(world), machine_profile(cfg, int(world), "cache")), r["measured"])
        err = block["error"]
        if err["step_time_s"] is not None:
            step_errors.setdefault(shape, []).append(abs(err["step_time_s"]))
        ms = [block[k]["step_time_s"] * 1000 for k in ("predicted", "measured")]
        rows.append([shape, int(world), name, *(f"{err[f]:+.1%}" if err[f] is not None else "-" for f in FIGURES), *ms])
    text = table(["shape", "world", "layout", "params", "grads", "optim", "activations", "wire bytes", "calls",
                  "step time", "peak", "predicted ms", "measured ms"], rows)  # fmt: skip
    for shape, errors in step_errors.items():
        text += (f"\n\nstep time, {shape}: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%} "
                 f"over {len(errors)} layouts")  # fmt: skip
    return text


def pick(world: int = 2) -> None:
    base = ["experiment=smoke", "model.n_layer=4", "model.n_embd=128", "model.n_head=4", "data.seq_len=128",
            "data.batch_size=8", "data.max_bytes=2000000"]  # fmt: skip
    best, ranked, _ = choose(compose(base), world)  # probes this machine's link once (cached)
    ranked = best_per_layout(ranked)
    rows = {r.prediction["layout"]: [*base, "steps=12", *r.overrides] for r in ranked if r.fits}
    measured = run(rows, world, [])
    fastest = max(measured.values(), key=lambda s: s["throughput"]["tokens_per_s"])
    out = []
    for i, r in enumerate(ranked, start=1):
        s = measured[r.prediction["layout"]]
        out.append([i, r.prediction["layout"], r.prediction["step_time_s"] * 1000, s["step_time_s"] * 1000,
                    s["throughput"]["tokens_per_s"], s["throughput"]["tokens_per_s"] / fastest["throughput"]["tokens_per_s"]])  # fmt: skip
    print(table(["predicted rank", "layout", "predicted ms/step", "measured ms/step", "tokens/s", "vs fastest"], out))
    ratio = measured[best.prediction["layout"]]["throughput"]["tokens_per_s"] / fastest["throughput"]["tokens_per_s"]
    print(f"planner's pick: {best.prediction['layout']}; its tokens/s over the fastest measured: {ratio:.2f}")


if __name__ == "__main__":
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 4
    quick = "--quick" in sys.argv
    replan = "--replan" in sys.argv  # the planner as it is now against the last measured runs (RUNS)
    repeat = int(sys.argv[sys.argv.index("--repeat") + 1]) if "--repeat" in sys.argv else 1
    measured = json.loads(RUNS.read_text()) if replan else measure(steps, quick, repeat)
    steps, quick, repeat = measured["steps"], measured["quick"], measured.get("repeat", 1)
    text = accuracy(measured)
    print(text)
    header = (f"Each run's figures against the planner's prediction for its config, {steps} optimizer steps per run, "
              f"the whole sweep run {repeat} time(s); each row is its median sweep's (a shared machine's speed "
              "drifts by 10 to 20% over minutes). The machine profile (kernels, in-situ factor, link) was probed "
              "once before the runs; '--replan' re-predicts the stored runs (docs/results/plan_runs.json) with the "
              f"planner as it is now. Load average at the end of the runs: {measured['load']:.1f} on "
              f"{os.cpu_count()} cores. The peak column is not a peak check: a sweep's runs share their worker "
              "processes, so a run's resident peak keeps what earlier runs left (docs/results/plan_peak.md checks "
              "the peak, one process per run).")  # fmt: skip
    command = (
        f"python benchmarks/plan.py --steps {steps} --repeat {repeat}{' --quick' * quick}" + " (then --replan)" * replan
    )
    write_result("plan", command, header, text)
    if "--pick" in sys.argv:
        pick()
