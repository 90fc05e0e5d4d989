"""Context parallel on CPU (gloo): what splitting each sequence over cp ranks saves and costs.

    python benchmarks/context.py            # writes docs/results/context.md

The default-width gpt (4 layers x 128, 4 heads) and a Llama of the same width (4 layers x 128,
4 query and 2 key/value heads, rotary positions) at sequence length 2048, one global batch of 2
sequences, fp32: cp=1 (one process), cp=2 and cp=4 (parallel=cp, the ring). Per rank: the peak
bytes saved for backward in one micro-batch beside the planner's forecast, the ring's sends per
step (calls, MB, measured by the communication counter) and tokens/s of the whole run. These machines are shared and small:
compare ratios, not seconds; at 4 ranks on 2 cores the ranks also compete for the cores.
"""

from __future__ import annotations

import os
import platform
import sys
import time

from common import ROOT, run, table

SEQ, BATCH = 2048, 2
COMMON = ["data=text", f"data.seq_len={SEQ}", f"data.batch_size={BATCH}", "steps=6", "metrics.sample_every=2",
          "data.max_bytes=400000"]  # fmt: skip
LLAMA = ["model=llama", "model.dim=128", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_hidden=512", f"model.max_seq_len={SEQ}"]  # fmt: skip
ROWS = {  # name: (world, overrides)
    "gpt, cp=1 (one process)": (1, ["model=gpt", "parallel=none"]),
    "gpt, cp=2": (2, ["model=gpt", "parallel=cp"]),
    "gpt, cp=4": (4, ["model=gpt", "parallel=cp"]),
    "gpt, cp=2, activation checkpointing": (2, ["model=gpt", "parallel=cp", "memory=checkpoint"]),
    "llama, cp=1 (one process)": (1, [*LLAMA, "parallel=none"]),
    "llama, cp=2": (2, [*LLAMA, "parallel=cp"]),
    "llama, cp=4": (4, [*LLAMA, "parallel=cp"]),
}
MB = 2**20


def main() -> None:
    load = os.getloadavg()[0]  # a shared machine: N ranks get about N shares of its cores
    summaries = {}
    for name, (world, args) in ROWS.items():  # one group of workers per world size
        summaries[name] = run({name: args}, world, COMMON)[name]
        print(f"{name}: done", flush=True)
    rows = []
    for name, s in summaries.items():
        base = summaries[name.split(",")[0] + ", cp=1 (one process)"]
        send = s["comm"]["by_op"].get("send", {"calls": 0, "bytes": 0}) if s["comm"] else {"calls": 0, "bytes": 0}
        act, forecast = s["memory"]["activation_bytes"], s["plan"]["predicted"]["activation_bytes"]
        tps = s["throughput"]["tokens_per_s"]
        rows.append([name, act / MB, forecast / MB, f"{act / forecast - 1:+.2%}",
                     act / base["memory"]["activation_bytes"], send["calls"], send["bytes"] / MB, tps,
                     tps / base["throughput"]["tokens_per_s"]])  # fmt: skip
    header = ["run", "saved MB / rank", "forecast MB", "measured vs forecast", "vs cp=1", "ring sends / step",
              "sent MB / step", "tokens/s", "vs cp=1"]  # fmt: skip
    text = table(header, rows)
    command = "python benchmarks/context.py"
    machine = f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}, {time.strftime('%Y-%m-%d')}"
    doc = (
        f"# Context parallel (ring attention), gpt and Llama 4 x 128 at T={SEQ}, global batch {BATCH}, fp32, gloo\n\n"
        f"Made by `{command}` on {machine}, load average {load:.1f} at the start.\n\n{text}\n\n"
        "Saved bytes and sends are exact (counted); the forecast is the planner's (summary.json plan). Under a load above the core count each process gets about "
        "one share of the CPU, so runs with more ranks get more of it: tokens/s ratios overstate cp's speed-up.\n"
    )
    out = ROOT / "docs" / "results" / "context.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(doc)
    print(f"\n{text}\n\nwritten to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
