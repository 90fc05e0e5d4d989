"""`data=tokens data.path=<shards>`: windows of the token shards framework.data.prepare wrote.

Sample i is window i of the split's shards: tokens [i*T, i*T + T + 1) of one shard (windows do
not cross shards), inputs the first T and targets the last T. Each read maps just that window of
the file (np.memmap with an offset) and copies it out: nothing of the corpus stays resident, so
memory does not grow with the corpus. The order, the split over data-parallel ranks and loader
workers, and the checkpointable position are the framework's sampler's (framework/data), as for
every map-style dataset.

`data.pack=true`: documents are kept apart as in packed varlen data: each position carries its
document id (the model keeps attention within a document and restarts positions), and the token
after an end-of-document is not predicted.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate

from framework.data.tokenizer import HFTokenizer, load_tokenizer, tokenizer_files
from framework.loss import IGNORE_INDEX

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def read_manifest(folder: str) -> dict:
    path = Path(folder) / "index.json"
    if not path.is_file():
        raise FileNotFoundError(f"data.path: no token shards at {folder!r} (no index.json; make them with "
                                "python -m framework.data.prepare INPUT OUT)")  # fmt: skip
    return json.loads(path.read_text())


class TokenShards(Dataset):
    def __init__(self, folder: str, seq_len: int, split: str = "train", pack: bool = False):
        self.manifest = m = read_manifest(folder)
        self.folder, self.seq_len, self.pack = Path(folder), seq_len, pack
        self.dtype, self.eos_id, self.vocab_size = np.dtype(m["dtype"]), m["eos_id"], m["vocab_size"]
        self.shards = [s for s in m["shards"] if s["split"] == split]
        counts = [max(0, (s["tokens"] - 1) // seq_len) for s in self.shards]
        self.starts = np.cumsum([0, *counts]).tolist()  # first window of each shard
        if self.starts[-1] == 0:
            raise ValueError(
                f"data.path: the {split} split of {folder} has no window of seq_len+1={seq_len + 1} tokens"
            )

    def __len__(self) -> int:
        return self.starts[-1]

    def window(self, i: int) -> torch.Tensor:
        """Window i's T+1 tokens, as int64."""
        k = bisect.bisect_right(self.starts, i) - 1
        offset = (i - self.starts[k]) * self.seq_len * self.dtype.itemsize
        mm = np.memmap(self.folder / self.shards[k]["file"], dtype=self.dtype, mode="r", offset=offset,
                       shape=(self.seq_len + 1,))  # fmt: skip
        out = torch.from_numpy(mm.astype(np.int64))
        del mm  # unmapped: the pages leave this process
        return out

    def __getitem__(self, i: int) -> Batch:
        chunk = self.window(i)
        x, y = chunk[:-1], chunk[1:].clone()
        if not self.pack:
            return (x,), y
        ends = x == self.eos_id  # an end-of-document belongs to the document it ends
        docs = torch.cumsum(ends.long(), 0) - ends.long()
        y[ends] = IGNORE_INDEX  # the next document's first token: not predictable from this one
        return (x, docs), y

    collate = staticmethod(default_collate)

    @staticmethod
    def tokens_in(batch: Batch) -> int:
        return int((batch[1] != IGNORE_INDEX).sum())

    @staticmethod
    def slots_in(batch: Batch) -> int:
        return batch[1].numel()


def vocab_size_of(cfg) -> int | None:
    """The ids the data holds (its tokenizer's vocabulary): what a model's vocab_size follows
    when not set. None for data without tokens."""
    if cfg.get("sources"):  # a mixture: its sources share a tokenizer (checked), the first's
        from framework.data.mixture import source_configs

        return vocab_size_of(source_configs(cfg)[0][2])
    if cfg.name == "tokens":
        return read_manifest(cfg.path)["vocab_size"]
    if cfg.name == "text":
        return 256 if cfg.tokenizer == "bytes" else load_tokenizer(cfg.tokenizer).vocab_size
    if cfg.name == "chat":
        return load_tokenizer(cfg.tokenizer).vocab_size
    if cfg.name == "hf" and cfg.tokens_column is None:
        return 256 if cfg.tokenizer == "bytes" else load_tokenizer(cfg.tokenizer).vocab_size
    return cfg.get("vocab_size")


def data_vocab(root) -> int | None:
    """`${data_vocab:}` (registered with the config's resolvers): the ids the configured data holds
    (its tokenizer's), for a model's vocab_size (conf/model/llama.yaml); null with model.pretrained
    (the checkpoint's config.json says)."""
    if root.model.get("pretrained") is not None:
        return None
    try:
        return vocab_size_of(root.data)
    except (FileNotFoundError, OSError):  # a missing path: validation names it (data.path)
        return None


def config_problem(cfg) -> tuple[str, str] | None:
    """(key, message) for the first setting of tokens, tokenizers or a pretrained model's
    vocabulary that cannot run, else None (framework.config.validate raises it)."""
    problem = data_problem(cfg.data)
    return problem or vocab_problem(cfg)


def data_problem(d) -> tuple[str, str] | None:
    """The data's own settings (each source's, for a mixture)."""
    if d.get("sources"):
        from framework.data.mixture import source_configs

        sources = source_configs(d)
        for k, (_, _, source) in enumerate(sources):
            if problem := data_problem(source):
                return f"data.sources[{k}].{problem[0].split('.', 1)[1]}", problem[1]
        if len({vocab_size_of(source) for _, _, source in sources}) > 1:
            return "data.sources", "the sources hold different vocabularies; mix data of one tokenizer"
        return None
    if d.name == "tokens":
        if not (Path(d.path) / "index.json").is_file():
            return (
                "data.path",
                f"no token shards at {d.path!r}: make them with python -m framework.data.prepare INPUT OUT",
            )
        made_with = read_manifest(d.path)["tokenizer"]
        given = d.tokenizer if d.tokenizer in (None, "bytes", "bpe") else "tokenizer.json"
        if given not in (None, made_with):
            return "data.tokenizer", f"got {d.tokenizer!r}, but the shards at {d.path} were made with {made_with}"
    if d.name == "chat":
        if not Path(d.path).is_file():
            return "data.path", f"no JSONL file of conversations at {d.path!r}"
        if problem := chat_tokenizer_problem(d.tokenizer):
            return problem
    if d.name == "hf" and (problem := hf_problem(d)):
        return problem
    if d.name == "text" and d.tokenizer == "bpe":
        return (
            "data.tokenizer",
            "bpe is trained by python -m framework.data.prepare INPUT OUT --tokenizer bpe; train on data=tokens",
        )
    if d.name == "text":
        return tokenizer_problem(d.tokenizer)
    return None


def tokenizer_problem(spec: str) -> tuple[str, str] | None:
    """data.tokenizer names no tokenizer: neither bytes nor a tokenizer.json (or its folder)."""
    if spec == "bytes":
        return None
    try:
        tokenizer_files(spec)
    except FileNotFoundError as err:
        return "data.tokenizer", str(err).removeprefix("data.tokenizer: ")
    return None


def chat_tokenizer_problem(spec: str) -> tuple[str, str] | None:
    """data=chat: data.tokenizer is a tokenizer with a chat template that compiles."""
    from jinja2 import TemplateError

    from framework.data.chat import ChatTemplate

    try:
        ChatTemplate(HFTokenizer.from_file(spec))
    except (FileNotFoundError, ValueError, TemplateError) as err:
        key, _, message = str(err).partition(": ")
        return (key, message) if key.startswith("data.") else ("data.tokenizer", f"its chat_template: {err}")
    return None


def vocab_problem(cfg) -> tuple[str, str] | None:
    """The model's vocabulary holds the data's ids."""
    d = cfg.data
    folder = cfg.model.get("pretrained")
    if folder is None:
        vocab, data_vocab = (
            cfg.model.get("vocab_size"),
            vocab_size_of(d) if d.name in ("text", "tokens", "chat", "hf") else None,
        )
        if vocab is not None and data_vocab is not None and data_vocab > vocab:
            return "model.vocab_size", f"got {vocab}; the data's tokenizer has {data_vocab} ids (null: follow it)"
        return None
    if not (Path(folder) / "config.json").is_file():
        return "model.pretrained", f"no Hugging Face config.json in {folder!r}"
    vocab = cfg.model.get("vocab_size") or json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    data_vocab = vocab_size_of(d)
    if data_vocab is not None and data_vocab > vocab:
        return (
            "data.tokenizer",
            f"the data's tokenizer has {data_vocab} ids, more than the model's vocabulary of {vocab}",
        )
    return None


def hf_problem(d) -> tuple[str, str] | None:
    """data=hf: the path holds data of a known format, with the column to read, and a tokenizer."""
    from framework.data.hf_data import columns_of

    if not Path(d.path).exists():
        return "data.path", f"no file or folder at {d.path!r} (local files or a save_to_disk folder; nothing downloads)"
    try:
        columns = columns_of(d.path, d.format)
    except Exception as err:  # noqa: BLE001 - ours name their key; a file of another format: pyarrow's, json's
        text = str(err)
        if isinstance(err, ValueError | FileNotFoundError) and text.startswith("data.") and ": " in text:
            key, message = text.split(": ", 1)
            return key, message
        first = (text.splitlines() or [""])[0][:200]
        return "data.path", f"{d.path!r} does not read as data.format={d.format} files: {type(err).__name__}: {first}"
    key, column = ("data.tokens_column", d.tokens_column) if d.tokens_column else ("data.text_column", d.text_column)
    if column not in columns:
        return key, f"no column {column!r} in {d.path}; its columns: {', '.join(columns)}"
    if d.tokens_column is None and (problem := tokenizer_problem(d.tokenizer)):
        return problem
    if d.tokens_column is not None and d.vocab_size is None:
        return "data.vocab_size", "a tokens_column needs the ids it holds (data.vocab_size=N): the model's follows"
    return None
