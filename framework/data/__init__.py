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
    SyntheticImages,
    SyntheticVectors,
    VarlenSequences,
)
from framework.data.samplers import ResumableDistributedSampler


def build_dataset(cfg: DictConfig, seed: int) -> Dataset:
    """The dataset of `cfg` (the `data` group). Synthetic data depends on `seed` only, never on rank."""
    if cfg.name == "text":
        return ByteTextDataset(cfg.path, cfg.seq_len, cfg.max_bytes)
    if cfg.name == "images":
        return SyntheticImages(cfg.num_samples, cfg.image_size, cfg.channels, cfg.num_classes, cfg.noise, seed)
    if cfg.name == "vectors":
        return SyntheticVectors(cfg.num_samples, cfg.dim, cfg.num_classes, seed)
    if cfg.name == "varlen":
        return VarlenSequences(
            cfg.num_samples,
            cfg.vocab_size,
            cfg.num_classes,
            cfg.min_len,
            cfg.max_len,
            cfg.mean_len,
            seed,
        )
    raise ValueError(f"data: unknown dataset {cfg.name!r}")


@dataclass
class DataPipeline:
    dataset: Dataset
    sampler: ResumableDistributedSampler
    loader: DataLoader

    def batches(self, skip: int = 0) -> Iterator[tuple[int, Batch]]:
        """Endless (epoch, batch) pairs, after skipping `skip` batches (a resumed run). The sampler's
        epoch is set before every epoch so each one is shuffled differently, and identically on
        every rank."""
        per_epoch = (
            len(self.sampler) // self.loader.batch_size
            if self.loader.drop_last
            else -(-len(self.sampler) // self.loader.batch_size)
        )
        epoch, offset = divmod(skip, per_epoch)
        self.sampler.load_state_dict({"epoch": epoch, "start": offset * self.loader.batch_size})
        while True:
            for batch in self.loader:
                yield epoch, batch
            epoch += 1
            self.sampler.set_epoch(epoch)

    def tokens_in(self, batch: Batch) -> int | None:
        return self.dataset.tokens_in(batch)


def build_data(cfg: DictConfig, dp_rank: int, dp_size: int, device: torch.device, seed: int) -> DataPipeline:
    """Dataset -> DistributedSampler -> DataLoader.

    A single process uses the same sampler with one replica, so the order of samples depends on
    the seed alone, not on the world size: data-parallel rank r of w reads positions r, r+w, ...
    of one shared permutation, and the ranks of a step together read the samples one process
    would. Ranks that share a batch (tensor- and pipeline-parallel peers) share a dp rank.
    """
    dataset = build_dataset(cfg, seed)
    sampler = ResumableDistributedSampler(
        dataset,
        num_replicas=dp_size,
        rank=dp_rank,
        shuffle=cfg.shuffle,
        seed=seed,
        drop_last=cfg.drop_last,
    )
    if len(sampler) < cfg.batch_size:
        raise ValueError(
            f"data.batch_size: {cfg.batch_size} is more than the {len(sampler)} samples each rank gets per epoch"
        )
    loader = DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        collate_fn=dataset.collate,
        num_workers=cfg.num_workers,
        pin_memory=cfg.pin_memory and device.type == "cuda",
        persistent_workers=cfg.persistent_workers and cfg.num_workers > 0,
        prefetch_factor=cfg.prefetch_factor if cfg.num_workers > 0 else None,
        drop_last=cfg.drop_last,
        generator=torch.Generator().manual_seed(seed + dp_rank),
    )
    return DataPipeline(dataset, sampler, loader)


def to_device(batch: Batch, device: torch.device, non_blocking: bool = False) -> Batch:
    inputs, target = batch
    return tuple(t.to(device, non_blocking=non_blocking) for t in inputs), target.to(device, non_blocking=non_blocking)


def concat_batches(batches: list[Batch]) -> Batch:
    """Several batches as one (same-shaped inputs; a pipeline step takes its micro-batches whole)."""
    inputs = tuple(torch.cat(parts) for parts in zip(*(b[0] for b in batches), strict=True))
    return inputs, torch.cat([b[1] for b in batches])
