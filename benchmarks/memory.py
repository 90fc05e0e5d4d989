"""Memory per rank of each strategy and of activation checkpointing, measured (gpt, gloo on CPU).

    python benchmarks/memory.py

Model state = parameter + gradient + optimizer-state bytes a rank holds, counted from its tensors
(local shards under FSDP). Activations = peak bytes saved for backward in one micro-batch,
counted in saved_tensors_hooks. Step time ratios are against the plain run on the same world,
side by side in one run (these machines are shared: compare ratios, not seconds).
"""

from __future__ import annotations

from common import run, table

COMMON = ["experiment=smoke", "model.n_layer=8", "model.n_embd=128", "model.n_head=4", "data.seq_len=128",
          "data.batch_size=4", "steps=8", "metrics.sample_every=5"]  # fmt: skip


def state(s: dict) -> int:
    m = s["memory"]
    return m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"]


def model_state_table() -> None:
    rows = []
    for world in (2, 4):
        configs = {
            "ddp": ["parallel=ddp"],
            "fsdp full shard (ZeRO-3)": ["parallel=fsdp"],
            "fsdp shard-grad-op (ZeRO-2)": ["parallel=fsdp", "parallel.reshard_after_forward=false"],
            "fsdp1 FULL_SHARD": ["parallel=fsdp", "parallel.version=1"],
        }
        if world == 4:
            configs["hsdp 2 x 2 (hybrid shard)"] = ["parallel=fsdp", "parallel.dp_replicate=2"]
        got = run(configs, world, COMMON)
        base = got["ddp"]
        for name, s in got.items():
            m = s["memory"]
            rows.append([world, name, m["param_bytes"] / 1e6, m["grad_bytes"] / 1e6, m["optim_bytes"] / 1e6,
                         state(s) / 1e6, state(s) / state(base), s["step_time_s"] / base["step_time_s"]])  # fmt: skip
    print("Model state per rank (MB)\n")
    print(table(["world", "strategy", "params", "grads", "optimizer", "total", "vs ddp", "step time vs ddp"], rows))


def activation_table() -> None:
    configs = {
        "fp32, no checkpointing": ["parallel=ddp"],
        "fp32, checkpoint every block": ["parallel=ddp", "memory=checkpoint"],
        "fp32, checkpoint every 2nd block": ["parallel=ddp", "memory=checkpoint", "memory.checkpoint_every=2"],
        "bf16, no checkpointing": ["parallel=ddp", "precision=bf16"],
        "bf16, checkpoint every block": ["parallel=ddp", "precision=bf16", "memory=checkpoint"],
    }
    got = run(configs, 2, COMMON)
    base = got["fp32, no checkpointing"]
    rows = [[name, s["memory"]["activation_bytes"] / 1e6, s["memory"]["activation_bytes"] / base["memory"]["activation_bytes"],
             s["step_time_s"] / base["step_time_s"]] for name, s in got.items()]  # fmt: skip
    print("\nActivations saved for backward per rank (world 2, ddp, micro-batch 4 x 128 tokens)\n")
    print(table(["run", "saved MB", "vs fp32 plain", "step time vs fp32 plain"], rows))


def measuring_cost_table() -> None:
    """Whole-run time (every step, sampled ones included) with measuring off, sampled (the
    default, every 50 steps) and on every step. Off/sampled alternate, best of 3 each."""
    common = [*COMMON, "steps=100"]
    configs = {}
    for i in range(3):
        configs[f"off {i}"] = ["parallel=ddp", "metrics.sample_every=0"]
        configs[f"sampled {i}"] = ["parallel=ddp", "metrics.sample_every=50"]
    configs["every step"] = ["parallel=ddp", "metrics.sample_every=1"]
    got = run(configs, 2, common)
    # reported throughput leaves sampled steps out; the cost shows in the time of all steps
    wall = {name: s["train_time_s"] for name, s in got.items()}
    best = {kind: min(v for k, v in wall.items() if k.startswith(kind)) for kind in ("off", "sampled", "every")}
    rows = [[kind, best[kind], best[kind] / best["off"]] for kind in ("off", "sampled", "every")]
    print("\nCost of measuring memory and communication (world 2, ddp, 100 steps, best of 3)\n")
    print(table(["measuring", "run time (s)", "vs off"], rows))


if __name__ == "__main__":
    model_state_table()
    activation_table()
    measuring_cost_table()
