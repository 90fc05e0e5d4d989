"""Tokenizers: `data.tokenizer=bytes|bpe|<path to tokenizer.json>`.

- `bytes`: UTF-8 bytes as ids 0..255 and an end-of-document id 256 (257 ids).
- a `tokenizer.json`: any Hugging Face `tokenizers` tokenizer, offline. Its end-of-document id is
  its EOS token (`<|end_of_text|>`, `<|endoftext|>`, `</s>`, `<eos>`), added when it has none.
- `bpe`: a byte-level BPE of `data.vocab_size` ids trained on the corpus (`train_bpe`), saved as
  tokenizer.json beside the token shards (framework.data.prepare).

All three give `encode(text) -> list[int]`, `decode(ids) -> str`, `vocab_size`, `eos_id` and a
`digest` (a hash of what maps text to ids, stored in the shards' manifest).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
BPE_EOS = "<|endoftext|>"


class ByteTokenizer:
    name = "bytes"
    vocab_size = 257
    eos_id = 256
    digest = "bytes-utf8-eos256"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list:
        """Arrays of byte values (not lists: a shard of bytes holds as many ids as input bytes)."""
        import numpy as np

        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def save(self, path: str) -> None:  # nothing to save: the mapping is fixed
        pass


class HFTokenizer:
    """A `tokenizers.Tokenizer` (from a tokenizer.json) with an end-of-document id."""

    def __init__(self, tok, name: str):
        self.tok, self.name = tok, name
        eos = next((t for t in EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        if eos is None:
            tok.add_special_tokens([BPE_EOS])
            eos = BPE_EOS
        self.eos_id = tok.token_to_id(eos)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.digest = hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]

    @classmethod
    def from_file(cls, path: str) -> HFTokenizer:
        from tokenizers import Tokenizer

        if not Path(path).is_file():
            raise FileNotFoundError(f"data.tokenizer: no tokenizer.json at {path!r} (or bytes, bpe)")
        return cls(Tokenizer.from_file(str(path)), str(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([i for i in ids if i != self.eos_id], skip_special_tokens=False)

    def save(self, path: str) -> None:
        self.tok.save(str(path))


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE (GPT-2 style: every byte has an id, so any text encodes and decodes
    back exactly) of `vocab_size` ids, `<|endoftext|>` among them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[BPE_EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, "bpe")


def load_tokenizer(spec: str, folder: str | None = None):
    """`bytes`, `bpe` (the tokenizer.json saved in `folder`, the shards' folder) or a path."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "bpe":
        if folder is None or not (Path(folder) / "tokenizer.json").is_file():
            raise FileNotFoundError("data.tokenizer: bpe is trained by framework.data.prepare; no tokenizer.json yet")
        return HFTokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    return HFTokenizer.from_file(spec)


def tokenizer_of_shards(folder: str):
    """The tokenizer a shards folder was prepared with (its manifest names it)."""
    manifest = json.loads((Path(folder) / "index.json").read_text())
    return (
        ByteTokenizer()
        if manifest["tokenizer"] == "bytes"
        else HFTokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    )
