"""Tokenizers: `data.tokenizer=bytes|bpe|<a tokenizer.json, or the folder holding one>`.

- `bytes`: UTF-8 bytes as ids 0..255 and an end-of-document id 256 (257 ids).
- a `tokenizer.json` (or a Hugging Face tokenizer folder, as data=chat takes): any `tokenizers`
  tokenizer, offline. Its end-of-document id is the `eos_token` of the tokenizer_config.json beside
  it (a chat model's end of turn, where generation must stop), else its EOS token
  (`<|end_of_text|>`, `<|endoftext|>`, `</s>`, `<eos>`), added when it has none.
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
    """A `tokenizers.Tokenizer` (from a tokenizer.json) with an end-of-document id. `config` is the
    tokenizer_config.json beside it ({} when there is none): its special tokens, chat template;
    `folder` the one holding the tokenizer.json."""

    def __init__(self, tok, name: str, config: dict | None = None, folder: Path | None = None):
        self.tok, self.name, self.config, self.folder = tok, name, config or {}, folder
        declared = token_text(self.config.get("eos_token"))
        candidates = (declared, *EOS_CANDIDATES) if declared else EOS_CANDIDATES
        eos = next((t for t in candidates if tok.token_to_id(t) is not None), None)
        if eos is None:
            tok.add_special_tokens([BPE_EOS])
            eos = BPE_EOS
        self.eos_token, self.eos_id = eos, tok.token_to_id(eos)
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.digest = hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]

    @classmethod
    def from_file(cls, path: str) -> HFTokenizer:
        """A tokenizer.json, or a folder holding one (with its tokenizer_config.json, if any)."""
        from tokenizers import Tokenizer

        file, config = tokenizer_files(path)
        config_json = json.loads(config.read_text()) if config else None
        return cls(Tokenizer.from_file(str(file)), str(path), config_json, file.parent)

    def chat_template(self) -> str | None:
        """Its chat template (Jinja): tokenizer_config.json's `chat_template` (the default one where
        it names several), else a chat_template.jinja beside it (transformers' newer layout)."""
        template = self.config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja = self.folder / "chat_template.jinja" if self.folder else None
        if not template and jinja and jinja.is_file():
            template = jinja.read_text(encoding="utf-8")
        return template or None

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


def token_text(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def tokenizer_files(path: str) -> tuple[Path, Path | None]:
    """(the tokenizer.json, the tokenizer_config.json beside it or None) of `path`: a tokenizer.json,
    or a folder holding one (a Hugging Face tokenizer or model folder, as data=chat takes)."""
    given = Path(path)
    file = given / "tokenizer.json" if given.is_dir() else given
    if not file.is_file():
        raise FileNotFoundError(
            f"data.tokenizer: no tokenizer.json at {path!r}; allowed: bytes, a tokenizer.json or its folder"
        )
    config = file.parent / "tokenizer_config.json"
    return file, config if config.is_file() else None


def load_tokenizer(spec: str, folder: str | None = None):
    """`bytes`, `bpe` (the tokenizer.json saved in `folder`, the shards' folder), or a tokenizer.json
    or the folder holding one."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "bpe":
        if folder is None or not (Path(folder) / "tokenizer.json").is_file():
            raise FileNotFoundError("data.tokenizer: bpe is trained by framework.data.prepare; no tokenizer.json yet")
        return HFTokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    return HFTokenizer.from_file(spec)


def data_tokenizer(data) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a run's data config (`cfg.data`, or its saved dict) trains with: data=tokens,
    the shards' own (their index.json names it, tokenizer.json beside them); data=text, hf and
    chat, data.tokenizer (a tokenizer.json or its folder); else bytes. Shared by generate, the
    harness and export, so each reads the run's tokens as it trained on them. A mixture's sources
    share one tokenizer (checked before training): the first's."""
    if data.get("sources"):
        from omegaconf import OmegaConf

        from framework.data.mixture import source_configs

        return data_tokenizer(source_configs(OmegaConf.create(data))[0][2])
    if data.get("name") == "tokens":
        try:
            return tokenizer_of_shards(data["path"])
        except FileNotFoundError:
            raise FileNotFoundError(f"data.path: the run's token shards at {data['path']!r} are gone; their "
                                    "tokenizer (index.json, tokenizer.json) is needed: restore them there") from None  # fmt: skip
    return load_tokenizer(data.get("tokenizer") or "bytes")


def tokenizer_of_shards(folder: str):
    """The tokenizer a shards folder was prepared with (its manifest names it)."""
    manifest = json.loads((Path(folder) / "index.json").read_text())
    return (
        ByteTokenizer()
        if manifest["tokenizer"] == "bytes"
        else HFTokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    )
