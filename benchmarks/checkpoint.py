"""What checkpointing costs a run, and what asynchronous saving gives back.

    python benchmarks/checkpoint.py

gpt (6 layers x 512, about 19M parameters; with AdamW about 0.3 GB of state) with DDP at world
size 2, 30 steps, a checkpoint every 5 steps (6 saves, to a temporary folder). For each way of
saving: the median step time, the seconds training waited per save (sync: the whole write; async:
copying the state aside, plus waiting for the previous save), and the run's training time with
those waits, against training without checkpoints.
"""

from __future__ import annotations

from common import run, table

COMMON = ["model=gpt", "data=text", "model.n_layer=6", "model.n_embd=512", "model.n_head=8", "data.seq_len=64",
          "data.batch_size=8", "steps=30", "metrics.sample_every=0", "parallel=ddp"]  # fmt: skip


def main() -> None:
    rows = {
        "no checkpoints": [],
        "sync (dcp.save)": ["checkpoint.every=5"],
        "async (dcp.async_save)": ["checkpoint.every=5", "checkpoint.async_save=true"],
    }
    summaries = run(rows, world=2, common=COMMON)
    base = summaries["no checkpoints"]["train_time_s"]
    out = []
    for name, s in summaries.items():
        saves, blocking = s["checkpoint"]["saves"], s["checkpoint"]["blocking_s"]
        total = s["train_time_s"] + blocking
        out.append([name, saves, s["step_time_s"] * 1000, blocking / saves if saves else None, total, total / base])
    print("checkpoint cost: gpt 19M params, ddp x2, 30 steps, a save every 5\n")
    print(table(["saving", "saves", "step ms (median)", "wait per save s", "train + waits s", "vs none"], out))


if __name__ == "__main__":
    main()
