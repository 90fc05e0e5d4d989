"""Datasets, samplers and the DataLoader, built from the `data` config group."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset

from framework.data.datasets import (
    Batch,
    ByteTextDataset,
    PackedSequences,
    SyntheticImages,
    SyntheticVectors,
    UserDataset,
    VarlenSequences,
)
from framework.data.images import DeviceAugment, ImageFiles
from framework.data.samplers import (
    LengthGroupedBatchSampler,
    ResumableDistributedSampler,
    TokenBudgetBatchSampler,
    WeightedBatchSampler,
)
from framework.data.tokens import TokenShards, vocab_size_of  # noqa: F401 (re-exported)

USER_DATA_RESERVED = ("name", "batch_size", "num_workers", "pin_memory", "persistent_workers", "prefetch_factor",
                      "drop_last", "shuffle", "sampler", "max_tokens", "rank_batch_sizes", "pack", "pack_len",
                      "seq_len")  # fmt: skip  (the loader's keys: the rest go to the dataset's factory)


def build_dataset(cfg: DictConfig, seed: int, task: str = "classify") -> Dataset:
    """The dataset of `cfg` (the `data` group). Synthetic data depends on `seed` only, never on
    rank. `task` is what the model does with sequences: "lm" (gpt) or "classify" (lstm)."""
    if cfg.get("_target_"):  # the user's own: Hydra's instantiate, its keys beside _target_
        from hydra.utils import instantiate

        kwargs = {k: v for k, v in cfg.items() if k not in USER_DATA_RESERVED}
        return UserDataset(instantiate(kwargs, _convert_="all"), task)
    if cfg.name == "text":
        return ByteTextDataset(cfg.path, cfg.seq_len, cfg.max_bytes, cfg.get("tokenizer", "bytes"))
    if cfg.name == "tokens":
        return TokenShards(cfg.path, cfg.seq_len, cfg.split, cfg.pack)
    if cfg.name == "images" and cfg.source == "synthetic":
        return SyntheticImages(cfg.num_samples, cfg.image_size, cfg.channels, cfg.num_classes, cfg.noise, seed)
    if cfg.name == "images":
        return ImageFiles(cfg.source, cfg.root, cfg.image_size, cfg.augment, cfg.transforms_on == "device")
    if cfg.name == "vectors":
        return SyntheticVectors(cfg.num_samples, cfg.dim, cfg.num_classes, seed)
    if cfg.name == "varlen":
        data = VarlenSequences(cfg.num_samples, cfg.vocab_size, cfg.num_classes, cfg.min_len, cfg.max_len,
                               cfg.mean_len, seed, task, cfg.source, cfg.path)  # fmt: skip
        return PackedSequences(data, cfg.pack_len, seed) if cfg.pack else data
    raise ValueError(f"data: unknown dataset {cfg.name!r}")


@dataclass
class DataPipeline:
    dataset: Dataset
    sampler: ResumableDistributedSampler | LengthGroupedBatchSampler | TokenBudgetBatchSampler | WeightedBatchSampler
    loader: DataLoader
    global_batch: str  # what one step of all data-parallel ranks reads, e.g. "distributed: 64 samples"
    loader_seed: int
    device_transform: DeviceAugment | None = None  # batched preprocessing on the training device
    epoch: int = 0  # the position (see `position`)
    offset: int = 0

    def prepare(self, batch: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
        """Move a batch to the device and finish its preprocessing there."""
        inputs, target = to_device(batch, device, non_blocking)
        if self.device_transform is not None:
            inputs = (self.device_transform(inputs[0]), *inputs[1:])
        return inputs, target

    def batches(self, epoch: int = 0, offset: int = 0) -> Iterator[tuple[int, Batch]]:
        """Endless (epoch, batch) pairs, from batch `offset` of `epoch` on (a resumed run: the
        sampler seeks there without loading the batches before it). `position` is where the
        batches handed out so far end. Each epoch is shuffled from (seed, epoch), identically on
        every rank, and the loader's worker seeds are drawn from (seed, rank, epoch): an epoch
        reads the same whether the run got there directly or resumed into it."""
        unit = self.loader.batch_size if isinstance(self.sampler, ResumableDistributedSampler) else 1
        self.sampler.load_state_dict({"epoch": epoch, "start": offset * unit})
        self.epoch, self.offset = epoch, offset
        while True:
            self.loader.generator.manual_seed(self.loader_seed + 1_000_003 * self.epoch)
            for batch in self.loader:
                self.offset += 1
                yield self.epoch, batch
            self.epoch, self.offset = self.epoch + 1, 0
            self.sampler.set_epoch(self.epoch)

    def position(self) -> dict[str, int | str]:
        """Where the batches handed out so far end: what a checkpoint stores. The offset counts
        this rank's batches, which is also the global batches: a checkpoint resumes at another
        world size when the global batch (`global_batch`) is the same."""
        return {"epoch": self.epoch, "offset": self.offset, "global_batch": self.global_batch}

    def tokens_in(self, batch: Batch) -> int | None:
        return self.dataset.tokens_in(batch)

    def slots_in(self, batch: Batch) -> int | None:
        """Positions computed on, padding included (None for data without tokens)."""
        fn = getattr(self.dataset, "slots_in", None)
        return fn(batch) if fn is not None else None


def build_sampler(cfg: DictConfig, dataset: Dataset, dp_rank: int, dp_size: int, seed: int):
    lengths = getattr(dataset, "lengths", None)
    if cfg.rank_batch_sizes:
        return WeightedBatchSampler(len(dataset), list(cfg.rank_batch_sizes), dp_rank, seed, cfg.shuffle)
    if cfg.sampler == "length_grouped":
        return LengthGroupedBatchSampler(lengths.tolist(), cfg.batch_size, dp_size, dp_rank, seed, cfg.shuffle)
    if cfg.sampler == "token_budget":
        return TokenBudgetBatchSampler(lengths.tolist(), cfg.max_tokens, dp_size, dp_rank, seed, cfg.shuffle)
    return ResumableDistributedSampler(
        dataset, num_replicas=dp_size, rank=dp_rank, shuffle=cfg.shuffle, seed=seed, drop_last=cfg.drop_last
    )


def build_data(
    cfg: DictConfig, dp_rank: int, dp_size: int, device: torch.device, seed: int, task: str = "classify"
) -> DataPipeline:
    """Dataset -> distributed sampler -> DataLoader.

    A single process uses the same sampler with one replica, so the order of samples depends on
    the seed alone, not on the world size: data-parallel rank r of w reads positions r, r+w, ...
    of one shared permutation, and the ranks of a step together read the samples one process
    would. Ranks that share a batch (tensor- and pipeline-parallel peers) share a dp rank.
    """
    dataset = build_dataset(cfg, seed, task)
    sampler = build_sampler(cfg, dataset, dp_rank, dp_size, seed)
    batched = not isinstance(sampler, ResumableDistributedSampler)
    if batched:  # the sampler makes the batches (their sizes may differ)
        batching = {"batch_sampler": sampler}
    else:
        batching = {"batch_size": cfg.batch_size, "sampler": sampler, "drop_last": cfg.drop_last}
    loader = DataLoader(
        dataset,
        collate_fn=dataset.collate,
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory and device.type == "cuda",
        persistent_workers=cfg.persistent_workers and cfg.num_workers > 0,
        prefetch_factor=cfg.prefetch_factor if cfg.num_workers > 0 else None,
        generator=torch.Generator(),  # seeded per epoch by DataPipeline.batches
        **batching,
    )
    if len(loader) == 0:
        raise ValueError(f"data.batch_size: {cfg.batch_size} is more than the samples each rank gets per epoch")
    on_device = cfg.name == "images" and cfg.source != "synthetic" and cfg.transforms_on == "device"
    transform = DeviceAugment(cfg.augment, seed + dp_rank, device) if on_device else None
    return DataPipeline(dataset, sampler, loader, global_batch(cfg, dp_size), seed + dp_rank, transform)


def global_batch(cfg: DictConfig, dp_size: int) -> str:
    """What one step of all data-parallel ranks reads: with the same sampler and global batch,
    step s reads the same samples at any world size."""
    if cfg.rank_batch_sizes:
        return f"rank_batch_sizes: {sum(cfg.rank_batch_sizes)} samples"
    if cfg.sampler == "token_budget":
        return f"token_budget: {cfg.max_tokens * dp_size} tokens"
    return f"{cfg.sampler}: {cfg.batch_size * dp_size} samples"


def to_device(batch: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
    inputs, target = batch
    return tuple(t.to(device, non_blocking=non_blocking) for t in inputs), target.to(device, non_blocking=non_blocking)


def concat_batches(batches: list[Batch]) -> Batch:
    """Several batches as one (same-shaped inputs; a pipeline step takes its micro-batches whole)."""
    inputs = tuple(torch.cat(parts) for parts in zip(*(b[0] for b in batches), strict=True))
    return inputs, torch.cat([b[1] for b in batches])
