"""Datasets, samplers and the DataLoader, built from the `data` config group."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader, Dataset, IterableDataset

from framework.data.datasets import (
    Batch,
    ByteTextDataset,
    PackedSequences,
    SyntheticImages,
    SyntheticVectors,
    UserDataset,
    VarlenSequences,
    VarlenShape,
)
from framework.data.images import DeviceAugment, ImageFiles
from framework.data.samplers import (
    BatchSizes,
    PositionedSampler,
    distributed_sampler,
    length_grouped_sampler,
    permutation,
    token_budget_sampler,
    weighted_sampler,
)
from framework.data.split import document_split, held_out, text_region
from framework.data.tokens import TokenShards, vocab_size_of  # noqa: F401 (re-exported)
from framework.machine import usable_cores


class DataError(ValueError):
    """Data that cannot train, found only as a worker reads it (a stream's size is not known
    ahead): the launcher prints it as one line, as it does a checkpoint's."""


USER_DATA_RESERVED = (
    "name",
    "batch_size",
    "num_workers",
    "pin_memory",
    "persistent_workers",
    "prefetch_factor",
    "drop_last",
    "shuffle",
    "sampler",
    "max_tokens",
    "rank_batch_sizes",
    "pack",
    "pack_len",
    "seq_len",
    "val_fraction",
    "val_path",
    "tokenizer",
    "batch_schedule",
    "seq_len_schedule",
    "sources",
)  # fmt: skip  (the loader's keys: the rest go to the dataset's factory)


def build_dataset(cfg: DictConfig, seed: int, task: str = "classify", split: str = "train") -> Dataset:
    """The dataset of `cfg` (the `data` group): its training part, or with split="val" its
    validation part (data.val_path, or the data.val_fraction held out: framework.data.split).
    Synthetic data depends on `seed` only, never on rank. `task` is what the model does with
    sequences: "lm" (gpt) or "classify" (lstm)."""
    fraction = cfg.get("val_fraction", 0.0)
    if cfg.get("sources"):  # a weighted mixture (framework/data/mixture.py)
        from framework.data.mixture import Mixture, source_configs

        labels, weights, parts = zip(*source_configs(cfg), strict=True)
        return Mixture([build_dataset(part, seed, task, split) for part in parts], list(labels), list(weights))
    if cfg.get("_target_"):  # the user's own: Hydra's instantiate, its keys beside _target_
        from hydra.utils import instantiate

        kwargs = {k: v for k, v in cfg.items() if k not in USER_DATA_RESERVED}
        data = UserDataset(instantiate(kwargs, _convert_="all"), task)
        return held_out(data, fraction, seed, split) if fraction else data
    if cfg.name == "tokens":  # the shards prepare set aside are the validation split
        return TokenShards(cfg.path, cfg.seq_len, "val" if split == "val" else cfg.split, cfg.pack)
    if cfg.name == "hf":
        return hf_dataset(cfg, seed, split)
    if cfg.name == "chat":
        from framework.data.chat import ChatSequences

        data = ChatSequences(cfg.path, cfg.tokenizer, cfg.seq_len)
        return held_out(data, fraction, seed, split) if fraction else data
    if split == "val" and cfg.get("val_path"):
        return ByteTextDataset(cfg.val_path, cfg.seq_len, cfg.max_bytes, cfg.get("tokenizer", "bytes"))
    if split == "val" and not fraction:
        raise ValueError("data.val_fraction: no validation split; set data.val_fraction (0 < f < 1) or data.val_path")
    held = fraction if split == "val" or not cfg.get("val_path") else 0.0  # val_path: train on all of data.path
    if cfg.name == "text":
        data = ByteTextDataset(cfg.path, cfg.seq_len, cfg.max_bytes, cfg.get("tokenizer", "bytes"))
        return text_region(data, held, split) if held else data
    if cfg.name == "varlen":
        shape = VarlenShape(cfg.num_samples, cfg.vocab_size, cfg.num_classes, cfg.min_len, cfg.max_len, cfg.mean_len)
        data = VarlenSequences(shape, seed, task, cfg.source, cfg.path)
        data = document_split(data, held, seed, split) if held else data  # by document, before packing
        return PackedSequences(data, cfg.pack_len, seed) if cfg.pack else data
    if cfg.name == "images" and cfg.source == "synthetic":
        data = SyntheticImages(cfg.num_samples, cfg.image_size, cfg.channels, cfg.num_classes, cfg.noise, seed)
    elif cfg.name == "images":  # validation images are not augmented
        augment = cfg.augment and split == "train"
        data = ImageFiles(cfg.source, cfg.root, cfg.image_size, augment, cfg.transforms_on == "device")
    elif cfg.name == "vectors":
        data = SyntheticVectors(cfg.num_samples, cfg.dim, cfg.num_classes, seed)
    else:
        raise ValueError(f"data: unknown dataset {cfg.name!r}")
    return held_out(data, held, seed, split) if held else data


def hf_dataset(cfg: DictConfig, seed: int, split: str) -> Dataset:
    """data=hf: rows of local files or a saved dataset (framework/data/hf_data.py); its validation
    part data.val_path (read map-style), or map-style data's val_fraction held out."""
    from framework.data.hf_data import HFRows, HFStream

    if split == "val" and cfg.get("val_path"):
        return HFRows(cfg, cfg.val_path)
    if cfg.streaming:
        if split == "val":
            raise ValueError("data.val_fraction: a stream holds nothing out; set data.val_path to validate")
        return HFStream(cfg, seed)
    data = HFRows(cfg)
    return held_out(data, cfg.val_fraction, seed, split) if cfg.val_fraction else data


def user_data_problem(cfg: DictConfig) -> str | None:
    """Build the user's `data._target_` dataset once, before any worker starts: a constructor that
    raises (a missing file) is one line naming the call and the cause, not Hydra's wrapped repr
    in every worker. Its cost is one construction more (the workers build their own)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    kwargs = {k: v for k, v in cfg.items() if k not in USER_DATA_RESERVED}
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "_target_")
    try:
        instantiate(kwargs, _convert_="all")
    except Exception as err:  # noqa: BLE001 - the dataset's own error, whatever it is: one line
        cause = err.__cause__ if isinstance(err, InstantiationException) and err.__cause__ else err
        return f"{cfg._target_}({args}) failed: {type(cause).__name__}: {(str(cause).splitlines() or [''])[0]}"
    return None


@dataclass
class DataPipeline:
    dataset: Dataset
    sampler: PositionedSampler  # or a stream's StreamCursor (framework/data/hf_data.py)
    loader: DataLoader
    loader_seed: int
    device_transform: DeviceAugment | None = None  # batched preprocessing on the training device
    seq_lens: BatchSizes | None = None  # data.seq_len_schedule: the sequence length of each step
    source_counts: list[torch.Tensor] = field(default_factory=list)  # a mixture's, per batch handed out
    epoch: int = 0  # the position (see `position`)
    samples: int = 0

    def prepare(self, batch: Batch, device: torch.device, non_blocking: bool | None = None) -> Batch:
        """Move a batch to the device and finish its preprocessing there (non-blocking by default
        when the loader pins its batches)."""
        non_blocking = self.loader.pin_memory if non_blocking is None else non_blocking
        inputs, target = to_device(batch, device, non_blocking, getattr(self.dataset, "host_inputs", ()))
        if self.device_transform is not None:
            inputs = (self.device_transform(inputs[0]), *inputs[1:])
        return inputs, target

    def batches(self, epoch: int = 0, samples: int = 0, step: int = 0) -> Iterator[tuple[int, Batch]]:
        """Endless (epoch, batch) pairs, from sample `samples` of `epoch`'s order on, the batch
        sizes those of optimizer step `step` on (a resumed run: the sampler seeks there without
        loading the samples before it). `position` is where the batches handed out so far end.
        Each epoch's order comes from (seed, epoch), identically on every rank, and the loader's
        worker seeds from (seed, rank, epoch): an epoch reads the same whether the run got there
        directly or resumed into it."""
        accumulation = self.sampler.sizes.accumulation
        micro = step * accumulation
        self.sampler.load_state_dict({"epoch": epoch, "start": samples, "micro": micro})
        self.epoch, self.samples = epoch, samples
        while True:
            self.loader.generator.manual_seed(self.loader_seed + 1_000_003 * self.epoch)
            whole, handed = self.samples == 0, micro
            for batch in self.loader:
                self.samples = self.sampler.consumed(micro)
                if hasattr(self.dataset, "counts"):  # a mixture: samples and tokens of each source
                    self.source_counts.append(self.dataset.counts(self.sampler.last, batch))
                if self.seq_lens is not None:
                    batch = trim(batch, self.seq_lens.of_step(micro // accumulation))
                micro += 1
                yield self.epoch, batch
            if whole and micro == handed:  # a stream's epoch read from its start gave nothing: it would loop forever
                raise DataError("data.path: an epoch gives no whole batch (data.batch_size rows a rank) of rows with a "
                                 "token to predict (rows of fewer than two tokens, empty or blank, are left out): too "
                                 "few rows, or every row empty")  # fmt: skip
            self.epoch, self.samples = self.epoch + 1, 0
            self.sampler.load_state_dict({"epoch": self.epoch, "start": 0, "micro": micro})

    def position(self) -> dict[str, int]:
        """Where the batches handed out so far end, in samples of the epoch's order (all ranks):
        what a checkpoint stores. The order does not depend on the world size or the batch, so a
        run resumes from it with any of them. `size` (the samples an epoch orders) tells a
        resume whether the data is still the one the position counts."""
        size = len(self.dataset) if hasattr(self.dataset, "__len__") else None  # a stream: unknown
        return {"epoch": self.epoch, "samples": self.samples, "size": size}

    def tokens_in(self, batch: Batch) -> int | None:
        return self.dataset.tokens_in(batch)

    def take_source_counts(self, batches: int) -> torch.Tensor | None:
        """A mixture's samples and tokens of each source in this rank's next `batches` batches."""
        if not self.source_counts:
            return None
        taken, self.source_counts = self.source_counts[:batches], self.source_counts[batches:]
        return torch.stack(taken).sum(0)

    def slots_in(self, batch: Batch) -> int | None:
        """Positions computed on, padding included (None for data without tokens)."""
        fn = getattr(self.dataset, "slots_in", None)
        return fn(batch) if fn is not None else None


def batch_sizes(cfg: DictConfig, dp_size: int, accumulation: int = 1) -> BatchSizes:
    """The global micro-batch of each micro-batch: data.batch_size x ranks, or data.batch_schedule's."""
    schedule = tuple((int(step), int(value)) for step, value in cfg.get("batch_schedule") or ())
    return BatchSizes(cfg.batch_size * dp_size, schedule, accumulation)


def build_sampler(cfg: DictConfig, dataset: Dataset, dp_rank: int, dp_size: int, seed: int,
                  accumulation: int = 1) -> PositionedSampler:  # fmt: skip
    lengths = getattr(dataset, "lengths", None)
    if cfg.rank_batch_sizes:
        return weighted_sampler(len(dataset), list(cfg.rank_batch_sizes), dp_rank, seed, cfg.shuffle)
    if cfg.sampler == "token_budget":
        return token_budget_sampler(lengths.tolist(), cfg.max_tokens, dp_size, dp_rank, seed, cfg.shuffle)
    sizes = batch_sizes(cfg, dp_size, accumulation)
    if cfg.get("sources"):  # a mixture's own order, dealt as the permutation is
        order = partial(dataset.order, seed, shuffle=cfg.shuffle)
    else:
        order = partial(permutation, len(dataset), seed, shuffle=cfg.shuffle)
    if cfg.sampler == "length_grouped":
        return length_grouped_sampler(lengths.tolist(), dp_size, dp_rank, seed, sizes, cfg.shuffle)
    return distributed_sampler(order, dp_size, dp_rank, sizes, cfg.drop_last)


def transforms_on_device(cfg: DictConfig) -> bool:
    """Images preprocessed in batches on the training device (data.transforms_on=device), in
    training and in evaluation alike."""
    return cfg.name == "images" and cfg.source != "synthetic" and cfg.transforms_on == "device"


def build_data(cfg: DictConfig, dp: tuple[int, int], device: torch.device, seed: int, task: str = "classify",
               accumulation: int = 1) -> DataPipeline:  # fmt: skip
    """Dataset -> distributed sampler -> DataLoader.

    A single process uses the same sampler with one replica, so the order of samples depends on
    the seed alone, not on the world size: the data-parallel ranks of a step together read the
    samples one process would (framework/data/samplers.py). `dp`: (data-parallel rank, ranks);
    ranks that share a batch (tensor- and pipeline-parallel peers) share a dp rank.
    `accumulation`: micro-batches a step (the clock of data.batch_schedule).
    """
    dp_rank, dp_size = dp
    dataset = build_dataset(cfg, seed, task)
    if isinstance(dataset, IterableDataset):  # a stream positions itself (framework/data/hf_data.py)
        sampler = dataset.cursor(dp_rank, dp_size, batch_sizes(cfg, dp_size, accumulation))
        batching = {"batch_size": None}  # each worker yields whole micro-batches
    else:
        sampler = build_sampler(cfg, dataset, dp_rank, dp_size, seed, accumulation)
        batching = {"batch_sampler": sampler, "collate_fn": dataset.collate}
        if next(sampler.global_batches(), None) is None:
            left = getattr(dataset, "figures", {}).get("rows_left_out")
            empty = f" ({left:,} rows with no token to predict, empty or blank, left out)" if left else ""
            raise DataError(f"data.batch_size: {cfg.batch_size} x {dp_size} data-parallel ranks is more than the "
                             f"{len(dataset)} samples of an epoch{empty}")  # fmt: skip
    workers, pin = loader_settings(cfg.num_workers, cfg.pin_memory, device.type, usable_cores(),
                                   torch.cuda.device_count() if device.type == "cuda" else 0)  # fmt: skip
    loader = DataLoader(
        dataset,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=cfg.persistent_workers and workers > 0 and "batch_sampler" in batching,  # a stream: anew
        prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
        generator=torch.Generator(),  # seeded per epoch by DataPipeline.batches
        **batching,
    )
    transform = DeviceAugment(cfg.augment, seed + dp_rank, device) if transforms_on_device(cfg) else None
    lengths = tuple((int(step), int(n)) for step, n in cfg.get("seq_len_schedule") or ())
    return DataPipeline(
        dataset, sampler, loader, seed + dp_rank, transform, BatchSizes(0, lengths) if lengths else None
    )


def loader_settings(num_workers: int | str, pin_memory: bool | str, device_type: str, cpus: int,
                    gpus: int) -> tuple[int, bool]:  # fmt: skip
    """(num_workers, pin_memory) of the DataLoader. `auto` on CUDA: loader processes prepare the
    next batches while the GPU computes (min(4, cores per GPU - 1), one process per GPU), into
    pinned memory so the copy to the GPU does not block; on a CPU, none and unpinned: the local
    ranks already share the cores with training. Pinning applies to CUDA only."""
    cuda = device_type == "cuda"
    if num_workers == "auto":
        num_workers = max(0, min(4, cpus // max(1, gpus) - 1)) if cuda else 0
    return int(num_workers), cuda and pin_memory in ("auto", True)


def trim(batch: Batch, length: int) -> Batch:
    """The batch's sequences cut to their first `length` positions (data.seq_len_schedule)."""

    def cut(t: torch.Tensor) -> torch.Tensor:
        return t[:, :length].contiguous() if t.dim() >= 2 else t

    inputs, target = batch
    return tuple(cut(t) for t in inputs), cut(target)


def to_device(batch: Batch, device: torch.device, non_blocking: bool = False, host: tuple[int, ...] = ()) -> Batch:
    """The batch on `device`, but for the inputs at positions `host` (the dataset's `host_inputs`:
    ones the model reads on the host, such as an LSTM's lengths)."""
    inputs, target = batch
    moved = tuple(t if i in host else t.to(device, non_blocking=non_blocking) for i, t in enumerate(inputs))
    return moved, target.to(device, non_blocking=non_blocking)


def concat_batches(batches: list[Batch], pin: bool = False) -> Batch:
    """Several batches as one (same-shaped inputs; a pipeline step takes its micro-batches whole).
    `pin`: concatenated straight into pinned host memory, so that the copy to the GPU can be
    non-blocking (from pageable memory it waits for the GPU)."""

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        if not pin:
            return torch.cat(parts)
        shape = (sum(p.size(0) for p in parts), *parts[0].shape[1:])
        return torch.cat(parts, out=torch.empty(shape, dtype=parts[0].dtype, pin_memory=True))

    inputs = tuple(cat(list(parts)) for parts in zip(*(b[0] for b in batches), strict=True))
    return inputs, cat([b[1] for b in batches])
