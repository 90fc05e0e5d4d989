"""The optimizer components side by side in one run: AdamW, SGD and Muon (framework/optimizers) on
one process and under fsdp x2 and tp x2. For each: the step time as a ratio to AdamW's in the same
layout, the optimizer state per rank measured beside the planner's price of it (Muon: a momentum
for each block matrix, AdamW's moments for the rest), the communication per step measured beside
the forecast (Muon gathers each sharded matrix whole in its step), and the final loss.
A 4-block gpt (n_embd 256, sequence 256, 8 samples a step), fp32.

    python benchmarks/optimizers.py              # writes docs/results/optimizers.md
    python benchmarks/optimizers.py --steps 4    # quick
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import recorded, run, table  # noqa: E402

MODEL = ["experiment=smoke", "model.n_layer=4", "model.n_embd=256", "model.n_head=4", "data.seq_len=256",
         "data.max_bytes=2000000", "metrics.sample_every=2"]  # fmt: skip
OPTIMIZERS = {"adamw": ["optim=adamw"], "sgd": ["optim=sgd", "optim.lr=0.05"], "muon": ["optim=muon"]}
LAYOUTS = {"one process": (1, ["parallel=none", "data.batch_size=8"]),
           "fsdp x2": (2, ["parallel=fsdp", "data.batch_size=4"]),
           "tp x2": (2, ["parallel=tp", "data.batch_size=8"])}  # fmt: skip
MB = 2**20


def _error(s: dict, key: str) -> str:
    error = s["plan"]["error"].get(key)
    return "-" if error is None else f"{error:+.1%}"


def rows_of(layout: str, summaries: dict[str, dict]) -> list[list]:
    out = []
    for name, s in summaries.items():
        measured, predicted = s["plan"]["measured"], s["plan"]["predicted"]
        out.append([layout, name, s["step_time_s"] / summaries["adamw"]["step_time_s"],
                    measured["optim_bytes"] / MB, predicted["optim_bytes"] / MB, _error(s, "optim_bytes"),
                    (measured["wire_bytes"] or 0) / MB, (predicted["wire_bytes"] or 0) / MB, _error(s, "wire_bytes"),
                    measured["comm_calls"], predicted["comm_calls"], s["final_loss"]])  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    rows = []
    for layout, (world, args) in LAYOUTS.items():
        summaries = run(OPTIMIZERS, world, [*MODEL, *args, f"steps={a.steps}"])
        rows += rows_of(layout, summaries)
        print(f"{layout}: done", file=sys.stderr, flush=True)
    print(f"\n4-block gpt, n_embd 256, sequence 256, 8 samples a step, fp32, {a.steps} steps; step time: median of "
          "the unsampled steps, as a ratio to AdamW's in the same layout; optimizer state and communication per "
          "rank and step, measured (summary.json) beside the planner's forecast\n")  # fmt: skip
    heads = ["layout", "optim", "step time / adamw", "optim state MB", "forecast MB", "error", "wire MB / step",
             "forecast wire MB", "error", "calls / step", "forecast calls", "final loss"]  # fmt: skip
    print(table(heads, rows))


if __name__ == "__main__":
    with recorded("optimizers"):
        main()
