"""Chat data (`data=chat data.path=FILE.jsonl data.tokenizer=FOLDER`): conversations rendered with
the tokenizer's own chat template, only the assistant's tokens in the loss.

Each line of the JSONL file is `{"messages": [{"role": ..., "content": ...}, ...]}`. The folder
(or the tokenizer.json in it) holds `tokenizer.json` and `tokenizer_config.json`, whose
`chat_template` (Jinja; else the folder's `chat_template.jinja`, transformers' newer layout) renders a
conversation as transformers' `apply_chat_template` does (a sandboxed environment, trim_blocks and
lstrip_blocks, `raise_exception`, the config's special tokens as variables). An assistant turn's
text is where the conversation rendered through it extends the conversation rendered up to it with
the generation prompt; the rendered text is tokenized once, with offsets, and a position is a
target only where the token it predicts starts inside an assistant turn. The rest (system, user,
the template's own markup, padding) carries the ignore index. Conversations are cut to
`seq_len + 1` tokens and padded to it (fixed shapes: every strategy, pipelines included).
"""

from __future__ import annotations

import json

import torch
from torch.utils.data import Dataset, default_collate

from framework.data.datasets import PackedSequences
from framework.data.tokenizer import HFTokenizer, token_text
from framework.loss import IGNORE_INDEX

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


class ChatTemplate:
    """A tokenizer's chat template and special tokens (its tokenizer_config.json)."""

    def __init__(self, tokenizer: HFTokenizer):
        template = tokenizer.chat_template()
        if not template:
            raise ValueError(f"data.tokenizer: {tokenizer.name!r} has no chat_template (in tokenizer_config.json "
                             "or chat_template.jinja)")  # fmt: skip
        self.special = {k: token_text(v) for k, v in tokenizer.config.items()
                        if k.endswith("_token") and isinstance(v, (str, dict))}  # fmt: skip
        self.template = _environment().from_string(template)

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self.special)

    def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation, and the character span of each assistant turn in it."""
        text, spans = self.render(messages), []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            start = len(self.render(messages[:i], add_generation_prompt=True))
            end = len(self.render(messages[: i + 1]))
            if not text.startswith(self.render(messages[: i + 1])) or start > end:
                raise ValueError("data.tokenizer: its chat template does not render a conversation's turns as "
                                 "prefixes of the whole; the assistant's tokens cannot be told apart")  # fmt: skip
            spans.append((start, end))
        return text, spans


def _environment():
    from jinja2 import ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise ValueError(f"data.path: the chat template refused a conversation: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env


def encode_conversation(tokenizer, template: ChatTemplate, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """(token ids of the rendered conversation, whether each token is the assistant's)."""
    text, spans = template.assistant_spans(messages)
    encoding = tokenizer.tok.encode(text, add_special_tokens=False)
    starts = [start for start, _ in encoding.offsets]
    return encoding.ids, [any(a <= s < b for a, b in spans) for s in starts]


class ChatSequences(Dataset):
    """The conversations of a JSONL file, tokenized, each (inputs, targets) of seq_len tokens."""

    def __init__(self, path: str, tokenizer_path: str, seq_len: int):
        tokenizer = HFTokenizer.from_file(tokenizer_path)
        template = ChatTemplate(tokenizer)
        self.seq_len, self.pad_id = seq_len, tokenizer.eos_id
        self.items = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    messages = json.loads(line)["messages"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"data.path: {path} line {number} is not a JSON object with messages") from None
                ids, assistant = encode_conversation(tokenizer, template, messages)
                self.items.append((ids[: seq_len + 1], assistant[: seq_len + 1]))
        if not self.items:
            raise ValueError(f"data.path: {path} holds no conversation")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Batch:
        ids, assistant = self.items[i]
        tokens = torch.full((self.seq_len + 1,), self.pad_id, dtype=torch.long)
        tokens[: len(ids)] = torch.tensor(ids)
        target = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        counted = torch.tensor(assistant[1:], dtype=torch.bool)  # position j predicts token j + 1
        target[: len(counted)] = torch.where(counted, tokens[1 : len(ids)], IGNORE_INDEX)
        return (tokens[:-1],), target

    # fixed-length items with ignored targets: batched and counted as packed sequences are
    collate = staticmethod(default_collate)
    tokens_in = staticmethod(PackedSequences.tokens_in)
    slots_in = staticmethod(PackedSequences.slots_in)
