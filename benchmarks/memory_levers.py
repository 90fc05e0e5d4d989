"""Every memory lever against none, side by side in one run: the activations each keeps (the
meter's peak, summary.json memory.activation_bytes) beside the planner's forecast, the saving, the
gradients held after the step, the step time as a ratio to no lever, and whether the losses equal
the lever-free run's (fp32; for the step in backward, the same run without clipping, which it
cannot do).
A 4-block gpt (n_embd 256, sequence 256, 8 samples a step) on one process and under fsdp x2.

    python benchmarks/memory_levers.py            # writes docs/results/memory_levers.md
    python benchmarks/memory_levers.py --steps 12

On the CPU the host is the device: activation offload keeps what it would move (its hooks and
bookkeeping are its cost here); on CUDA its tensors leave the device (the planner's forecast for
plan.gpu shows the saving). Selective checkpointing recomputes only the cheap operators, so its
cost sits between none and full checkpointing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import recorded, run, table  # noqa: E402

MODEL = ["experiment=smoke", "model.n_layer=4", "model.n_embd=256", "model.n_head=4", "data.seq_len=256",
         "data.max_bytes=2000000", "metrics.sample_every=4"]  # fmt: skip
LEVERS = {
    "none": [],
    "checkpoint (every block)": ["memory=checkpoint"],
    "selective (matmul, attention)": ["memory=selective"],
    "selective (matmul)": ["memory=selective", "memory.save_ops=[matmul]"],
    "selective every 2nd block": ["memory=selective", "memory.checkpoint_every=2"],
    "offload_activations": ["memory=offload_activations"],
    "no clipping (the next row's reference)": ["optim.grad_clip=0"],
    "optim.in_backward (no clipping)": ["optim.grad_clip=0", "optim.in_backward=true"],
    "compile=true (the next rows' reference)": ["compile=true"],
    "budget 0.5 (compile)": ["compile=true", "memory=budget", "memory.activation_budget=0.5"],
    "budget 0.25 (compile)": ["compile=true", "memory=budget", "memory.activation_budget=0.25"],
}
REFERENCE = {"optim.in_backward (no clipping)": "no clipping (the next row's reference)",
             "budget 0.5 (compile)": "compile=true (the next rows' reference)",
             "budget 0.25 (compile)": "compile=true (the next rows' reference)"}  # fmt: skip
LAYOUTS = {"one process": (1, ["parallel=none", "data.batch_size=8"]),
           "fsdp x2": (2, ["parallel=fsdp", "data.batch_size=4"])}  # fmt: skip
MB = 2**20


def rows_of(layout: str, summaries: dict[str, dict]) -> list[list]:
    out = []
    for name, s in summaries.items():
        plain = summaries[REFERENCE.get(name, "none")]
        measured, predicted = (s["plan"][k]["activation_bytes"] for k in ("measured", "predicted"))
        error = s["plan"]["error"]["activation_bytes"]
        ratio = s["final_loss"] / plain["final_loss"] - 1
        out.append([layout, name, measured / MB, predicted / MB, f"{error:+.2%}" if error is not None else "-",
                    f"{1 - measured / plain['plan']['measured']['activation_bytes']:.0%}",
                    s["memory"]["grad_bytes"] / MB, s["step_time_s"] / plain["step_time_s"],
                    "bitwise" if ratio == 0 else f"{ratio:+.1e}"])  # fmt: skip
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    rows = []
    for layout, (world, args) in LAYOUTS.items():
        summaries = run(LEVERS, world, [*MODEL, *args, f"steps={a.steps}"])
        rows += rows_of(layout, summaries)
        print(f"{layout}: done", file=sys.stderr, flush=True)
    print(f"\n4-block gpt, n_embd 256, sequence 256, 8 samples a step, fp32, {a.steps} steps; step time: "
          "median of the unsampled steps, as a ratio to the lever's reference in the same layout (no lever; "
          "for the step in backward the run without clipping, for the compiler's budget compile alone)\n")  # fmt: skip
    heads = ["layout", "lever", "activations MB (measured)", "forecast MB", "forecast error", "saved vs reference",
             "gradients MB held", "step time / reference", "final loss vs reference"]  # fmt: skip
    print(table(heads, rows))


if __name__ == "__main__":
    with recorded("memory_levers"):
        main()
