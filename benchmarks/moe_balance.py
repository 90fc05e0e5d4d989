"""The mixture of experts' balance over the global batch (model.moe.balance_scope=global, the
default) against each micro-batch's own (micro): a tiny MoE Llama, 5 steps in fp32 on a global
batch of 8, under one process and every layout the default must equal it in; for each, the
largest relative gap to one process over the losses and gradient norms of the 5 steps, and each
step's collectives (from its start to its figures' all-reduce) beside the dense model's.

    python benchmarks/moe_balance.py            # writes docs/results/moe_balance.md
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import recorded, table  # noqa: E402

MODEL = ["model=llama", "model.flavor=debug_moe", "model.dim=32", "model.n_layers=2", "model.n_heads=4",
         "model.n_kv_heads=2", "model.ffn_hidden=64", "model.moe.experts=4", "model.moe.top_k=2", "data.seq_len=16",
         "data.max_bytes=20000", "steps=5", "progress=false", "logger=none", "device=cpu", "metrics.sample_every=0",
         "+callbacks.count._target_=tests.probes.CountCollectives"]  # fmt: skip
LAYOUTS = {
    "ddp x2": ["parallel=ddp", "launch.nproc_per_node=2", "data.batch_size=4"],
    "fsdp x2": ["parallel=fsdp", "launch.nproc_per_node=2", "data.batch_size=4"],
    "ep x2 (fsdp)": ["parallel=fsdp", "parallel.ep=2", "launch.nproc_per_node=2", "data.batch_size=4"],
    "pp x2 (4 micro-batches)": ["parallel=pp", "launch.nproc_per_node=2", "data.batch_size=8"],
    "fsdp x2, 2 micro-batches": ["parallel=fsdp", "launch.nproc_per_node=2", "data.batch_size=2",
                                 "accumulation_steps=2"],
}  # fmt: skip


def train(out: Path, *overrides: str) -> tuple[list[float], list[dict[str, int]]]:
    """The run's losses then gradient norms, and rank 0's collectives a step."""
    args = [sys.executable, str(ROOT / "train.py"), *MODEL, *overrides, f"hydra.run.dir={out}"]
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    subprocess.run(args, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = json.loads((out / "collectives-rank0.json").read_text())
    return [m["loss"] for m in metrics] + [m["grad_norm"] for m in metrics], steps


def gap(got: list[float], want: list[float]) -> float:
    return max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))


def calls(steps: list[dict[str, int]]) -> str:
    """A steady step's collectives, as `op x calls`."""
    return ", ".join(f"{op} x{n}" for op, n in sorted(steps[-1].items()))


def main() -> None:
    rows, dense = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, layout in LAYOUTS.items():
            plain = [a for a in layout if not a.startswith("parallel.ep=")]  # a dense model has no experts to split
            dense[name] = calls(train(Path(tmp) / f"dense-{len(dense)}", *plain, "model.moe.experts=0")[1])
        for scope in ("global", "micro"):
            scoped = [f"model.moe.balance_scope={scope}"]
            want, _ = train(Path(tmp) / f"one-{scope}", "parallel=none", "data.batch_size=8", *scoped)
            for name, layout in LAYOUTS.items():
                got, steps = train(Path(tmp) / f"{scope}-{len(rows)}", *layout, *scoped)
                rows.append([scope, name, gap(got, want), calls(steps), dense[name]])
                print(f"{scope} {name}: {rows[-1][2]:.2e}", flush=True)
    print(
        "\ntiny MoE Llama (4 experts, top 2, 2 blocks), global batch 8 x 16 tokens, 5 steps, fp32, balance=aux_loss\n"
    )
    heads = ["balance_scope", "layout", "largest gap to one process (losses, grad norms)", "collectives a step",
             "the dense model's"]  # fmt: skip
    print(table(heads, rows))


if __name__ == "__main__":
    with recorded("moe_balance"):
        main()
