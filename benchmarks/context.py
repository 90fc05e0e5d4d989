"""Context parallel on CPU (gloo): what splitting each sequence over cp ranks saves and costs.

    python benchmarks/context.py            # writes docs/results/context.md

The default-width gpt (4 layers x 128, 4 heads) at sequence length 2048, one global batch of 2
sequences, fp32: cp=1 (one process), cp=2 and cp=4 (parallel=cp, the ring). Per rank: the peak
bytes saved for backward in one micro-batch, the ring's sends per step (calls, MB, measured by
the communication counter) and tokens/s of the whole run. These machines are shared and small:
compare ratios, not seconds; at 4 ranks on 2 cores the ranks also compete for the cores.
"""

from __future__ import annotations

import os
import platform
import sys
import time

from common import ROOT, run, table

SEQ, BATCH = 2048, 2
COMMON = ["model=gpt", "data=text", f"data.seq_len={SEQ}", f"data.batch_size={BATCH}", "steps=6",
          "metrics.sample_every=2", "data.max_bytes=400000"]  # fmt: skip
ROWS = {  # name: (world, overrides)
    "cp=1 (one process)": (1, ["parallel=none"]),
    "cp=2": (2, ["parallel=cp"]),
    "cp=4": (4, ["parallel=cp"]),
    "cp=2, activation checkpointing": (2, ["parallel=cp", "memory=checkpoint"]),
}
MB = 2**20


def main() -> None:
    load = os.getloadavg()[0]  # a shared machine: N ranks get about N shares of its cores
    summaries = {}
    for name, (world, args) in ROWS.items():  # one group of workers per world size
        summaries[name] = run({name: args}, world, COMMON)[name]
        print(f"{name}: done", flush=True)
    base = summaries["cp=1 (one process)"]
    rows = []
    for name, s in summaries.items():
        send = s["comm"]["by_op"].get("send", {"calls": 0, "bytes": 0}) if s["comm"] else {"calls": 0, "bytes": 0}
        act = s["memory"]["activation_bytes"]
        tps = s["throughput"]["tokens_per_s"]
        rows.append([name, act / MB, act / base["memory"]["activation_bytes"], send["calls"], send["bytes"] / MB,
                     tps, tps / base["throughput"]["tokens_per_s"]])  # fmt: skip
    header = ["run", "saved MB / rank", "vs cp=1", "ring sends / step", "sent MB / step", "tokens/s", "vs cp=1"]
    text = table(header, rows)
    command = "python benchmarks/context.py"
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}, {time.strftime('%Y-%m-%d')}"
    doc = (
        f"# Context parallel (ring attention), gpt 4 x 128 at T={SEQ}, global batch {BATCH}, fp32, gloo\n\n"
        f"Made by `{command}` on {machine}, load average {load:.1f} at the start.\n\n{text}\n\n"
        "Saved bytes and sends are exact (counted). Under a load above the core count each process gets about "
        "one share of the CPU, so runs with more ranks get more of it: tokens/s ratios overstate cp's speed-up.\n"
    )
    out = ROOT / "docs" / "results" / "context.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc)
    print(f"\n{text}\n\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
