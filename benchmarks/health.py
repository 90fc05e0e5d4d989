"""What the health callbacks (framework/callbacks/health/, docs/health.md) catch and cost, on the
default gpt job under ddp x2 (`train.py`'s defaults, CPU, gloo), each fault injected with
HYDRADIST_FAULT:

1. loss spikes: a 100x loss at step 20 of 60, with callbacks.spike.action=warn|skip|rollback,
   against the same run without the spike: final losses side by side;
2. stragglers: rank 1 +50 ms a step from step 6, callbacks.straggler.every=5: what each report says;
3. silent corruption: a bit flipped in rank 1 of 3 before step 8, callbacks.checksum.every=5: when it
   is caught and whom it names; and what a check costs: the checksum on every step against none,
   in alternating pairs (A B B A), per step of goodput's productive time (which holds the checks;
   the step windows of step_time_s do not), scaled to the default interval of 100 steps;
4. goodput: a run with a restart (rank 1 dies before step 11), two saves and an evaluation: its parts;
5. false alarms: the spike guard on healthy training, converging's clean runs (every family, 300 steps;
   benchmarks/converging.py) with the default guard on (action=warn: what it flags is what rollback
   would roll back), then each run's logged loss and gradient norm scored again by the guard at smaller
   windows, warm-ups and thresholds (calibration.replay: the same arithmetic, offline). The config
   check refuses any setting that flags a step of these runs (framework/callbacks/health/calibration.py).

    python benchmarks/health.py                       # about 20 minutes on 2 cores (5. is most of it)
    python benchmarks/health.py --pairs 3 --keep DIR  # 5.'s runs kept in DIR (and reused when there)
    python benchmarks/health.py --only false_alarms --write-calibration  # 5. alone; its runs become the
                                                      # config check's data (framework/callbacks/health/clean_runs.json)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import recorded, table  # noqa: E402

BASE = ["device=cpu", "logger=none", "progress=false", "parallel=ddp"]


def train(args: list[str], out: Path, fault: str | None = None) -> tuple[dict, list[dict], str, float]:
    """(summary, metrics lines, console, wall seconds) of one `python train.py` run."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRADIST_FAULT"} | {"WANDB_MODE": "offline"}
    if fault:
        env["HYDRADIST_FAULT"] = fault
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *BASE, *args, f"hydra.run.dir={out}"],
                          cwd=ROOT, env=env, capture_output=True, text=True)  # fmt: skip
    wall = time.time() - t0
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] if summary else []
    return summary, lines, proc.stdout + proc.stderr, wall


def tail_loss(lines: list[dict]) -> float:
    """The final loss, as the mean of the last 10 steps' (one step's loss is one batch's: noisy)."""
    return statistics.mean(m["loss"] for m in lines[-10:])


def spikes(tmp: Path) -> None:
    args = ["steps=60", "checkpoint.every=10", "callbacks.spike.window=16", "callbacks.spike.watch=[loss]"]
    _, lines, _, _ = train([*args, "callbacks.spike.action=warn"], tmp / "clean")
    clean = tail_loss(lines)
    rows = [["no spike", "-", clean, "-", "-"]]
    for action in ("warn", "skip", "rollback"):
        s, lines, _, _ = train([*args, f"callbacks.spike.action={action}"], tmp / action, "0:19:spike")
        event = s["spike"]["events"][0]
        at = event.get("data_resumes_at", {})
        what = f"to step {event.get('rolled_back_to')}, the data on from sample {at.get('samples')}" if action == "rollback" \
            else ("update skipped" if action == "skip" else "applied")  # fmt: skip
        rows.append([f"spike at 20, {action}", f"step {event['step']}, score {event['figures']['loss']['score']:.0f}",
                     tail_loss(lines), f"{tail_loss(lines) / clean - 1:+.2%}", what])  # fmt: skip
    print("## 1. Loss spikes (100x at step 20 of 60; window 16, robust z-score > 6)\n")
    print(table(["run", "flagged", "final loss (mean of steps 51-60)", "vs no spike", "action"], rows) + "\n")


def stragglers(tmp: Path) -> None:
    s, _, console, _ = train(["steps=30", "callbacks.straggler.every=5"], tmp / "slow", "1:5:slow")
    rows = [[h["step"], h["slowest_rank"], h["excess_s"] * 1000, *(t * 1000 for t in h["compute_s"])]
            for h in s["straggler"]["history"]]  # fmt: skip
    print("## 2. Stragglers (rank 1: +50 ms a step from step 6; reports every 5 steps)\n")
    print(table(["report after step", "slowest rank", "excess (ms)", "rank 0 compute (ms)", "rank 1 compute (ms)"],
                rows) + "\n")  # fmt: skip
    named = [line for line in console.splitlines() if line.startswith("straggler at step")]
    print(f"First console line: `{named[0] if named else 'none'}`\n")


def corruption(tmp: Path, pairs: int) -> None:
    args = ["steps=20", "launch.nproc_per_node=3", "checkpoint.every=5", "callbacks.checksum.every=5",
            "callbacks.checksum.on_mismatch=rollback"]  # fmt: skip
    s, _, console, _ = train(args, tmp / "flip", "1:7:bitflip")
    caught = [line for line in console.splitlines() if "silent data corruption" in line]
    print("## 3. Silent corruption (one bit of rank 1 of 3 flipped before step 8; checks every 5 steps)\n")
    print(f"Caught: `{caught[0] if caught else 'not caught'}`; summary.checksum.mismatches: "
          f"{s['checksum']['mismatches']}\n")  # fmt: skip
    per_step: dict[str, list[float]] = {"off": [], "every step": []}
    for k in range(pairs):  # A B, B A: the machine's drift falls on both alike
        order = [("off", []), ("every step", ["callbacks.checksum.every=1"])]
        for name, extra in order if k % 2 == 0 else order[::-1]:
            s, *_ = train(["steps=60", *extra], tmp / f"cost-{name.replace(' ', '_')}-{k}")
            per_step[name].append(s["goodput"]["productive_s"] / 60)
    off, on = statistics.median(per_step["off"]), statistics.median(per_step["every step"])
    rows = [[name, statistics.median(v) * 1000] for name, v in per_step.items()]
    print(table(["checksum", "productive time per step (ms, median of pairs)"], rows) + "\n")
    alone, in_run = time_one_check() / off, max(0.0, on / off - 1)
    print(f"One check timed alone, on this model in this process: {alone:.2%} of a step. In a run (the check, its "
          f"all-gather and the settle it asks for), every step against none: {in_run:+.1%} a step (pairs: noise of "
          f"a few percent). Taking the larger: at 100 steps apart **{max(alone, in_run) / 100:.3%}** of step time, "
          f"at 10 apart {max(alone, in_run) / 10:.2%}.\n")  # fmt: skip


def time_one_check(repeats: int = 20) -> float:
    """Seconds of one checksum of the default gpt's parameters (what a rank computes; the
    all-gather of one integer beside it is a few microseconds here)."""
    from common import config

    from framework.callbacks.health.checksum import checksum
    from framework.contract import build_model

    model = build_model(config(["parallel=none"])["model"], "cpu")
    checksum(model)
    t0 = time.perf_counter()
    for _ in range(repeats):
        checksum(model)
    return (time.perf_counter() - t0) / repeats


def goodput(tmp: Path) -> None:
    args = ["steps=14", "checkpoint.every=7", "launch.max_restarts=1", "eval.every=7", "data.val_fraction=0.1",
            "eval.steps=2"]  # fmt: skip
    s, _, _, outside = train(args, tmp / "goodput", "1:10")
    g = s["goodput"]
    parts = {k[:-2]: v for k, v in g.items() if k.endswith("_s") and k != "wall_s"}
    rows = [[k, v, v / g["wall_s"]] for k, v in parts.items()]
    rows.append(["**sum of parts**", sum(parts.values()), sum(parts.values()) / g["wall_s"]])
    print("## 4. Goodput (a restart: rank 1 dies before step 11, resumed from step 7; saves at 7 and 14; "
          "evaluations at 7 and 14)\n")  # fmt: skip
    print(table(["part", "seconds", "of wall"], rows) + "\n")
    print(f"Wall time {g['wall_s']:.2f} s (the job's start to the end of training; timed from outside: "
          f"{outside:.2f} s, the rest being the summary, W&B and exit). Goodput {g['goodput']:.1%}.\n")  # fmt: skip


def false_alarms(tmp: Path, keep: Path | None, write: bool) -> None:
    import converging

    from framework.callbacks.health.calibration import CLEAN_RUNS, replay

    root = keep or tmp / "converging"
    root.mkdir(parents=True, exist_ok=True)
    data = converging.corpus(root / "grammar.txt")
    runs, in_run = {}, []
    bf16 = [run for run in converging.RUNS if run[1] not in converging.REFERENCE]  # the ten; float8's are last
    for i, (family, model, layout) in enumerate(bf16):
        out = root / f"run{i}"
        if not (out / "summary.json").exists():
            converging.train(out, [*converging.overrides(model, layout, data), "callbacks.spike.action=warn"])
        lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        block = json.loads((out / "summary.json").read_text())["spike"]
        runs[f"{family} {model}"] = {k: [float(f"{m[k]:.5g}") for m in lines] for k in ("loss", "grad_norm")}
        in_run.append([f"{family} {model}", len(lines), max(0, len(lines) - 128), block["count"]])
    if write:  # what the config check replays (framework/callbacks/health/calibration.py)
        CLEAN_RUNS.write_text(json.dumps({"command": "python benchmarks/health.py --only false_alarms "
                                          "--write-calibration", "runs": runs}) + "\n")  # fmt: skip
    series = {name: [dict(zip(r, v, strict=True)) for v in zip(*r.values(), strict=True)] for name, r in runs.items()}
    print("## 5. False alarms on healthy training (converging's clean runs, 300 steps each)\n")
    print("The default guard (window 128, warm-up 128, robust z-score > 6, loss and gradient norm) in each run, "
          "action=warn (a flag is a rollback that action=rollback would make):\n")  # fmt: skip
    print(table(["run", "steps", "steps scored", "flagged"], in_run) + "\n")
    thresholds = [("zscore", 2.0), ("zscore", 3.0), ("zscore", 4.0), ("zscore", 6.0), ("ratio", 1.5), ("ratio", 2.0)]
    for watch in (("loss", "grad_norm"), ("loss",)):
        rows = []
        for window, warmup in [(w, u) for w in (8, 16, 32, 64, 128) for u in (8, 16, 32, 64, 128) if u <= w]:
            counts = [sum(sum(replay(s, window=window, warmup=warmup, watch=watch, zscore=value if kind ==
                      "zscore" else None, ratio=value if kind == "ratio" else None)) for s in series.values())
                      for kind, value in thresholds]  # fmt: skip
            rows.append([window, warmup, *counts])
        print(f"Watching {', '.join(watch)}: every run's logged series scored again (calibration.replay), the steps "
              f"flagged summed over the {len(series)} runs ({sum(len(s) for s in series.values())} steps):\n")  # fmt: skip
        print(table(["window", "warm-up", *(f"{k} > {v:g}" for k, v in thresholds)], rows) + "\n")
    print("The config check refuses every setting whose count is not 0 (framework/callbacks/health/calibration.py "
          "replays the user's own settings over these runs), naming the smallest window that flags none.\n")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--keep", type=Path, default=None, help="5.'s runs in this folder (reused when there)")
    parser.add_argument("--write-calibration", action="store_true", help="5.'s runs into the config check's data")
    parser.add_argument("--only", choices=("spikes", "stragglers", "corruption", "goodput", "false_alarms"))
    args = parser.parse_args()
    # one part alone prints its table, and docs/results/health.md (all five) is left as it is
    with tempfile.TemporaryDirectory() as out, nullcontext() if args.only else recorded("health"):
        tmp = Path(out)
        parts = {"spikes": lambda: spikes(tmp), "stragglers": lambda: stragglers(tmp),
                 "corruption": lambda: corruption(tmp, args.pairs), "goodput": lambda: goodput(tmp),
                 "false_alarms": lambda: false_alarms(tmp, args.keep, args.write_calibration)}  # fmt: skip
        for name, part in parts.items():
            if args.only in (None, name):
                part()


if __name__ == "__main__":
    main()
