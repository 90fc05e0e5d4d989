"""The validation split of every dataset, held out deterministically and never overlapping the
training part (`data.val_fraction`):

- text (one corpus): a held-out region, the corpus' last `val_fraction` of bytes; training windows
  end before it starts (`text_region`);
- variable-length sequences: by document, before any packing (`document_split`);
- any other dataset (images, vectors, a dataset of one's own): held-out samples (`held_out`).

Which documents or samples are held out depends on the seed alone, never on the world size.
"""

from __future__ import annotations

import copy

import torch
from torch.utils.data import Dataset

SPLITS = ("train", "val")


def val_count(n: int, fraction: float, key: str = "data.val_fraction") -> int:
    """How many of `n` items are held out: round(n x fraction), at least one, never all."""
    count = max(1, round(n * fraction))
    if count >= n:
        raise ValueError(f"{key}: {fraction} of {n} items leaves none for training; lower it")
    return count


def split_indices(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) indices of `n` items, each sorted: val is a seeded random `fraction`."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 7919)).tolist()
    k = val_count(n, fraction)
    return sorted(order[k:]), sorted(order[:k])


def text_region(dataset, fraction: float, split: str):
    """The training region (the head) or the held-out one (the last `fraction` of the bytes) of a
    ByteTextDataset. Training windows read bytes before the cut only, targets included."""
    data, seq_len = dataset.data, dataset.seq_len
    cut = len(data) - val_count(len(data), fraction)
    part = copy.copy(dataset)
    part.data = data[:cut] if split == "train" else data[cut:]
    if len(part.data) < seq_len + 1:
        raise ValueError(
            f"data.val_fraction: the {split} region holds {len(part.data)} bytes, fewer than seq_len+1={seq_len + 1}"
        )
    return part


def document_split(dataset, fraction: float, seed: int, split: str):
    """A VarlenSequences holding the training or the held-out documents only."""
    train, val = split_indices(len(dataset.seqs), fraction, seed)
    keep = train if split == "train" else val
    part = copy.copy(dataset)
    part.seqs = [dataset.seqs[i] for i in keep]
    part.lengths, part.labels = dataset.lengths[keep], dataset.labels[keep]
    return part


class HeldOut(Dataset):
    """Some samples of a dataset, by index; everything else (collate, tokens_in, ...) is the base's."""

    def __init__(self, base: Dataset, indices: list[int]):
        self.base, self.indices = base, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int):
        return self.base[self.indices[i]]

    def __getattr__(self, name: str):
        if name in ("base", "indices"):  # not set yet (unpickling in a loader worker)
            raise AttributeError(name)
        return getattr(self.base, name)


def held_out(dataset: Dataset, fraction: float, seed: int, split: str) -> Dataset:
    train, val = split_indices(len(dataset), fraction, seed)
    return HeldOut(dataset, train if split == "train" else val)
