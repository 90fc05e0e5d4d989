"""Weighted mixtures of data sources (`data.sources=[{path: A, weight: 0.7}, {path: B, weight: 0.3}]`).

Each source is the `data` group's settings with its entry's keys over them (any dataset the group
builds: text, tokens, hf, ...). A mixture's epoch orders as many samples as its sources hold
together; position i of it goes to the source furthest below its share (weight x (i + 1) minus the
samples it has so far: Megatron's blending), so every prefix of the order holds each source within
one sample of its weight. A source's k-th sample of the epoch is its own seeded permutation's,
drawn anew each time the source has been read through (a small source with a large weight repeats,
reshuffled). The order depends on the data, the weights and the seed alone, as every order does
(framework/data/samplers.py): a mixture resumes at its position in samples at any world size.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import Dataset, default_collate

from framework.loss import IGNORE_INDEX

ENTRY_KEYS = ("weight", "label")  # an entry's own keys; the rest are data settings


def source_configs(cfg: DictConfig) -> list[tuple[str, float, DictConfig]]:
    """(label, weight, data settings) of each source: the group's settings with the entry's over them."""
    base = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "sources"])
    sources = []
    for k, entry in enumerate(cfg.sources):
        entry = OmegaConf.to_container(entry) if OmegaConf.is_config(entry) else dict(entry)
        settings = {key: value for key, value in entry.items() if key not in ENTRY_KEYS}
        merged = OmegaConf.merge(base, settings)
        label = entry.get("label") or (Path(str(merged.get("path"))).stem if merged.get("path") else f"source{k}")
        sources.append((str(label), float(entry.get("weight", 1.0)), merged))
    return sources


def blend(sizes: list[int], weights: list[float]) -> tuple[list[int], list[int]]:
    """(source of each position, its rank among that source's positions) over sum(sizes) positions."""
    total, shares = sum(sizes), [w / sum(weights) for w in weights]
    counts, sources, ranks = [0] * len(sizes), [], []
    for i in range(total):
        k = max(range(len(sizes)), key=lambda k: shares[k] * (i + 1) - counts[k])
        sources.append(k)
        ranks.append(counts[k])
        counts[k] += 1
    return sources, ranks


class Mixture(Dataset):
    """The sources' samples as one index space (source k's at offsets[k] on), and their order."""

    def __init__(self, datasets: list[Dataset], labels: list[str], weights: list[float]):
        self.datasets, self.labels, self.weights = datasets, labels, weights
        self.offsets = [0]
        for d in datasets:
            self.offsets.append(self.offsets[-1] + len(d))
        self._blend = blend([len(d) for d in datasets], weights)
        first = datasets[0]  # the sources are one kind of data: batched and counted alike
        self.collate = getattr(first, "collate", default_collate)
        self.tokens_in = getattr(first, "tokens_in", _no_tokens)
        if hasattr(first, "slots_in"):
            self.slots_in = first.slots_in

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, i: int):
        k = bisect.bisect_right(self.offsets, i) - 1
        return self.datasets[k][i - self.offsets[k]]

    def source_of(self, i: int) -> int:
        return bisect.bisect_right(self.offsets, i) - 1

    def order(self, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
        """The epoch's order (see the module's docstring)."""
        sources, ranks = self._blend
        perms: dict[tuple[int, int], list[int]] = {}
        order = []
        for k, j in zip(sources, ranks, strict=True):
            n = len(self.datasets[k])
            cycle, j = divmod(j, n)
            if (k, cycle) not in perms:
                g = torch.Generator().manual_seed(hash((seed, epoch, k, cycle)) % 2**62)
                perms[k, cycle] = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
            order.append(self.offsets[k] + perms[k, cycle][j])
        return order

    def counts(self, indices: list[int], batch: Any) -> torch.Tensor:
        """[samples of each source..., tokens of each source...] in a batch read from `indices`."""
        target = batch[1]
        tokens = (target != IGNORE_INDEX).flatten(1).sum(1) if target.dim() > 1 else torch.ones(len(indices))
        out = torch.zeros(2 * len(self.datasets))
        for i, n in zip(indices, tokens.tolist(), strict=True):
            k = self.source_of(i)
            out[k] += 1
            out[len(self.datasets) + k] += n
        return out


def _no_tokens(batch: Any) -> None:
    return None
