"""Distributed, resumable samplers.

All of them split one seeded permutation per epoch, so every rank agrees on the order without
talking, and each can continue part-way through an epoch (``state_dict``/``load_state_dict``).

- ``ResumableDistributedSampler`` (``data.sampler=distributed``): torch's DistributedSampler
  (rank r of w reads positions r, r+w, ... of the permutation) plus a start offset.
- ``LengthGroupedBatchSampler`` (``length_grouped``): batches of similar length, to cut padding.
  The permutation is cut into mega-chunks, each sorted by length and cut into global batches
  (batch_size x world samples, similar lengths), whose order is shuffled; rank r takes its share.
- ``TokenBudgetBatchSampler`` (``token_budget``): global batches sized by (padded) tokens, not
  samples, then split so every rank gets about the same number of tokens in every step.
- ``WeightedBatchSampler`` (``data.rank_batch_sizes``): a fixed, different number of samples per
  rank each step (per-device batch sizes by capability); step s reads the same global batch a
  single process would.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DistributedSampler, Sampler


class ResumableDistributedSampler(DistributedSampler):
    """torch's DistributedSampler plus a start offset, so a resumed run continues where it stopped."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.start = 0  # samples of this rank already consumed in the current epoch

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())[self.start :]
        self.start = 0  # only the epoch being resumed starts part-way
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples - self.start

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start": self.start}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.set_epoch(state["epoch"])
        self.start = state["start"]


# Length-sorting happens within chunks of this many global batches: long enough to group similar
# lengths, short enough that an epoch still mixes the whole dataset.
MEGA_BATCHES = 64


class _EpochBatchSampler(Sampler[list[int]]):
    """Base: this rank's batches of an epoch, computed from (seed, epoch), resumable by batch."""

    def __init__(self, num_replicas: int, rank: int, seed: int, shuffle: bool = True):
        self.num_replicas, self.rank, self.seed, self.shuffle = num_replicas, rank, seed, shuffle
        self.epoch, self.start = 0, 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def permutation(self, n: int) -> list[int]:
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def epoch_batches(self) -> list[list[list[int]]]:  # every rank's batches, [step][rank] -> indices
        raise NotImplementedError

    def shuffle_steps(self, steps: list) -> list:
        """The order of the epoch's global batches shuffled (seed, epoch), not their contents:
        batches of similar lengths stay together, but an epoch does not run short to long."""
        if not self.shuffle:
            return steps
        g = torch.Generator().manual_seed(self.seed + self.epoch + 1_000_003)
        return [steps[i] for i in torch.randperm(len(steps), generator=g).tolist()]

    def _mine(self) -> list[list[int]]:
        if self._cache is None or self._cache[0] != self.epoch:
            self._cache = (self.epoch, [step[self.rank] for step in self.epoch_batches()])
        return self._cache[1]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._mine()[self.start :]
        self.start = 0
        return iter(batches)

    def __len__(self) -> int:
        return len(self._mine()) - self.start

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start": self.start}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.start = state["epoch"], state["start"]


def _balanced_split(indices: list[int], lengths: Sequence[int], parts: int, equal_counts: bool) -> list[list[int]]:
    """Split `indices` into `parts` groups of about equal total length: longest first, each to
    the group with the least so far (LPT). With `equal_counts` every group gets the same number."""
    per_part = len(indices) // parts if equal_counts else None
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(indices, key=lambda i: -lengths[i]):
        open_groups = [g for g in range(parts) if per_part is None or len(groups[g]) < per_part]
        g = min(open_groups, key=lambda g: loads[g])
        groups[g].append(i)
        loads[g] += lengths[i]
    return groups


class LengthGroupedBatchSampler(_EpochBatchSampler):
    mega = MEGA_BATCHES

    def __init__(
        self, lengths: Sequence[int], batch_size: int, num_replicas: int, rank: int, seed: int, shuffle: bool = True
    ):
        super().__init__(num_replicas, rank, seed, shuffle)
        self.lengths, self.batch_size = list(lengths), batch_size

    def epoch_batches(self) -> list[list[list[int]]]:
        order = self.permutation(len(self.lengths))
        global_size = self.batch_size * self.num_replicas
        chunk = global_size * self.mega
        steps = []
        for c in range(0, len(order) - global_size + 1, chunk):
            part = sorted(order[c : c + chunk], key=lambda i: self.lengths[i])
            for b in range(0, len(part) - global_size + 1, global_size):
                # one global batch of similar lengths, dealt so each rank's tokens are balanced
                steps.append(_balanced_split(part[b : b + global_size], self.lengths, self.num_replicas, True))
        return self.shuffle_steps(steps)


class TokenBudgetBatchSampler(_EpochBatchSampler):
    mega = MEGA_BATCHES

    def __init__(
        self, lengths: Sequence[int], max_tokens: int, num_replicas: int, rank: int, seed: int, shuffle: bool = True
    ):
        super().__init__(num_replicas, rank, seed, shuffle)
        self.lengths, self.max_tokens = list(lengths), max_tokens

    def epoch_batches(self) -> list[list[list[int]]]:
        """Global batches whose padded size (samples x longest) stays within max_tokens x world,
        split so each rank gets about the same tokens and at least one sample."""
        order = self.permutation(len(self.lengths))
        budget, world = self.max_tokens * self.num_replicas, self.num_replicas
        chunk = max(world, (budget // max(1, min(self.lengths))) * self.mega)
        steps = []
        for c in range(0, len(order), chunk):
            part = sorted(order[c : c + chunk], key=lambda i: self.lengths[i])
            batch: list[int] = []
            for i in part:
                # padded cost per rank: its share of samples x the longest sample so far
                if len(batch) >= world and -(-(len(batch) + 1) // world) * self.lengths[i] > self.max_tokens:
                    steps.append(_balanced_split(batch, self.lengths, world, False))
                    batch = []
                batch.append(i)
            if len(batch) >= world:  # a last, smaller batch; fewer than `world` samples are dropped
                steps.append(_balanced_split(batch, self.lengths, world, False))
        return self.shuffle_steps(steps)


class WeightedBatchSampler(_EpochBatchSampler):
    """Rank r reads `sizes[r]` samples a step: global batch s is permutation[s*N : (s+1)*N]
    (N = sum(sizes)), rank r its slice at offset sum(sizes[:r])."""

    def __init__(self, n: int, sizes: Sequence[int], rank: int, seed: int, shuffle: bool = True):
        super().__init__(len(sizes), rank, seed, shuffle)
        self.n, self.sizes = n, list(sizes)

    def epoch_batches(self) -> list[list[list[int]]]:
        order, total = self.permutation(self.n), sum(self.sizes)
        offsets = [sum(self.sizes[:r]) for r in range(len(self.sizes))]
        return [
            [order[s + o : s + o + size] for o, size in zip(offsets, self.sizes, strict=True)]
            for s in range(0, self.n - total + 1, total)
        ]
