"""Data pipeline: loader throughput, and balance and padding of variable-length batching.

    python benchmarks/data.py

(a) images/s through DataLoader + preprocessing for num_workers 0/1/2, augmentation (crop, flip,
    normalise) per sample in the loader vs batched on the training device (here the CPU: on a GPU
    the device side costs the CPU nothing at all). An ImageFolder of PNGs is written to a
    temporary folder first.
(b) gpt on varlen data (long-tailed lengths) at world size 2: load imbalance (busiest rank's
    tokens / mean, per step), padding waste and tokens/s for each batching.
(c) data=hf streamed: a parquet corpus of 3.2 GB of text (more than 3x the streaming process's
    peak RSS; row groups of 8,192 rows) read through the pipeline in a fresh process, its RSS as the corpus goes by, and the
    tokens/s the loader delivers beside what the default gpt (`python train.py`) trains on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import recorded, run, table


def loader_table() -> None:
    from torch.utils.data import DataLoader
    from torchvision.io import write_png

    from framework.data.images import DeviceAugment, ImageFiles

    with tempfile.TemporaryDirectory() as tmp:
        g = torch.Generator().manual_seed(0)
        for c in range(4):
            (Path(tmp) / f"class{c}").mkdir()
            for i in range(256):
                write_png((torch.rand(3, 32, 32, generator=g) * 255).to(torch.uint8), f"{tmp}/class{c}/{i}.png")
        rows, base = [], None
        for on_device in (False, True):
            data = ImageFiles("folder", tmp, 32, augment=True, on_device=on_device)
            augment = DeviceAugment(True, 0, torch.device("cpu")) if on_device else None
            for workers in (0, 1, 2):
                loader = DataLoader(data, batch_size=64, shuffle=True, num_workers=workers, collate_fn=data.collate,
                                    persistent_workers=workers > 0)  # fmt: skip
                for _ in loader:  # warm-up epoch (worker start-up, file cache)
                    pass
                t0, n = time.perf_counter(), 0
                for _ in range(2):
                    for (x,), _ in loader:
                        x = augment(x) if augment else x
                        n += x.size(0)
                rate = n / (time.perf_counter() - t0)
                base = base or rate
                rows.append(["device" if on_device else "loader", workers, rate, rate / base])
    print("(a) loader throughput, 1024 PNG images 32x32, batch 64\n")
    print(table(["transforms on", "num_workers", "images/s", "vs loader, 0 workers"], rows))


def varlen_table() -> None:
    common = ["model=gpt", "data=varlen", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "steps=20",
              "metrics.sample_every=0"]  # fmt: skip
    rows = {
        "distributed (random batches)": ["data.batch_size=16"],
        "length_grouped": ["data.sampler=length_grouped", "data.batch_size=16"],
        "token_budget (1024 tokens/rank)": ["data.sampler=token_budget", "data.max_tokens=1024"],
        "packing (blocks of 128)": ["data.pack=true", "data.batch_size=4"],
    }
    got = run(rows, 2, common)
    base = got["distributed (random batches)"]["throughput"]["tokens_per_s"]
    out = []
    for name, s in got.items():
        lb = s["load_balance"]
        rate = s["throughput"]["tokens_per_s"]
        waste = lb.get("padding_waste", lb.get("boundary_waste"))  # packing: masked document boundaries
        out.append([name, lb["imbalance"], lb["max_imbalance"], waste, rate, rate / base])
    print("\n(b) gpt on varlen (log-normal lengths 4..128, mean 24), world size 2\n")
    print(
        table(
            ["batching", "imbalance (mean)", "imbalance (worst step)", "padding waste", "tokens/s", "vs distributed"],
            out,
        )
    )


CORPUS_GB, ROW_BYTES, FILES = 3.2, 2048, 32
STREAM = """
import json, os, sys, time, torch
from framework.data import build_data
from tests.helpers import compose_config
cfg = compose_config(["model=gpt", "data=hf", "data.path=" + sys.argv[1], "data.streaming=true", "data.seq_len=256",
                      "data.batch_size=64", "data.num_workers=0", "data.shuffle_buffer=1024"])
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
batches, rows, t0, marks = build_data(cfg.data, (0, 1), torch.device("cpu"), 0, "lm").batches(), 0, time.perf_counter(), []
start_rss = rss()
for epoch, (inputs, target) in batches:
    rows += inputs[0].size(0)
    if rows % (64 * 400) == 0:
        marks.append([rows, rss()])
    if rows + 64 > int(sys.argv[2]):  # the epoch's last whole batch: stop before the stream opens again
        break
seconds = time.perf_counter() - t0
# VmHWM: this process's own peak (ru_maxrss would carry the forking parent's over exec)
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"rows": rows, "seconds": seconds, "marks": marks, "start_rss": start_rss, "peak": peak}), flush=True)
os._exit(0)  # the stream's generator is left part-read: no finalisation of its reader threads
"""


def write_corpus(folder: Path) -> int:
    """FILES parquet files of random lowercase words, ROW_BYTES a row, CORPUS_GB of text in all."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng, letters = np.random.default_rng(0), np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", dtype=np.uint8)
    rows_per_file = int(CORPUS_GB * 1e9 / ROW_BYTES / FILES)
    for f in range(FILES):
        text = letters[rng.integers(0, len(letters), rows_per_file * ROW_BYTES)].tobytes()
        rows = [text[i : i + ROW_BYTES].decode() for i in range(0, len(text), ROW_BYTES)]
        pq.write_table(pa.table({"text": rows}), folder / f"part-{f:03d}.parquet", row_group_size=8192)
    return rows_per_file * FILES


def stream_table() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        total = write_corpus(Path(tmp))
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run([sys.executable, "-c", STREAM, tmp, str(total)], capture_output=True, text=True, cwd=root,
                             env={"PYTHONPATH": str(root), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})  # fmt: skip
        got = json.loads(out.stdout.strip().splitlines()[-1])
        subprocess.run([sys.executable, str(root / "train.py"), "steps=30", "logger=none", "progress=false",
                        f"hydra.run.dir={tmp}/gpt"], capture_output=True, text=True, cwd=tmp, check=True)  # fmt: skip
        consumed = json.loads((Path(tmp) / "gpt" / "summary.json").read_text())["throughput"]["tokens_per_s"]
    assert got["rows"] >= total - 64, got["rows"]  # the whole corpus went by (less the last partial batch)
    print(f"\n(c) data=hf streamed: {total * ROW_BYTES / 1e9:.2f} GB of text in {FILES} parquet files, rows of "
          f"{ROW_BYTES} bytes, seq_len 256, batch 64, one process, no loader workers\n")  # fmt: skip
    marks = [m for k, m in enumerate(got["marks"]) if k % max(1, len(got["marks"]) // 8) == 0] + got["marks"][-1:]
    rows = [[f"{m[0] * ROW_BYTES / 1e9:.2f}", f"{m[0] * ROW_BYTES / (total * ROW_BYTES):.0%}", m[1] / 2**20]
            for m in marks]  # fmt: skip
    print(table(["GB of the corpus read", "share", "RSS MiB"], rows))
    corpus_x = total * ROW_BYTES / got["peak"]
    delivered = got["rows"] * 256 / got["seconds"]
    print(f"\nPeak RSS {got['peak'] / 2**20:.0f} MiB (at start {got['start_rss'] / 2**20:.0f} MiB): the corpus is "
          f"{corpus_x:.1f}x the peak. The loader delivered {delivered:,.0f} tokens/s; the default gpt "
          f"(`python train.py`, 2 ranks) trains on {consumed:,.0f} tokens/s: {delivered / consumed:.0f}x.")  # fmt: skip


if __name__ == "__main__":
    with recorded("data"):
        loader_table()
        varlen_table()
        stream_table()
