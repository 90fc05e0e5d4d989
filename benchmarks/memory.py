"""Memory per rank of each strategy and of activation checkpointing, measured (gpt, gloo on CPU).

    python benchmarks/memory.py            # every table
    python benchmarks/memory.py rss        # only the peak RSS table (issue 11's floors)

Model state = parameter + gradient + optimizer-state bytes a rank holds, counted from its tensors
(local shards under FSDP). Activations = peak bytes saved for backward in one micro-batch,
counted in saved_tensors_hooks. Step time ratios are against the plain run on the same world,
side by side in one run (these machines are shared: compare ratios, not seconds).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile

from common import ROOT, on_cpu, recorded, run, table

from framework.measure.memory import peak_rss_of

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


BIG = ["experiment=smoke", "logger=none", "progress=false", "model.n_layer=8", "model.n_embd=1024", "model.n_head=8",
       "data.seq_len=64", "data.batch_size=4", "steps=2"]  # fmt: skip


def outside_rss(overrides: list[str]) -> tuple[int, dict]:
    """Peak RSS (bytes) of the largest process of `train.py OVERRIDES`, read from outside, and
    the run's summary."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, str(ROOT / "train.py"), *on_cpu(overrides), f"hydra.run.dir={out}"]
        rss = peak_rss_of(cmd, cwd=ROOT, stdout=subprocess.DEVNULL)
        with open(f"{out}/summary.json") as f:
            return rss, json.load(f)


def rss_table() -> None:
    """gpt 8 x 1024 (about 100M parameters), T=64, B=4, 2 steps: the largest process's peak RSS
    of each strategy against `parallel=none`, and the summary's breakdown of that peak."""
    rows_in = {
        "none": ["parallel=none"],
        "ddp, 4 ranks": ["parallel=ddp", "launch.nproc_per_node=4"],
        "fsdp, 4 ranks": ["parallel=fsdp", "launch.nproc_per_node=4"],
        "pp, 2 ranks": ["parallel=pp", "launch.nproc_per_node=2"],
        "none, lean allocator": ["parallel=none", "memory.host_allocator=lean"],
        "fsdp, 4 ranks, glibc's default": [
            "parallel=fsdp",
            "launch.nproc_per_node=4",
            "memory.host_allocator=glibc",
        ],
    }
    floors = {"fsdp, 4 ranks": 0.58, "pp, 2 ranks": 0.62}
    got = {name: outside_rss([*BIG, *args]) for name, args in rows_in.items()}
    mib, none = 2**20, got["none"][0]
    rows = []
    for name, (rss, s) in got.items():
        b = s["memory"]["breakdown"]
        above = b["peak_bytes"] - b["baseline_bytes"]
        rows.append([name, rss / mib, rss / none, floors.get(name), b["baseline_bytes"] / mib, b["state_bytes"] / mib,
                     b["activation_bytes"] / mib, b["gathered_bytes"] / mib, b["comm_bytes"] / mib,
                     b["unexplained_bytes"] / mib, f"{b['unexplained_bytes'] / above:.0%}"])  # fmt: skip
    print("Peak RSS of the largest process, measured from outside (MiB), and the summary's breakdown of it\n")
    header = ["run", "peak RSS", "vs none", "floor", "baseline", "state", "activations", "gathered", "comm",
              "unexplained", "of peak - baseline"]  # fmt: skip
    print(table(header, rows))
    alike = got["fsdp, 4 ranks"][0] / got["none, lean allocator"][0]
    print(f"\nfsdp at 4 ranks against none with the same (lean) allocator: {alike:.3f}")


if __name__ == "__main__":
    with recorded("memory_rss" if sys.argv[1:] == ["rss"] else "memory"):
        rss_table()
        if sys.argv[1:] != ["rss"]:
            model_state_table()
            activation_table()
            measuring_cost_table()
