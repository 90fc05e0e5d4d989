"""Data pipeline: loader throughput, and balance and padding of variable-length batching.

    python benchmarks/data.py

(a) images/s through DataLoader + preprocessing for num_workers 0/1/2, augmentation (crop, flip,
    normalise) per sample in the loader vs batched on the training device (here the CPU: on a GPU
    the device side costs the CPU nothing at all). An ImageFolder of PNGs is written to a
    temporary folder first.
(b) gpt on varlen data (long-tailed lengths) at world size 2: load imbalance (busiest rank's
    tokens / mean, per step), padding waste and tokens/s for each batching.
"""

from __future__ import annotations

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


if __name__ == "__main__":
    with recorded("data"):
        loader_table()
        varlen_table()
