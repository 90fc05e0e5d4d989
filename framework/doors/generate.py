"""`python -m framework.generate CHECKPOINT|RUN_DIR|key=value ... --prompt TEXT | --prompts FILE
[--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--print-ids] [--no-cache]`:
continue prompts with a language model and print the text.

The model is what every door reads (framework/config/door.py): a checkpoint (or a run folder's
best, else newest), its weights read directly from DCP under any layout it was saved under, the
overrides on top; or, with no checkpoint, the model train.py's overrides compose, as train.py
builds it (`model=llama model.pretrained=DIR data=text`, `model=hf model.pretrained=DIR`: the
pretrained weights; any other initialised from the seed). One process, on the GPU if there is one
(`device=cpu` says otherwise). The tokens are the config's: its tokenizer (data.tokenizer; for
data=tokens, the one framework.data.prepare recorded with the shards), so a model trained on BPE
ids is prompted with BPE ids, not bytes. The prompt is encoded with it, the continuation decoded
with it, and generation stops at its end-of-document id (a model trained on documents ends them).
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

import torch
from omegaconf import DictConfig

from framework.config import ConfigError, resolve_device, resolve_nproc
from framework.config.door import DoorInput, resolve_input, split_target
from framework.contract import build_model, logits_of, spec_of
from framework.converters import convert_model
from framework.data.tokenizer import ByteTokenizer, HFTokenizer, data_tokenizer
from framework.doors.evaluate import load_model
from framework.modules import materialize_model
from models.kv_cache import caching, supports_cache

Tokenizer = ByteTokenizer | HFTokenizer


def open_lm(
    target: str | None, overrides: list[str], device: str | None = None
) -> tuple[torch.nn.Module, Tokenizer, torch.device]:
    """The language model and tokenizer a checkpoint (`target`) or the overrides name, and the
    device it is on (`device`, else the config's: the GPU if there is one), read through the
    doors' one way in (framework/config/door.py)."""
    if target is None and not overrides:
        raise ConfigError("CHECKPOINT", "give a checkpoint or run folder, or the model's overrides as train.py "
                          "takes them (model=llama model.pretrained=DIR data=text)")  # fmt: skip
    door = resolve_input(target, overrides)
    if door.cfg.parallel.name != "none" or resolve_nproc(door.cfg) != 1:
        raise ConfigError("parallel", "the plain model runs on one process here: parallel=none, "
                          "launch.nproc_per_node=1 (framework.evaluate runs under a strategy)")  # fmt: skip
    on = torch.device(device or resolve_device(door.cfg))
    return build_lm(door, on), run_tokenizer(door.cfg), on


def build_lm(door: DoorInput, device: torch.device) -> torch.nn.Module:
    """The plain model of the door's input, in eval mode: the checkpoint's weights, else as
    train.py builds it (pretrained weights loaded, or initialised from the seed)."""
    cfg = door.cfg
    model = build_model(cfg.model, device if door.checkpoint is not None else "meta")
    spec = spec_of(model, cfg.model)
    if spec.task != "lm":
        raise ConfigError(
            "model", f"{cfg.model._target_} is a {spec.task} model; generation needs a language model (lm)"
        )
    convert_model(model, cfg, spec)  # the run's converters (peft=lora's adapters: a fine-tune's checkpoint holds them)
    if door.checkpoint is not None:
        load_model(door.checkpoint, model)
    else:
        materialize_model(model, spec, cfg, device)
    return model.eval()


def run_tokenizer(cfg: DictConfig) -> Tokenizer:
    """The tokenizer of the config's data (framework.data.tokenizer's `data_tokenizer`, as export
    reads it: the shards' own; data.tokenizer, a tokenizer.json or its folder; else bytes)."""
    try:
        return data_tokenizer(cfg.data)
    except FileNotFoundError as err:
        key, _, message = str(err).partition(": ")
        raise ConfigError(key, message) from None


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
        if extra != message:
            message = f"{extra}: not an argument here; generate takes CHECKPOINT or key=value overrides and " \
                      "--prompt, --prompts, --max-new-tokens, --temperature, --top-k, --top-p, --seed, " \
                      "--print-ids, --no-cache"  # fmt: skip
        print(f"error: {message.removeprefix('argument ')}", file=sys.stderr)
        sys.exit(2)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = OneLineParser(prog="python -m framework.generate", description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="*", metavar="CHECKPOINT|key=value",
                        help="a checkpoint folder or a run directory (its best, else newest), then overrides; "
                             "or train.py's overrides alone (model=llama model.pretrained=DIR)")  # fmt: skip
    parser.add_argument("--prompt", default=None, help="text to continue")
    parser.add_argument("--prompts", default=None, help="a file of prompts, one a line, each continued in turn")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None, help="nucleus sampling: the fewest tokens reaching p")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--print-ids", action="store_true", help="also print the new tokens' ids, a list a prompt")
    parser.add_argument("--no-cache", action="store_true", help="run the whole context for every token")
    return parser.parse_intermixed_args(argv)


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
        model, tok, device = open_lm(*split_target(args.inputs))
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
