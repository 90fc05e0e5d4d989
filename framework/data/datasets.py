"""Datasets that need no download: a byte-level text corpus and small synthetic, learnable tasks.

Every item is ``(inputs, target)`` where ``inputs`` is a tuple of tensors passed to the model as
positional arguments. Each dataset names its ``collate`` and how many tokens a batch holds
(``tokens_in``; None for models that do not read tokens).
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import astuple, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate

from framework.loss import IGNORE_INDEX

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def default_corpus_files() -> list[Path]:
    """This Python's standard library source: text present on every machine that runs us."""
    return sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


def corpus_files(path: str | None) -> list[Path]:
    """A file, a folder (all files, sorted, recursively) or the default corpus."""
    if path is None:
        return default_corpus_files()
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"data.path: no file or folder at {path!r}")
    return [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())


def truncation_line(cfg: Any) -> str:
    """The line (with its newline) saying that `data.max_bytes` cuts the text corpus short, a
    preset's (experiment=smoke) or the default's; else ''."""
    if cfg.name != "text" or cfg.get("_target_"):
        return ""
    note = truncation_note(cfg.path, cfg.max_bytes)
    return f"{note}\n" if note else ""


def truncation_note(path: str | None, max_bytes: int) -> str | None:
    """One line when `data.max_bytes` cuts the corpus short (sizes only; nothing is read)."""
    try:
        total = sum(f.stat().st_size for f in corpus_files(path))
    except OSError:
        return None  # a missing path is validate's to report
    if total <= max_bytes:
        return None
    where = path or "this Python's standard library source"
    return f"data: reading the first {max_bytes:,} of {total:,} bytes of {where} (data.max_bytes={max_bytes})"


def read_corpus(path: str | None, max_bytes: int) -> bytes:
    """Read the first `max_bytes` of a file, a folder or the default corpus (corpus_files)."""
    files = corpus_files(path)
    chunks, total = [], 0
    for f in files:
        data = f.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)


class ByteTextDataset(Dataset):
    """Next-byte prediction over consecutive, non-overlapping windows of the corpus."""

    def __init__(self, path: str | None, seq_len: int, max_bytes: int, tokenizer: str = "bytes"):
        raw = read_corpus(path, max_bytes)
        if tokenizer == "bytes":
            self.data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        else:  # data.tokenizer=<tokenizer.json>: the corpus as that tokenizer's ids
            from framework.data.tokenizer import load_tokenizer

            ids = load_tokenizer(tokenizer).encode(raw.decode("utf-8", errors="replace"))
            self.data = torch.tensor(ids, dtype=torch.int32)
        if len(self.data) < seq_len + 1:
            raise ValueError(f"data.path: corpus holds {len(self.data)} tokens, fewer than seq_len+1={seq_len + 1}")
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> Batch:
        start = i * self.seq_len
        chunk = self.data[start : start + self.seq_len + 1].long()
        return (chunk[:-1],), chunk[1:]

    collate = staticmethod(default_collate)

    @staticmethod
    def tokens_in(batch: Batch) -> int:
        return batch[1].numel()

    @staticmethod
    def slots_in(batch: Batch) -> int:
        return batch[1].numel()


class SyntheticImages(Dataset):
    """Each class has a fixed random template; a sample is its class template plus Gaussian noise."""

    def __init__(
        self,
        num_samples: int,
        image_size: int,
        channels: int,
        num_classes: int,
        noise: float,
        seed: int,
    ):
        g = torch.Generator().manual_seed(seed)
        templates = torch.randn(num_classes, channels, image_size, image_size, generator=g)
        self.labels = torch.randint(num_classes, (num_samples,), generator=g)
        self.images = templates[self.labels] + noise * torch.randn(
            num_samples, channels, image_size, image_size, generator=g
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Batch:
        return (self.images[i],), self.labels[i]

    collate = staticmethod(default_collate)
    tokens_in = staticmethod(lambda batch: None)


class SyntheticVectors(Dataset):
    """Gaussian vectors labelled by the argmax of a fixed random linear map."""

    def __init__(self, num_samples: int, dim: int, num_classes: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        weight = torch.randn(dim, num_classes, generator=g)
        self.x = torch.randn(num_samples, dim, generator=g)
        self.y = (self.x @ weight).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Batch:
        return (self.x[i],), self.y[i]

    collate = staticmethod(default_collate)
    tokens_in = staticmethod(lambda batch: None)


@dataclass(frozen=True)
class VarlenShape:
    """How many sequences, of which tokens, classes and lengths (VarlenSequences)."""

    num_samples: int
    vocab_size: int
    num_classes: int
    min_len: int
    max_len: int
    mean_len: float  # synthetic: the log-normal lengths' mean


class VarlenSequences(Dataset):
    """Variable-length token sequences with a long-tailed length distribution.

    ``source="synthetic"``: random tokens with log-normal lengths; ``source="text"``: the
    paragraphs (text between blank lines) of the text corpus, cut at max_len bytes. Two tasks over them:
    ``classify`` (lstm): label = the most frequent token class (token % num_classes), which a
    recurrent model must read the whole sequence to tell; ``lm`` (gpt): next-token prediction
    within each sequence, padding ignored by the loss (target -100).
    """

    def __init__(self, shape: VarlenShape, seed: int, task: str = "classify", source: str = "synthetic",
                 path: str | None = None, max_bytes: int = 4_000_000):  # fmt: skip
        num_samples, vocab_size, num_classes, min_len, max_len, mean_len = astuple(shape)
        g = torch.Generator().manual_seed(seed)
        if source == "text":
            # paragraphs (text between blank lines) of the corpus: naturally long-tailed lengths
            paragraphs = (p.strip(b"\n") for p in read_corpus(path, max_bytes).split(b"\n\n"))
            docs = [p[:max_len] for p in paragraphs if len(p) >= min_len][:num_samples]
            self.seqs = [torch.frombuffer(bytearray(d), dtype=torch.uint8).long() for d in docs]
        else:
            sigma = 0.8  # log-normal spread: a long tail of long sequences
            mu = math.log(mean_len) - sigma**2 / 2
            lengths = torch.exp(mu + sigma * torch.randn(num_samples, generator=g)).round().long()
            self.seqs = [torch.randint(1, vocab_size, (int(n),), generator=g) for n in lengths.clamp(min_len, max_len)]
        self.lengths = torch.tensor([len(s) for s in self.seqs])
        self.task = task
        # classify: the lengths stay in host memory, where pack_padded_sequence reads them (on the
        # GPU, reading them back would make the host wait once per micro-batch)
        self.host_inputs = (1,) if task == "classify" else ()
        self.labels = torch.stack([torch.bincount(s % num_classes, minlength=num_classes).argmax() for s in self.seqs])

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, i: int):
        return self.seqs[i], self.labels[i]

    def collate(self, items) -> Batch:
        seqs, labels = zip(*items, strict=True)
        lengths = torch.tensor([len(s) for s in seqs])
        padded = torch.nn.utils.rnn.pad_sequence(list(seqs), batch_first=True, padding_value=0)
        if self.task == "classify":
            return (padded, lengths), torch.stack(labels)
        target = padded[:, 1:].clone()
        target[torch.arange(target.size(1)) >= (lengths - 1)[:, None]] = IGNORE_INDEX  # padding: no loss
        return (padded[:, :-1],), target

    def tokens_in(self, batch: Batch) -> int:
        inputs, target = batch
        return int(inputs[1].sum()) if self.task == "classify" else int((target != IGNORE_INDEX).sum())

    def slots_in(self, batch: Batch) -> int:
        """Token positions the batch computes on, padding included."""
        return batch[0][0].numel()


class PackedSequences(Dataset):
    """Sequences concatenated (in a seeded random order) and cut into blocks of `block_len`
    tokens: no padding. Each position carries its document id, so the model keeps attention
    within a document and the loss never predicts across a boundary (target -100 there)."""

    def __init__(self, base: VarlenSequences, block_len: int, seed: int):
        order = torch.randperm(len(base), generator=torch.Generator().manual_seed(seed)).tolist()
        tokens = torch.cat([base.seqs[i] for i in order])
        docs = torch.cat([torch.full((len(base.seqs[i]),), k) for k, i in enumerate(order)])
        n = (len(tokens) - 1) // block_len
        self.tokens = tokens[: n * block_len + 1]
        self.docs = docs[: n * block_len + 1]
        self.block_len = block_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_len

    def __getitem__(self, i: int) -> Batch:
        s = slice(i * self.block_len, (i + 1) * self.block_len + 1)
        tokens, docs = self.tokens[s], self.docs[s]
        target = tokens[1:].clone()
        target[docs[1:] != docs[:-1]] = IGNORE_INDEX  # the next document's first token: not predictable
        # document ids relative to the block, so the model sees small integers
        return (tokens[:-1], docs[:-1] - docs[0]), target

    collate = staticmethod(default_collate)

    @staticmethod
    def tokens_in(batch: Batch) -> int:
        return int((batch[1] != IGNORE_INDEX).sum())

    @staticmethod
    def slots_in(batch: Batch) -> int:
        return batch[1].numel()


class UserDataset(Dataset):
    """A dataset given by ``data._target_``: any map-style torch Dataset whose items are
    ``(input, target)`` (or ``(inputs tuple, target)``), in the framework's batch form. Its
    optional ``lengths`` (a tensor of per-item lengths) enables the length-aware samplers."""

    def __init__(self, dataset: Dataset, task: str):
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise ValueError(f"data._target_: {type(dataset).__name__} is not a map-style Dataset "
                             "(__getitem__ and __len__); iterable datasets are not supported yet")  # fmt: skip
        self.dataset, self.task = dataset, task
        if hasattr(dataset, "lengths"):
            self.lengths = torch.as_tensor(dataset.lengths)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.dataset[i]

    def collate(self, items) -> Batch:
        from torch.utils.data import default_collate

        inputs, target = default_collate(items)
        return (tuple(inputs) if isinstance(inputs, list | tuple) else (inputs,)), target

    def tokens_in(self, batch: Batch) -> int | None:
        return batch[1].numel() if self.task == "lm" else None
