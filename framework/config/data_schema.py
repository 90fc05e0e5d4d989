"""The `data` group's schemas: the loader's keys every choice has (`LoaderFields`) and each
built-in dataset's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from framework.config.choices import HFFormat, ImageSource, Sampler, TransformsOn, VarlenSource

__all__ = [
    "DATA_SCHEMAS",
    "ChatDataConfig",
    "CustomDataConfig",
    "HFDataConfig",
    "ImagesDataConfig",
    "LoaderFields",
    "TextDataConfig",
    "TokensDataConfig",
    "VarlenDataConfig",
    "VectorsDataConfig",
]


@dataclass
class LoaderFields:
    name: str = MISSING
    batch_size: int = 8  # micro-batch of ONE data-parallel rank
    # auto: on CUDA, a few loader processes (min(4, cores per GPU - 1)) and pinned memory; on a
    # CPU neither (the ranks share the cores with training): framework.data.loader_settings
    num_workers: Any = "auto"  # auto | an int >= 0
    pin_memory: Any = "auto"  # auto | true | false (true: CUDA only)
    persistent_workers: bool = False
    prefetch_factor: int | None = None  # only with num_workers > 0 (torch's default: 2)
    drop_last: bool = True
    shuffle: bool = True
    sampler: Sampler = Sampler.distributed  # length_grouped, token_budget: varlen only
    max_tokens: int = 4096  # token_budget: padded tokens per rank per micro-batch
    rank_batch_sizes: list[int] | None = None  # per data-parallel rank micro-batch sizes (by capability)
    pack: bool = False  # varlen + gpt: concatenate sequences into blocks of pack_len, no padding
    pack_len: int = 128
    val_fraction: float = 0.0  # held out for validation: text, the corpus' tail; else samples/documents (seeded)
    val_path: str | None = None  # text: a separate file or folder to validate on (instead of val_fraction)
    # curriculum, by optimizer step: [[step, value], ...] from step 0, each value in force from its step on
    batch_schedule: list[list[int]] | None = None  # value: the global batch in samples (a batch ramp)
    seq_len_schedule: list[list[int]] | None = None  # value: tokens per sequence, <= seq_len (a warm-up)
    # a weighted mixture: [{path: A, weight: 0.7}, {path: B, weight: 0.3, label: b}], each entry's keys
    # over this group's settings (framework/data/mixture.py); data.path is then not needed
    sources: list[Any] | None = None


@dataclass
class TextDataConfig(LoaderFields):
    name: str = "text"
    path: str | None = None  # file or folder of text; null: this Python's standard library source
    seq_len: int = 128
    max_bytes: int = 4_000_000  # read at most this many bytes of the corpus
    tokenizer: str = "bytes"  # bytes (ids 0..255) | a tokenizer.json or its folder (bpe: prepare shards, data=tokens)


@dataclass
class ChatDataConfig(LoaderFields):
    """Conversations (JSONL of `messages`) rendered with the tokenizer's chat template; only the
    assistant's tokens carry loss (framework/data/chat.py)."""

    name: str = "chat"
    path: str = MISSING  # a JSONL file, one {"messages": [{"role": ..., "content": ...}, ...]} a line
    tokenizer: str = MISSING  # a tokenizer folder with its chat_template (tokenizer_config.json), or its tokenizer.json
    seq_len: int = 256  # each conversation cut to seq_len + 1 tokens and padded to it


@dataclass
class HFDataConfig(LoaderFields):
    """Hugging Face `datasets` from local files or a saved dataset, never the network; each row one
    sample of seq_len + 1 tokens, padded (framework/data/hf_data.py)."""

    name: str = "hf"
    path: str = MISSING  # a file, a folder of files, or a dataset saved with save_to_disk
    format: HFFormat = HFFormat.auto  # auto: a saved dataset, else the files' suffix
    text_column: str = "text"  # tokenized on the fly by data.tokenizer
    tokens_column: str | None = None  # token ids used as they are (instead of text_column)
    tokenizer: str = "bytes"  # bytes | a tokenizer.json or its folder
    vocab_size: int | None = None  # tokens_column: the ids it holds (the model's vocabulary follows)
    seq_len: int = 128
    streaming: bool = False  # read as a stream, never whole: corpora larger than memory
    shuffle_buffer: int = 1024  # streaming: rows permuted within windows of this many (seeded, resumable)


@dataclass
class TokensDataConfig(LoaderFields):
    """Token shards written by `python -m framework.data.prepare` (memory-mapped, never read whole)."""

    name: str = "tokens"
    path: str = MISSING  # the shards' folder (index.json + shard-*.bin)
    seq_len: int = 128
    split: str = "train"  # train | val (the shards prepare --val-fraction set aside)
    tokenizer: str | None = None  # null: the shards' own; else checked against it (bytes | bpe | a tokenizer.json)


@dataclass
class ImagesDataConfig(LoaderFields):
    name: str = "images"
    num_samples: int = 2048
    image_size: int = 32
    channels: int = 3
    num_classes: int = 10
    noise: float = 1.0  # synthetic only
    source: ImageSource = ImageSource.synthetic  # folder: torchvision ImageFolder; cifar10: local, never downloaded
    root: str | None = None  # folder or CIFAR-10 root
    transforms_on: TransformsOn = (
        TransformsOn.device
    )  # device: batched on the training device; loader: per sample in workers
    augment: bool = True  # random crop (4-pixel padding) and horizontal flip


@dataclass
class VectorsDataConfig(LoaderFields):
    name: str = "vectors"
    num_samples: int = 4096
    dim: int = 32
    num_classes: int = 8


@dataclass
class VarlenDataConfig(LoaderFields):
    name: str = "varlen"
    num_samples: int = 4096
    vocab_size: int = 32
    num_classes: int = 4
    min_len: int = 4
    max_len: int = 128
    mean_len: float = 24.0  # long-tailed (log-normal) lengths around this mean
    source: VarlenSource = VarlenSource.synthetic  # text: the paragraphs of the text corpus
    path: str | None = None  # source=text: a file or folder of text; null: the stdlib source
    seq_len: int = 128  # the longest input a model sees (max_len, or pack_len when packing)


@dataclass
class CustomDataConfig(LoaderFields):
    """data=custom: your own map-style Dataset by `_target_`; the keys beside it are its arguments."""

    name: str = "custom"
    _target_: str = MISSING  # a Dataset class or factory, e.g. pkg.module.MyDataset
    seq_len: int | None = None  # lm data: tokens per sample, where the model checks its block size


DATA_SCHEMAS = {
    "text": TextDataConfig,
    "images": ImagesDataConfig,
    "vectors": VectorsDataConfig,
    "varlen": VarlenDataConfig,
    "custom": CustomDataConfig,
    "tokens": TokensDataConfig,
    "chat": ChatDataConfig,
    "hf": HFDataConfig,
}
