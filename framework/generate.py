"""`python -m framework.generate CHECKPOINT --prompt TEXT | --prompts FILE [--max-new-tokens N]
[--temperature T] [--top-k K] [--top-p P] [--seed S] [--print-ids] [--no-cache]`: continue prompts
with a trained language model and print the text.

It reads the DCP checkpoint directly (any layout it was saved under: DCP reshards into the plain
model), on one process, on the GPU if there is one. The tokens are the run's: its tokenizer is
read from the config saved beside the checkpoint (data.tokenizer; for data=tokens, the one
framework.data.prepare recorded with the shards), so a model trained on BPE ids is prompted with
BPE ids, not bytes. The prompt is encoded with it, the continuation decoded with it, and
generation stops at its end-of-document id (a model trained on documents ends them).
`--temperature 0` is greedy decoding, deterministic. The framework's models decode with a KV
cache (models/kv_cache.py): the prompt runs once, then each new token alone. Tokens per second go
to standard error; `--print-ids` prints each continuation's token ids as a Python list after it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import OmegaConf

from framework.checkpoint import store as checkpoint
from framework.config import ConfigError
from framework.contract import build_model, logits_of, spec_of
from framework.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, tokenizer_of_shards
from framework.evaluate import load_model, resolve_checkpoint
from framework.peft import apply_peft
from models.kv_cache import caching, supports_cache


def load_lm(path: str, device: torch.device) -> torch.nn.Module:
    """The plain model of checkpoint `path`, its weights loaded, in eval mode."""
    saved = checkpoint.find_config(path)
    if saved is None:
        raise ConfigError("CHECKPOINT", f"no {checkpoint.CONFIG_FILE} beside {path}")
    model_cfg = OmegaConf.create(saved["model"])
    model = build_model(model_cfg, device)
    spec = spec_of(model, model_cfg)
    task = spec.task
    if saved.get("peft"):  # the run's adapters are in its checkpoint: the model must hold them
        apply_peft(model, OmegaConf.create(saved["peft"]), spec.blocks, 0)
    if task != "lm":
        raise ConfigError("CHECKPOINT", f"{model_cfg._target_} is a {task} model; generate needs a language model (lm)")
    load_model(path, model)
    return model.eval()


def run_tokenizer(saved: dict[str, Any]) -> ByteTokenizer | HFTokenizer:
    """The tokenizer the run trained with, from its saved config: data=tokens, the shards' own
    (their index.json names it, tokenizer.json beside them); data=text, data.tokenizer; else bytes."""
    data = saved.get("data") or {}
    if data.get("name") == "tokens":
        try:
            return tokenizer_of_shards(data["path"])
        except FileNotFoundError:
            raise ConfigError("data.path", f"the run's token shards at {data['path']!r} are gone; generate needs "
                              "their tokenizer (index.json, tokenizer.json): restore them there") from None  # fmt: skip
    spec = data.get("tokenizer") or "bytes"
    try:
        return load_tokenizer(spec)
    except FileNotFoundError as err:
        raise ConfigError("data.tokenizer", str(err).removeprefix("data.tokenizer: ")) from None


@dataclass(frozen=True)
class Sampling:
    """How the next token is drawn from the logits: temperature 0 is greedy (the most likely);
    else from the softmax at `temperature`, kept to the `top_k` most likely and to the fewest
    whose probabilities reach `top_p` (nucleus sampling)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    generator: torch.Generator | None = None

    def pick(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, vocab) logits -> (B, 1) token ids."""
        logits = logits.float()
        if self.temperature == 0:
            return logits.argmax(-1, keepdim=True)
        logits = logits / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.size(-1))).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            probs, order = torch.softmax(logits, -1).sort(-1, descending=True)
            beyond = probs.cumsum(-1) - probs >= self.top_p  # the rest once the kept ones reach top_p
            logits = logits.scatter(-1, order, logits.gather(-1, order).masked_fill(beyond, float("-inf")))
        return torch.multinomial(torch.softmax(logits, -1), 1, generator=self.generator)


def max_length(model) -> int | None:
    """The most tokens the model takes at once (gpt's block_size, the Llama's max_seq_len), or None."""
    return getattr(model, "block_size", None) or getattr(getattr(model, "args", None), "max_seq_len", None)


@torch.no_grad()
def sample(model, tokens: torch.Tensor, max_new: int, how: Sampling, cache: bool = True) -> Iterator[torch.Tensor]:
    """Up to `max_new` next tokens (B, 1) after `tokens` (B, T), one at a time. With a KV cache
    (the framework's models, models/kv_cache.py) the prompt runs once and then each new token
    alone, while prompt and continuation fit the model's length; past it, and for any other
    model, the whole context (cut to the model's length) runs for every token."""
    limit = max_length(model)
    room = min(tokens.shape[1] + max_new, limit or tokens.shape[1] + max_new)
    if cache and supports_cache(model) and tokens.shape[1] < room:
        with caching(model, tokens.shape[0], room):
            logits = logits_of(model(tokens))[:, -1, :]
            while max_new > 0:
                nxt = how.pick(logits)
                tokens, max_new = torch.cat([tokens, nxt], dim=1), max_new - 1
                yield nxt
                if max_new == 0 or tokens.shape[1] >= room:
                    break
                logits = logits_of(model(nxt))[:, -1, :]
    for _ in range(max_new):
        context = tokens if limit is None else tokens[:, -limit:]
        nxt = how.pick(logits_of(model(context))[:, -1, :])
        tokens = torch.cat([tokens, nxt], dim=1)
        yield nxt


def generate(model, tokens: torch.Tensor, max_new_tokens: int, how: Sampling, cache: bool = True) -> torch.Tensor:
    """`tokens` (B, T) and `max_new_tokens` sampled tokens after them."""
    with closing(sample(model, tokens, max_new_tokens, how, cache)) as new:
        return torch.cat([tokens, *new], dim=1)


class OneLineParser(argparse.ArgumentParser):
    """A bad argument is one line naming it and exit 2, as at every front door (not argparse's usage block)."""

    def error(self, message: str):
        extra = message.removeprefix("unrecognized arguments: ")
        if extra != message:  # a key=value override: the model and its settings are the checkpoint's
            message = f"{extra}: not an argument here; generate takes CHECKPOINT and --prompt, --prompts, " \
                      "--max-new-tokens, --temperature, --top-k, --top-p, --seed, --print-ids, --no-cache " \
                      "(the model is the checkpoint's)"  # fmt: skip
        print(f"error: {message.removeprefix('argument ')}", file=sys.stderr)
        sys.exit(2)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m framework.generate", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder, or a run directory (its best, else newest)")
    parser.add_argument("--prompt", default=None, help="text to continue")
    parser.add_argument("--prompts", default=None, help="a file of prompts, one a line, each continued in turn")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the fewest tokens reaching p")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--print-ids", action="store_true", help="also print the new tokens' ids, a list a prompt")
    parser.add_argument("--no-cache", action="store_true", help="run the whole context for every token")
    return parser.parse_args(argv)


def prompts_of(args: argparse.Namespace) -> list[str]:
    if args.prompts is None:
        return [args.prompt or ""]
    try:
        with open(args.prompts, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    except OSError as err:
        raise ConfigError("--prompts", f"cannot read {args.prompts!r}: {err.strerror}") from None


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        if args.max_new_tokens < 0 or args.temperature < 0 or not 0 < (args.top_p or 1) <= 1:
            raise ConfigError("--max-new-tokens/--temperature/--top-p", "must be >= 0, >= 0 and in (0, 1]")
        prompts = prompts_of(args)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        path = resolve_checkpoint(args.checkpoint)
        model = load_lm(path, device)
        tok = run_tokenizer(checkpoint.find_config(path) or {})
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    how = Sampling(args.temperature, args.top_k, args.top_p, torch.Generator(device=device).manual_seed(args.seed))
    made, started = 0, time.perf_counter()
    for text in prompts:
        prompt = tok.encode(text) or tok.encode("\n")  # no prompt: begin at a line
        new: list[int] = []
        tokens = torch.tensor([prompt], dtype=torch.long, device=device)
        with closing(sample(model, tokens, args.max_new_tokens, how, cache=not args.no_cache)) as stream:
            for nxt in stream:
                if int(nxt) == tok.eos_id:  # the model ended the document
                    break
                new.append(int(nxt))
        made += len(new)
        print(tok.decode(prompt + new) if text else tok.decode(new))
        if args.print_ids:
            print(new)
    seconds = time.perf_counter() - started
    print(f"{made} tokens in {seconds:.2f} s: {made / max(seconds, 1e-9):.1f} tokens/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
