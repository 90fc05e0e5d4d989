"""Distributed, resumable samplers whose position is counted in samples.

Every epoch has one order of its samples, computed from (seed, epoch) and the data alone: the
same at every world size and every global batch. Each micro-batch of the run takes the next
samples of that order (its global micro-batch, all data-parallel ranks together) and deals them
to the ranks. The data position of a run is (epoch, samples of the epoch's order read), so a run
resumes at the next unread sample whatever its new world size, global batch or batch schedule,
and reads what an uninterrupted run with those settings would read from there.

Orders and deals (`data.sampler`):

- ``distributed``: a seeded permutation (torch's DistributedSampler's: randperm seeded by seed +
  epoch), dealt round-robin: rank r of R takes positions r, r + R, ... of each global micro-batch,
  so one process and R ranks read the same samples in a step.
- ``length_grouped``: the permutation cut into chunks of GROUP_CHUNK samples, each sorted by
  length and cut into runs of GROUP_RUN samples, the runs shuffled: consecutive samples have
  similar lengths, and an epoch does not run short to long. Each global micro-batch is dealt so
  that every rank gets about the same tokens (longest first, to the least loaded rank).
- ``token_budget``: the length-grouped order, cut into global batches by padded tokens (each
  rank's share of the samples x the longest within data.max_tokens) instead of by count.
- ``data.rank_batch_sizes``: the permutation, each global micro-batch cut into contiguous
  per-rank slices of those sizes (per-device batch sizes by capability).

``BatchSizes`` gives the global micro-batch of every micro-batch of the run: constant, or by step
from ``data.batch_schedule`` (a batch ramp).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

# length_grouped and token_budget: sorted within chunks of GROUP_CHUNK samples, in shuffled runs
# of GROUP_RUN (constants, so that the order does not depend on the world size or the batch)
GROUP_CHUNK, GROUP_RUN = 8192, 128

Shares = list[list[int]]  # one list of sample indices per data-parallel rank
Deal = Callable[[list[int], int, int], "tuple[Shares, int] | None"]  # (order, position, size) -> (shares, new position)


def permutation(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's order of n samples: torch's DistributedSampler's permutation (seed + epoch)."""
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def grouped_order(lengths: Sequence[int], seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The permutation sorted by length within chunks of GROUP_CHUNK, in runs of GROUP_RUN whose
    order is shuffled (seed, epoch)."""
    order, runs = permutation(len(lengths), seed, epoch, shuffle), []
    for c in range(0, len(order), GROUP_CHUNK):
        part = sorted(order[c : c + GROUP_CHUNK], key=lengths.__getitem__)
        runs += [part[r : r + GROUP_RUN] for r in range(0, len(part), GROUP_RUN)]
    if shuffle:
        g = torch.Generator().manual_seed(seed + epoch + 1_000_003)
        runs = [runs[i] for i in torch.randperm(len(runs), generator=g).tolist()]
    return [i for run in runs for i in run]


@dataclass(frozen=True)
class BatchSizes:
    """The global micro-batch, in samples of all data-parallel ranks, of each micro-batch of the
    run: `constant`, or from `schedule` ((step, global batch of the step), first at step 0: the
    step's batch is split over its `accumulation` micro-batches)."""

    constant: int
    schedule: tuple[tuple[int, int], ...] = ()
    accumulation: int = 1

    def at(self, micro: int) -> int:
        return self.of_step(micro // self.accumulation) // self.accumulation

    def of_step(self, step: int) -> int:
        if not self.schedule:
            return self.constant * self.accumulation
        return next(value for start, value in reversed(self.schedule) if start <= step)


def round_robin(replicas: int, drop_last: bool = True) -> Deal:
    """Positions r, r + R, ... of the global micro-batch to rank r. The epoch's tail that does not
    fill one is dropped, or with drop_last=false read, padded to a multiple of the ranks with
    samples from the epoch's start (as DistributedSampler pads)."""

    def deal(order: list[int], pos: int, size: int) -> tuple[Shares, int] | None:
        if pos >= len(order) or (drop_last and pos + size > len(order)):
            return None
        batch = order[pos : pos + size]
        batch += (order * replicas)[: -len(batch) % replicas]
        return [batch[r::replicas] for r in range(replicas)], min(pos + size, len(order))

    return deal


def balanced(lengths: Sequence[int], replicas: int) -> Deal:
    """The global micro-batch split into equal counts of about equal tokens."""

    def deal(order: list[int], pos: int, size: int) -> tuple[Shares, int] | None:
        if pos + size > len(order):
            return None
        return balanced_split(order[pos : pos + size], lengths, replicas, True), pos + size

    return deal


def slices(sizes: Sequence[int]) -> Deal:
    """Contiguous slices of `sizes` samples, rank by rank (the size asked for is their sum)."""
    offsets = [sum(sizes[:r]) for r in range(len(sizes))]

    def deal(order: list[int], pos: int, size: int) -> tuple[Shares, int] | None:
        if pos + sum(sizes) > len(order):
            return None
        return [order[pos + o : pos + o + n] for o, n in zip(offsets, sizes, strict=True)], pos + sum(sizes)

    return deal


def token_budget(lengths: Sequence[int], max_tokens: int, replicas: int) -> Deal:
    """As many samples as fit a padded budget per rank (its share of the samples x the longest
    within max_tokens; at least one sample a rank), split so each rank gets about the same tokens.
    The epoch's last samples, fewer than the ranks, are dropped."""

    def deal(order: list[int], pos: int, size: int) -> tuple[Shares, int] | None:
        end, longest = pos, 0
        while end < len(order):
            longer = max(longest, lengths[order[end]])
            if end - pos >= replicas and -(-(end - pos + 1) // replicas) * longer > max_tokens:
                break
            end, longest = end + 1, longer
        if end - pos < replicas:
            return None
        return balanced_split(order[pos:end], lengths, replicas, False), end

    return deal


def balanced_split(indices: list[int], lengths: Sequence[int], parts: int, equal_counts: bool) -> Shares:
    """Split `indices` into `parts` groups of about equal total length: longest first, each to
    the group with the least so far (LPT). With `equal_counts` every group gets the same number."""
    per_part = len(indices) // parts if equal_counts else None
    groups: Shares = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(indices, key=lambda i: -lengths[i]):
        open_groups = [g for g in range(parts) if per_part is None or len(groups[g]) < per_part]
        g = min(open_groups, key=lambda g: loads[g])
        groups[g].append(i)
        loads[g] += lengths[i]
    return groups


class PositionedSampler(Sampler[list[int]]):
    """This rank's micro-batches (index lists, for a DataLoader's batch_sampler): each epoch's
    `order` cut by `deal` into global micro-batches of `sizes`, from the position `start`.

    `handed` holds the position after each batch handed to the loader, and the batch's indices,
    in order: the loader's workers prefetch, so the pipeline takes an entry as each batch comes
    out of it, and knows the position of the batches it has really handed on (`consumed`) and
    what they hold (`last`)."""

    def __init__(self, order: Callable[[int], list[int]], deal: Deal, rank: int, sizes: BatchSizes):
        self.order, self.deal, self.rank, self.sizes = order, deal, rank, sizes
        self.epoch = self.start = self.micro = 0  # micro: micro-batches of the run so far (the schedule's clock)
        self.handed: deque[tuple[int, list[int]]] = deque()
        self.last: list[int] = []  # the indices of the batch `consumed` last took
        self._cache: tuple[int, list[int]] | None = None

    def epoch_order(self) -> list[int]:
        if self._cache is None or self._cache[0] != self.epoch:
            self._cache = (self.epoch, self.order(self.epoch))
        return self._cache[1]

    def global_batches(self) -> Iterator[Shares]:
        """Every rank's shares of the epoch's global micro-batches from `start`, changing nothing."""
        order, pos, micro = self.epoch_order(), self.start, self.micro
        while (cut := self.deal(order, pos, self.sizes.at(micro))) is not None:
            shares, pos = cut
            micro += 1
            yield shares

    def __iter__(self) -> Iterator[list[int]]:
        order, pos = self.epoch_order(), self.start
        self.start = 0  # only the epoch being resumed starts part-way
        while (cut := self.deal(order, pos, self.sizes.at(self.micro))) is not None:
            shares, pos = cut
            self.micro += 1
            self.handed.append((pos, shares[self.rank]))
            yield shares[self.rank]

    def __len__(self) -> int:
        return sum(1 for _ in self.global_batches())

    def consumed(self, micro: int) -> int:
        """The position after the next batch out of the loader (`micro`: its number in the run)."""
        pos, self.last = self.handed.popleft()
        return pos

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "start": self.start, "micro": self.micro}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.start, self.micro = state["epoch"], state["start"], state.get("micro", 0)
        self.handed.clear()


def distributed_sampler(order: Callable[[int], list[int]], replicas: int, rank: int, sizes: BatchSizes,
                        drop_last: bool = True) -> PositionedSampler:  # fmt: skip
    """`order` of each epoch (the permutation: partial(permutation, n, seed); a mixture's), dealt round-robin."""
    return PositionedSampler(order, round_robin(replicas, drop_last), rank, sizes)


def length_grouped_sampler(lengths: Sequence[int], replicas: int, rank: int, seed: int, sizes: BatchSizes,
                           shuffle: bool = True) -> PositionedSampler:  # fmt: skip
    lengths = list(lengths)
    return PositionedSampler(lambda e: grouped_order(lengths, seed, e, shuffle), balanced(lengths, replicas), rank,
                             sizes)  # fmt: skip


def token_budget_sampler(lengths: Sequence[int], max_tokens: int, replicas: int, rank: int, seed: int,
                         shuffle: bool = True) -> PositionedSampler:  # fmt: skip
    lengths = list(lengths)
    deal = token_budget(lengths, max_tokens, replicas)
    return PositionedSampler(lambda e: grouped_order(lengths, seed, e, shuffle), deal, rank, BatchSizes(0))


def weighted_sampler(n: int, sizes: Sequence[int], rank: int, seed: int, shuffle: bool = True) -> PositionedSampler:
    deal = slices(list(sizes))
    return PositionedSampler(lambda e: permutation(n, seed, e, shuffle), deal, rank, BatchSizes(sum(sizes)))
