"""`python -m framework.generate CHECKPOINT --prompt TEXT [--max-new-tokens N] [--temperature T]
[--top-k K] [--seed S]`: continue a prompt with a trained language model and print the text.

It reads the DCP checkpoint directly (any layout it was saved under: DCP reshards into the plain
model), on one process, on the GPU if there is one. The tokens are the run's: its tokenizer is
read from the config saved beside the checkpoint (data.tokenizer; for data=tokens, the one
framework.data.prepare recorded with the shards), so a model trained on BPE ids is prompted with
BPE ids, not bytes. The prompt is encoded with it, the continuation decoded with it, and
generation stops at its end-of-document id (a model trained on documents ends them).
`--temperature 0` is greedy decoding, deterministic.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from itertools import islice
from typing import Any

import torch
from omegaconf import OmegaConf

from framework.checkpoint import store as checkpoint
from framework.config import ConfigError
from framework.contract import build_model, logits_of, spec_of
from framework.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, tokenizer_of_shards
from framework.evaluate import load_model, resolve_checkpoint


def load_lm(path: str, device: torch.device) -> torch.nn.Module:
    """The plain model of checkpoint `path`, its weights loaded, in eval mode."""
    saved = checkpoint.find_config(path)
    if saved is None:
        raise ConfigError("CHECKPOINT", f"no {checkpoint.CONFIG_FILE} beside {path}")
    model_cfg = OmegaConf.create(saved["model"])
    model = build_model(model_cfg, device)
    task = spec_of(model, model_cfg).task
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


@torch.no_grad()
def sample(model, tokens: torch.Tensor, temperature: float, top_k: int | None,
           generator: torch.Generator) -> Iterator[torch.Tensor]:  # fmt: skip
    """The next token (1, 1) after `tokens` (1, T), again and again, each appended to the context;
    the context is cut to the model's block_size. temperature 0: the most likely token each time."""
    block = getattr(model, "block_size", None)
    while True:
        context = tokens if block is None else tokens[:, -block:]
        logits = logits_of(model(context))[:, -1, :].float()
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        tokens = torch.cat([tokens, nxt], dim=1)
        yield nxt


def generate(model, tokens: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
             generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """`tokens` (1, T) and `max_new_tokens` sampled tokens after them."""
    new = list(islice(sample(model, tokens, temperature, top_k, generator), max_new_tokens))
    return torch.cat([tokens, *new], dim=1)


class OneLineParser(argparse.ArgumentParser):
    """A bad argument is one line naming it and exit 2, as at every front door (not argparse's usage block)."""

    def error(self, message: str):
        extra = message.removeprefix("unrecognized arguments: ")
        if extra != message:  # a key=value override: the model and its settings are the checkpoint's
            message = f"{extra}: not an argument here; generate takes CHECKPOINT and --prompt, --max-new-tokens, " \
                      "--temperature, --top-k, --seed (the model is the checkpoint's)"  # fmt: skip
        print(f"error: {message.removeprefix('argument ')}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="python -m framework.generate", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder, or a run directory (its best, else newest)")
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        if args.max_new_tokens < 0 or args.temperature < 0:
            raise ConfigError("--max-new-tokens/--temperature", "must be >= 0")
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        path = resolve_checkpoint(args.checkpoint)
        model = load_lm(path, device)
        tok = run_tokenizer(checkpoint.find_config(path) or {})
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    prompt = tok.encode(args.prompt) or tok.encode("\n")  # no prompt: begin at a line
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    new: list[int] = []
    for nxt in islice(sample(model, tokens, args.temperature, args.top_k, generator), args.max_new_tokens):
        if int(nxt) == tok.eos_id:  # the model ended the document
            break
        new.append(int(nxt))
    print(tok.decode(prompt + new) if args.prompt else tok.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
