"""Distributed samplers that can resume part-way through an epoch."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """torch's DistributedSampler (rank r of w reads positions r, r+w, ... of one seeded
    permutation per epoch) plus a start offset, so a resumed run continues where it stopped."""

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
