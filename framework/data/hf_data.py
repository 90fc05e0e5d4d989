"""Hugging Face `datasets` (`data=hf`): local parquet, JSON lines or arrow files, or a dataset
saved with `save_to_disk`, never the network; map-style, or streamed (`data.streaming=true`) for
corpora larger than memory.

Each row is one sample: its text column tokenized by the run's tokenizer (`data.tokenizer`) or its
token column used as it is, cut to seq_len + 1 tokens and padded to it (padding carries no loss).
A row with no token to predict (fewer than two ids: an empty or blank line, as about a third of
wikitext's are) is left out, counted (summary.json `data.rows_left_out`, a line at the start) where
the dataset is map-style; a batch of such rows would be a step with no loss.

A stream's order is its rows in windows of `data.shuffle_buffer` rows, each window permuted from
(seed, epoch, window): like the map-style samplers' orders (framework/data/samplers.py) a function
of the data and the seed alone, so a stream is positioned in samples and resumes at any world size
and batch. Every loader worker of every rank reads the stream and keeps its own micro-batches:
the DataLoader takes batches from its workers round-robin, so worker j of W keeps micro-batches
j, j + W, ... of the run from its start, and of each its rank's share (positions r, r + R, ... as
the distributed sampler deals). Each sample of an epoch is read by exactly one rank; the last
global micro-batch that the stream cannot fill is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate, get_worker_info

from framework.data.datasets import PackedSequences
from framework.data.samplers import BatchSizes
from framework.loss import IGNORE_INDEX

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]
SUFFIXES = {"parquet": (".parquet",), "json": (".json", ".jsonl"), "arrow": (".arrow",)}


def resolve_format(path: str, fmt: str) -> str:
    """`data.format`, or with `auto` what the path holds: a saved dataset (its state.json), else
    the files' suffix."""
    if fmt != "auto":
        return fmt
    root = Path(path)
    if (root / "state.json").is_file() or (root / "dataset_dict.json").is_file():
        return "disk"
    suffixes = {root.suffix} if root.is_file() else {p.suffix for p in root.rglob("*") if p.is_file()}
    for name, ends in SUFFIXES.items():
        if suffixes & set(ends):
            return name
    raise ValueError(f"data.format: cannot tell what {path!r} holds; set data.format=parquet|json|arrow|disk")


def data_files(path: str, fmt: str) -> list[str]:
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.suffix in SUFFIXES[fmt])
    if not files:
        raise FileNotFoundError(f"data.path: no {fmt} files ({', '.join(SUFFIXES[fmt])}) in {path!r}")
    return [str(f) for f in files]


def columns_of(path: str, fmt: str) -> list[str]:
    """The column names, read from metadata or the first row only (checked before workers start)."""
    fmt = resolve_format(path, fmt)
    if fmt == "disk":
        root = Path(path) / "train" if (Path(path) / "dataset_dict.json").is_file() else Path(path)
        return list(json.loads((root / "dataset_info.json").read_text())["features"])
    first = data_files(path, fmt)[0]
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_schema(first).names
    if fmt == "arrow":
        import pyarrow as pa

        with pa.memory_map(first) as source:
            return pa.ipc.open_stream(source).schema.names
    with open(first, encoding="utf-8") as f:
        line = next((line for line in f if line.strip()), "{}")
    return list(json.loads(line))


def open_rows(path: str, fmt: str, column: str, streaming: bool):
    """The rows of one column, as a Hugging Face Dataset (map-style) or IterableDataset."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    fmt = resolve_format(path, fmt)
    if fmt == "disk":
        rows = datasets.load_from_disk(path)
        rows = rows["train"] if isinstance(rows, datasets.DatasetDict) else rows
        rows = rows.to_iterable_dataset() if streaming else rows
    else:
        rows = datasets.load_dataset(fmt, data_files=data_files(path, fmt), split="train", streaming=streaming)
    return rows.select_columns([column])


class RowEncoder:
    """A row as one sample: ids (tokenized text, or the token column), seq_len + 1 of them, padded."""

    def __init__(self, column: str, tokenized: bool, tokenizer: str, seq_len: int):
        self.column, self.tokenized, self.seq_len = column, tokenized, seq_len
        self.tokenizer = None
        if not tokenized:
            from framework.data.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(tokenizer)
        # byte ids stop at 255 (the model's 256 ids); a tokenizer pads with its end-of-text id
        self.pad = 0 if tokenized or tokenizer == "bytes" else self.tokenizer.eos_id

    def ids(self, value: Any) -> list[int]:
        if value is None:
            return []
        return list(value) if self.tokenized else self.tokenizer.encode(value)

    def __call__(self, value: Any) -> Batch:
        ids = self.ids(value)[: self.seq_len + 1]
        tokens = torch.full((self.seq_len + 1,), self.pad, dtype=torch.long)
        tokens[: len(ids)] = torch.tensor(ids, dtype=torch.long)
        target = tokens[1:].clone()
        target[max(0, len(ids) - 1) :] = IGNORE_INDEX  # past the row's last token: padding, no loss
        return (tokens[:-1],), target


def encoder_of(cfg: Any) -> tuple[str, RowEncoder]:
    column = cfg.tokens_column or cfg.text_column
    return column, RowEncoder(column, cfg.tokens_column is not None, cfg.tokenizer, cfg.seq_len)


def with_targets(rows: Any, column: str, encode: RowEncoder, key: str) -> Any:
    """The rows with at least one token to predict (two ids or more), in their order. Map-style:
    filtered once, cached under `key` (the data, column and tokenizer); a stream: as it is read."""
    keep = lambda values: [len(encode.ids(v)) >= 2 for v in values]  # noqa: E731
    if hasattr(rows, "n_shards"):  # an IterableDataset
        return rows.filter(keep, batched=True, input_columns=[column])
    import hashlib

    fingerprint = hashlib.sha256(f"{rows._fingerprint}|{key}".encode()).hexdigest()[:16]
    return rows.filter(keep, batched=True, input_columns=[column], new_fingerprint=fingerprint)


class HFRows(Dataset):
    """A map-style dataset's rows as samples (the distributed sampler orders them), the rows with
    nothing to predict left out and counted (`figures`, `note`)."""

    def __init__(self, cfg: Any, path: str | None = None):
        self.column, self.encode = encoder_of(cfg)
        path = path or cfg.path
        every = open_rows(path, cfg.format, self.column, streaming=False)
        key = f"{self.column}|{cfg.tokens_column is not None}|{cfg.tokenizer}"
        self.rows = with_targets(every, self.column, self.encode, key)
        self.figures = {"rows_left_out": len(every) - len(self.rows)}
        left = self.figures["rows_left_out"]
        self.note = (f"data: {left:,} of {len(every):,} rows of {path} have no token to predict (empty): left out"
                     if left else None)  # fmt: skip

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Batch:
        return self.encode(self.rows[i][self.column])

    # fixed-length items with ignored targets: batched and counted as packed sequences are
    collate = staticmethod(default_collate)
    tokens_in = staticmethod(PackedSequences.tokens_in)
    slots_in = staticmethod(PackedSequences.slots_in)


class HFStream(IterableDataset):
    """A streamed dataset's rows, each worker of each rank yielding its own whole micro-batches
    from the position (epoch, start, micro) its `StreamCursor` sets before each epoch."""

    def __init__(self, cfg: Any, seed: int):
        self.path, self.format, self.buffer, self.shuffle = cfg.path, cfg.format, cfg.shuffle_buffer, cfg.shuffle
        self.column, self.encode = encoder_of(cfg)
        self.figures = {"rows_left_out": None}  # a stream leaves them out as it is read: not counted ahead
        self.seed, self.rank, self.replicas, self.sizes = seed, 0, 1, BatchSizes(cfg.batch_size)
        self.epoch = self.start = self.micro = 0

    def cursor(self, rank: int, replicas: int, sizes: BatchSizes) -> StreamCursor:
        self.rank, self.replicas, self.sizes = rank, replicas, sizes
        return StreamCursor(self)

    def ordered(self) -> Iterator[Any]:
        """The epoch's values in order, from position `start` (whole windows before it skipped
        unread). Read in windows with `iter`, which (unlike iterating the IterableDataset in a
        loader worker) does not hand each worker its own files: every worker sees every row."""
        rows = with_targets(
            open_rows(self.path, self.format, self.column, streaming=True), self.column, self.encode, ""
        )
        first = self.start // self.buffer
        if first:
            rows = rows.skip(first * self.buffer)
        for w, window in enumerate(rows.iter(batch_size=self.buffer), start=first):
            values = window[self.column]
            order = range(len(values))
            if self.shuffle:
                g = torch.Generator().manual_seed(hash((self.seed, self.epoch, w)) % 2**62)
                order = torch.randperm(len(values), generator=g).tolist()
            for q in order[max(0, self.start - w * self.buffer) :] if w == first else order:
                yield values[q]

    def __iter__(self) -> Iterator[Batch]:
        worker = get_worker_info()
        j, workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        rows, micro, k = self.ordered(), self.micro, 0
        while True:
            size = self.sizes.at(micro)
            if k % workers == j:
                taken = list(islice(rows, size))
                if len(taken) < size:
                    return
                yield default_collate([self.encode(row) for row in taken[self.rank :: self.replicas]])
            elif sum(1 for _ in islice(rows, size)) < size:
                return
            micro, k = micro + 1, k + 1

    tokens_in = staticmethod(PackedSequences.tokens_in)
    slots_in = staticmethod(PackedSequences.slots_in)


class StreamCursor:
    """A stream's position, kept as PositionedSampler keeps a map-style dataset's: the pipeline
    sets it before each epoch and counts the samples of the micro-batches it hands on."""

    def __init__(self, stream: HFStream):
        self.stream, self.sizes, self.position = stream, stream.sizes, 0

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.stream.epoch, self.stream.start, self.stream.micro = state["epoch"], state["start"], state["micro"]
        self.position = state["start"]

    def consumed(self, micro: int) -> int:
        self.position += self.sizes.at(micro)
        return self.position
