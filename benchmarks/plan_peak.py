"""The planner's peak-memory forecast against the peak read from outside: `/usr/bin/time -f %M`
around `python train.py` (the largest process's resident set, whichever rank or the launcher it
is), for none, ddp x2, fsdp x4 and pp x2 on the 100M gpt (8 blocks x 1024, T=32, 4 samples per
rank, fp32, AdamW). Beside it the run's own check (summary.json plan.error.peak_bytes, against
its in-process VmHWM) and the forecast taken apart.

    python benchmarks/plan_peak.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, table, write_result

from framework.config import compose
from framework.plan import predict
from framework.plan.profile import machine_profile

GPT_100M = ["experiment=smoke", "logger=none", "model.n_layer=8", "model.n_embd=1024", "model.n_head=8",
            "data.seq_len=32", "data.batch_size=4", "steps=3", "device=cpu", "plan.latency_us=100",
            "plan.intra_node_gbps=1"]  # fmt: skip
LAYOUTS = {"none": (1, ["parallel=none"]), "ddp x2": (2, ["parallel=ddp"]), "fsdp x4": (4, ["parallel=fsdp"]),
           "pp x2": (2, ["parallel=pp"])}  # fmt: skip
MB = 2**20


def outside_peak(args: list[str], run_dir: Path) -> int:
    """Peak resident bytes of the largest process of `python train.py ARGS`, from GNU time."""
    report = run_dir.parent / f"{run_dir.name}.time"
    cmd = [
        "/usr/bin/time",
        "-f",
        "%M",
        "-o",
        str(report),
        sys.executable,
        "train.py",
        *args,
        f"hydra.run.dir={run_dir}",
    ]
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=1800)
    return int(report.read_text().split()[-1]) * 1024  # KiB


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for name, (world, args) in LAYOUTS.items():
            overrides = [*GPT_100M, *args, f"launch.nproc_per_node={world}"]
            cfg = compose(overrides)
            p = predict(cfg, world, machine_profile(cfg, world, "cache"))
            run_dir = Path(out) / name.replace(" ", "_")
            measured = outside_peak(overrides, run_dir)
            summary = json.loads((run_dir / "summary.json").read_text())
            own = summary["plan"]["error"]["peak_bytes"]
            parts = ", ".join(f"{k} {v / MB:.0f}" for k, v in p["peak"].items())
            rows.append([name, p["peak_bytes"] / MB, measured / MB, p["peak_bytes"] / measured - 1,
                         f"{own:+.1%}" if own is not None else "-", parts])  # fmt: skip
            print(rows[-1], flush=True)
    text = table(["layout", "predicted peak MB", "/usr/bin/time %M MB", "error", "run's own check", "forecast parts MB"], rows)  # fmt: skip
    load = os.getloadavg()[0]
    header = (
        "Per-rank peak resident memory on the 100M gpt (8 x 1024, T=32, 4 samples per rank, fp32, AdamW, 3 steps): "
        f"the planner's forecast against `/usr/bin/time -f %M`. Load average at the end: {load:.1f} (the "
        "machine is shared; memory, unlike time, does not depend on it)."
    )
    print(text)
    write_result("plan_peak", "python benchmarks/plan_peak.py", header, text)


if __name__ == "__main__":
    main()
