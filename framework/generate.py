"""`python -m framework.generate CHECKPOINT --prompt TEXT [--max-new-tokens N] [--temperature T]
[--top-k K] [--seed S]`: continue a prompt with a trained language model and print the text.

It reads the DCP checkpoint directly (any layout it was saved under: DCP reshards into the plain
model), on one process, on the GPU if there is one. Tokens are bytes (the text data's tokenizer):
the prompt's UTF-8 bytes in, the continuation decoded back (invalid sequences replaced).
`--temperature 0` is greedy decoding, deterministic.
"""

from __future__ import annotations

import argparse
import sys

import torch
from omegaconf import OmegaConf

from framework.checkpoint import store as checkpoint
from framework.config import ConfigError
from framework.contract import build_model, logits_of, spec_of
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


@torch.no_grad()
def generate(model, tokens: torch.Tensor, max_new_tokens: int, temperature: float, top_k: int | None,
             generator: torch.Generator) -> torch.Tensor:  # fmt: skip
    """Append `max_new_tokens` sampled tokens to `tokens` (1, T); the context is cut to the model's
    block_size. temperature 0: the most likely token each time."""
    block = getattr(model, "block_size", None)
    for _ in range(max_new_tokens):
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
    return tokens


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
        model = load_lm(resolve_checkpoint(args.checkpoint), device)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    prompt = list(args.prompt.encode("utf-8")) or [ord("\n")]
    tokens = torch.tensor([prompt], dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    out = generate(model, tokens, args.max_new_tokens, args.temperature, args.top_k, generator)
    text = bytes(out[0].tolist()).decode("utf-8", errors="replace")
    print(text if args.prompt else text[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
