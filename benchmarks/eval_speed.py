"""Evaluation tokens/s against training tokens/s: the default gpt under ddp x2 (gloo on CPU).

    python benchmarks/eval_speed.py [--repeats 3]

An evaluation runs forward only (no backward, no optimizer, no gradient all-reduce), so it should
read at least 2x the tokens per second training does. Both figures are global (all ranks): the
training rate is summary.throughput.tokens_per_s (evaluation is not in it), the evaluation rate
the validation tokens of the last evaluation over its seconds. Writes docs/results/eval_speed.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys

import torch
from common import ROOT, run, table

COMMON = ["model=gpt", "data=text", "parallel=ddp", "steps=12", "eval.every=12", "eval.steps=24",
          "data.val_fraction=0.05", "metrics.sample_every=0"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    rows, ratios = [], []
    for k in range(repeats):
        s = run({"ddp x2": []}, 2, COMMON)["ddp x2"]
        last = s["eval"]["history"][-1]
        train, evaluate = s["throughput"]["tokens_per_s"], last["terms"] / s["eval"]["eval_s"]
        ratios.append(evaluate / train)
        rows.append([k + 1, train, evaluate, evaluate / train])
    rows.append(["median", None, None, statistics.median(ratios)])
    text = table(["repeat", "training tokens/s", "evaluation tokens/s", "evaluation / training"], rows)
    machine = (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    header = (
        "# Evaluation vs training throughput (gpt defaults, ddp x2, gloo, CPU)\n\n"
        f"Command: `python benchmarks/eval_speed.py --repeats {repeats}`  \nMachine: {machine}\n\n"
    )
    print(text)
    out = ROOT / "docs" / "results" / "eval_speed.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + text + "\n")
    print(f"\nwritten to {out.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
