"""`python -m framework.export CHECKPOINT|RUN_DIR OUT [key=value ...] [--format hf|peft] [--config RUN_CONFIG]`:
the command line of framework/checkpoint/export.py (what is written, and how, is told there).

The input is what every door reads (framework/config/door.py): a checkpoint folder, or a run
folder's best (else newest) checkpoint, with the config saved beside it (`--config`: a run's
config.yaml in its place; a run that saved none: its `.hydra/config.yaml`) and train.py's
overrides on top, checked as train.py checks them before anything is written: a bad one is one
line naming the key, exit 2. Export reads the checkpoint on the CPU, one tensor at a time, so the
run's device, backend, memory levers and callbacks are not its (`EXPORT_DEFAULTS`, unless
overridden), and it reads no data: the data's files are not checked (they may have moved since the
run). The door reads the run's tokenizer (the data's, as generate reads it; gone, the export goes on
without one) and hands config and tokenizer to the library, which imports neither the data nor any model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from framework.checkpoint.export import ExportError, export_hf
from framework.checkpoint.export import __doc__ as export_doc
from framework.checkpoint.store import CONFIG_FILE, find_config
from framework.config.door import keys_of, resolve_checkpoint, resolve_input
from framework.config.errors import ConfigError

# what export sets unless the overrides say otherwise: the run's placement is not export's
# nor its callbacks (a user's package need not be installed where the export runs)
EXPORT_DEFAULTS = {"device": "cpu", "backend": "gloo", "memory": "none", "callbacks": "none"}


def run_tokenizer(cfg):
    """The tokenizer the run trained with, or None (one line) where its files are gone: the
    command runs long after the run, whose token shards may have moved."""
    from framework.data.tokenizer import data_tokenizer

    try:
        return data_tokenizer(cfg.data)
    except FileNotFoundError as err:
        print(f"export: no tokenizer written ({err})", file=sys.stderr)
        return None


def config_file_of(checkpoint: str, given: str | None) -> str | None:
    """`--config`, else None where a config is saved beside the checkpoint, else the run's
    `.hydra/config.yaml` above it (runs before the saved config); with none, one line saying to pass one."""
    if given is not None or find_config(checkpoint) is not None:
        return given
    for parent in Path(checkpoint).resolve().parents[:3]:
        if (parent / ".hydra" / "config.yaml").is_file():
            return str(parent / ".hydra" / "config.yaml")
    raise ConfigError("checkpoint", f"no run config beside {checkpoint} ({CONFIG_FILE}) nor a .hydra/config.yaml "
                      "above it; pass --config RUN_CONFIG (the run's config.yaml)")  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m framework.export", description=export_doc.split("\n")[0])
    p.add_argument("target", metavar="CHECKPOINT|RUN_DIR", help="a step-NNNNNN checkpoint folder, or a run folder")
    p.add_argument("out", help="the folder to write")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="train.py's overrides on the run's config")
    p.add_argument(
        "--format",
        default="hf",
        choices=["hf", "peft"],
        help="hf: config.json + model.safetensors (peft=lora: merged); peft: the adapters, PEFT's files",
    )
    p.add_argument(
        "--config", default=None, help="the run's config.yaml (default: the one saved beside the checkpoints)"
    )
    return p.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    given = keys_of(a.overrides)
    defaults = [f"{key}={value}" for key, value in EXPORT_DEFAULTS.items() if key not in given]
    try:
        checkpoint = resolve_checkpoint(a.target)
        door = resolve_input(
            checkpoint, [*defaults, *a.overrides], config_file_of(checkpoint, a.config), reads_data=False
        )
        tokenizer = None if a.format == "peft" else run_tokenizer(door.cfg)
        config_json = export_hf(door.cfg, checkpoint, a.out, a.format, tokenizer)
    except (ConfigError, ExportError) as err:
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
