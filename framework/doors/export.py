"""`python -m framework.export CHECKPOINT OUT [--format hf|peft] [--config RUN_CONFIG]`: the
command line of framework/checkpoint/export.py (what is written, and how, is told there). The door
reads the run's config and its tokenizer (the data's, as generate reads it) and hands both to the
library, which imports neither the data nor any model."""

from __future__ import annotations

import argparse
import os
import sys

from framework.checkpoint.export import ExportError, export_hf, run_config
from framework.checkpoint.export import __doc__ as export_doc


def run_tokenizer(cfg):
    """The tokenizer the run trained with, or None (one line) where its files are gone: the
    command runs long after the run, whose token shards may have moved."""
    from framework.data.tokenizer import data_tokenizer

    try:
        return data_tokenizer(cfg.data)
    except FileNotFoundError as err:
        print(f"export: no tokenizer written ({err})", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m framework.export", description=export_doc.split("\n")[0])
    p.add_argument("checkpoint", help="a step-NNNNNN checkpoint folder")
    p.add_argument("out", help="the folder to write")
    p.add_argument(
        "--format",
        default="hf",
        choices=["hf", "peft"],
        help="hf: config.json + model.safetensors (peft=lora: merged); peft: the adapters, PEFT's files",
    )
    p.add_argument("--config", default=None, help="the run's config.yaml (default: the run dir's .hydra/config.yaml)")
    a = p.parse_args(argv)
    if not os.path.isfile(os.path.join(a.checkpoint, ".metadata")):
        print(f"error: CHECKPOINT: {a.checkpoint} is not a complete checkpoint (no .metadata)", file=sys.stderr)
        return 2
    try:
        cfg = run_config(a.checkpoint, a.config)
        config_json = export_hf(cfg, a.checkpoint, a.out, a.format, None if a.format == "peft" else run_tokenizer(cfg))
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{a.out}: {written_kind(config_json, a.format)}")
    return 0


def written_kind(config_json: dict, fmt: str) -> str:
    """What the CLI wrote, as its reader knows it: transformers' architecture (or a PEFT adapter
    of one) and its shape, from the config.json written."""
    c = config_json
    arch = (c.get("architectures") or [c.get("model_type", "a model")])[0]
    shape = f"{c.get('num_hidden_layers')} layers, dim {c.get('hidden_size')}, vocabulary {c.get('vocab_size')}"
    if c.get("num_local_experts"):
        shape += f", {c['num_local_experts']} experts"
    return ("a PEFT LoRA adapter of Hugging Face " if fmt == "peft" else "Hugging Face ") + f"{arch} ({shape})"


if __name__ == "__main__":
    sys.exit(main())
