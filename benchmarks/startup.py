"""What a launch costs before training: `python train.py` against the hand-written DDP loop
(`raw_ddp.py`) under torchrun, both one step of the same job on 2 local ranks, beside
`python -c "import torch"` (the floor every Python launch pays), in paired turns (A B C A B C ...)
so that machine noise falls on all alike; medians.

    python benchmarks/startup.py             # 5 turns
    python benchmarks/startup.py --turns 9

Columns: the wall time of the command; the time before the first worker starts (train.py: its
summary's launch_s, process start to a worker's start; torchrun: to its rank 0 process's start);
the time to the end of the first step (train.py: summary.startup_s). The last rows are train.py's
own defaults (`experiment=smoke steps=1`, W&B offline on: its service's start-up is the logger's
cost, not the launch's) and the ratio line `train.py / raw DDP under torchrun: X`, what
docs/results/startup.md records.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import table, write_result  # noqa: E402
from overhead import MODEL, WORLD  # noqa: E402  (the same job as the overhead benchmark's)

JOB = [f"model.n_layer={MODEL['n_layer']}", f"model.n_embd={MODEL['n_embd']}", f"model.n_head={MODEL['n_head']}",
       f"data.seq_len={MODEL['seq_len']}", f"data.batch_size={MODEL['batch_size']}"]  # fmt: skip


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """(when it started, its wall seconds, the finished process)."""
    started = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return started, time.time() - started, proc


def train_py(out: Path, args: list[str], env: dict[str, str]) -> dict[str, float]:
    _, wall, _ = timed([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={out}"], env)
    summary = json.loads((out / "summary.json").read_text())
    return {"wall": wall, "workers": summary["launch_s"], "first_step": summary["startup_s"]}


def raw_ddp(env: dict[str, str]) -> dict[str, float]:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}"]
    started, wall, proc = timed([*torchrun, str(ROOT / "benchmarks" / "raw_ddp.py"), "--steps", "1"], env)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall": wall, "workers": out["process_started_at"] - started, "first_step": out["first_step_at"] - started}


def import_torch(env: dict[str, str]) -> dict[str, float]:
    return {"wall": timed([sys.executable, "-c", "import torch"], env)[1], "workers": None, "first_step": None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=5)
    a = parser.parse_args()
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    plain = ["device=cpu", "parallel=ddp", f"launch.nproc_per_node={WORLD}", "steps=1", "logger=none", *JOB]
    rows = {
        'python -c "import torch"': lambda out: import_torch(env),
        "raw DDP loop under torchrun (raw_ddp.py --steps 1)": lambda out: raw_ddp(env),
        "python train.py, the same job (logger=none)": lambda out: train_py(out, plain, env),
        "python train.py experiment=smoke steps=1 (W&B offline)": lambda out: train_py(
            out, ["experiment=smoke", "steps=1", "device=cpu"], env
        ),
    }
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in rows}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(a.turns):
            for i, (name, run) in enumerate(rows.items()):
                figures[name].append(run(Path(tmp, f"{turn}-{i}")))
    median = {name: {k: statistics.median(f[k] for f in runs) if runs[0][k] is not None else None for k in runs[0]}
              for name, runs in figures.items()}  # fmt: skip
    raw, plain_run = median["raw DDP loop under torchrun (raw_ddp.py --steps 1)"], median[list(rows)[2]]
    text = table(
        ["command", "wall s", "before the first worker s", "to the first step's end s", "wall / raw"],
        [[name, m["wall"], m["workers"], m["first_step"], m["wall"] / raw["wall"]] for name, m in median.items()],
    )
    ratios = [t["wall"] / r["wall"] for t, r in zip(figures[list(rows)[2]], figures[list(rows)[1]], strict=True)]
    text += f"\n\ntrain.py / raw DDP under torchrun: {plain_run['wall'] / raw['wall']:.2f} (medians); "
    text += f"per turn {', '.join(f'{r:.2f}' for r in ratios)}"
    print(text)
    write_result("startup", f"python benchmarks/startup.py --turns {a.turns}", f"{a.turns} turns, medians", text)


if __name__ == "__main__":
    main()
