"""Communication per optimizer step of each strategy, measured (gpt, world size 2, gloo on CPU).

    python benchmarks/comm.py

Bytes are the payload of each collective (an all-reduce's tensor, an all-gather's gathered
output, a reduce-scatter's input, a send's tensor); wire bytes are what one rank sends under ring
algorithms. `ring bound` is the ring all-reduce's 2(N-1)/N x the gradient payload, DDP's ideal.
"""

from __future__ import annotations

from common import recorded, run, table

COMMON = ["experiment=smoke", "model.n_layer=4", "model.n_embd=128", "model.n_head=4", "data.seq_len=64",
          "data.batch_size=8", "steps=12", "metrics.sample_every=5"]  # fmt: skip
ROWS = {
    "ddp": ["parallel=ddp"],
    "ddp + accumulation 4": ["parallel=ddp", "accumulation_steps=4"],
    "ddp + bf16 hook": ["parallel=ddp", "parallel.comm_hook=bf16"],
    "ddp + PowerSGD (rank 1)": ["parallel=ddp", "parallel.comm_hook=powersgd"],
    "fsdp": ["parallel=fsdp"],
    "fsdp + accumulation 4 (sync skipped)": ["parallel=fsdp", "accumulation_steps=4"],
    "fsdp + accumulation 4 (sync every)": ["parallel=fsdp", "accumulation_steps=4", "parallel.sync_every_microbatch=true"],
    "tp (sequence parallel)": ["parallel=tp", "data.batch_size=16"],
    "pp (1F1B, 4 micro-batches)": ["parallel=pp", "data.batch_size=16"],
}  # fmt: skip


def main() -> None:
    world = 2
    got = run(ROWS, world, COMMON)
    ddp = got["ddp"]
    grad_bytes = ddp["memory"]["param_bytes"]
    ring = 2 * (world - 1) / world * grad_bytes
    rows = []
    for name, s in got.items():
        c = s["comm"]
        ops = ", ".join(f"{op} {v['calls']:g}" for op, v in c["by_op"].items())
        rows.append([
            name, c["calls"], ops, c["bytes"] / 1e6, c["bytes"] / s["global_batch_size"] / 1e3, c["wire_bytes"] / 1e6,
            c["wire_bytes"] / ddp["comm"]["wire_bytes"], s["throughput"]["tokens_per_s"] / ddp["throughput"]["tokens_per_s"],
        ])  # fmt: skip
    print(f"gpt {grad_bytes / 4e6:.2f}M params, world size {world}, per optimizer step, rank that sends most\n")
    print(
        table(
            ["strategy", "calls", "calls by op", "MB", "KB / sample", "wire MB", "wire vs ddp", "tokens/s vs ddp"], rows
        )
    )
    print(
        f"\nring all-reduce bound for the gradients: 2(N-1)/N x {grad_bytes / 1e6:.3f} MB = {ring / 1e6:.3f} MB per rank"
    )


if __name__ == "__main__":
    with recorded("comm"):
        main()
