"""`python -m framework.evaluate RUN_DIR|CHECKPOINT [key=value ...]`: the held-out loss of a saved
checkpoint, under any layout (DCP reshards on load), written to `eval.json` and printed.
`python -m framework.evaluate key=value ...` (no checkpoint): the loss of a model before any
training here (`model=llama model.pretrained=DIR`, `model=hf ...`, a `_target_` model), its config
composed as train.py composes it, under any strategy; printed.

- RUN_DIR: its best checkpoint (checkpoint.monitor), else its newest; CHECKPOINT: that folder.
- The model and data are the run's (the config saved beside the checkpoints); overrides change
  them: `parallel.name=fsdp launch.nproc_per_node=2` evaluates under the launcher, like train.py
  (default: one process, parallel.name=none); `eval.steps=N` reads N batches per rank.
- Data: the run's validation split; or, with `data.path=FILE` (lm), the whole file as consecutive
  windows at 0, T, 2T, ... (inputs [i, i+T), targets [i+1, i+T+1), the last incomplete window
  dropped), and the loss is the mean over all predicted tokens: any other tool can reproduce it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.checkpoint import store as checkpoint
from framework.config import ConfigError, validate

ALL_BYTES = 1 << 62  # data.path given: read the whole file


def resolve_checkpoint(target: str) -> str:
    """A checkpoint folder, or a run directory's best (else newest) complete checkpoint."""
    if checkpoint.complete(target):
        return target
    root = os.path.join(target, "checkpoints")
    found = checkpoint.latest(checkpoint.best_root(root)) or checkpoint.latest(root)
    if found is None:
        raise ConfigError("checkpoint", f"{target!r} is neither a complete checkpoint nor a run directory with one")
    return found


def eval_config(path: str, overrides: list[str]) -> DictConfig:
    """The run's config for evaluating `path`: one process by default, nothing saved or logged."""
    saved = checkpoint.find_config(path)
    if saved is None:
        raise ConfigError("checkpoint", f"no {checkpoint.CONFIG_FILE} beside {path} (saved by runs since issue 21)")
    from framework.config.overrides import apply_overrides

    cfg = OmegaConf.create(saved)
    base = {"parallel": {"name": "none"}, "launch": {"nproc_per_node": 1}, "logger": {"name": "none"},
            "checkpoint": {"resume": None, "every": 0, "monitor": None, "export": False},
            "eval": {"every": 0, "at_start": False, "patience": 0}, "progress": False}  # fmt: skip
    cfg = OmegaConf.merge(cfg, base)
    if any(o.startswith("data.path=") for o in overrides):  # a file of its own, read whole
        cfg = OmegaConf.merge(cfg, {"data": {"val_fraction": 0.0, "val_path": None, "max_bytes": ALL_BYTES}})
    OmegaConf.set_struct(cfg, True)
    return apply_overrides(cfg, overrides)  # as train.py composes and checks them: one line naming the key


# what evaluating sets unless the overrides say otherwise: one process, nothing saved or logged
FRESH = {"parallel": "parallel=none", "launch.nproc_per_node": "launch.nproc_per_node=1", "logger": "logger=none",
         "checkpoint.every": "checkpoint.every=0", "checkpoint.export": "checkpoint.export=false",
         "progress": "progress=false"}  # fmt: skip


def fresh_config(overrides: list[str]) -> DictConfig:
    """The config of a model not trained here, composed as train.py composes it (and checked as
    it checks), one process by default, nothing saved or logged."""
    from framework.config.overrides import compose_checked

    given = {o.split("=", 1)[0].lstrip("+~") for o in overrides}
    cfg = compose_checked([v for k, v in FRESH.items() if k not in given] + overrides)
    if any(o.startswith("data.path=") for o in overrides):  # a file of its own, read whole
        OmegaConf.set_struct(cfg, False)
        cfg = OmegaConf.merge(cfg, {"data": {"val_fraction": 0.0, "val_path": None, "max_bytes": ALL_BYTES}})
    return cfg


def load_model(path: str, module) -> None:
    """The model weights of checkpoint `path` into `module` (any layout; the optimizer is not read)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from framework.dist import one_process_checkpoint_io

    state = get_model_state_dict(module)
    with one_process_checkpoint_io():
        dcp.load({"model": state}, checkpoint_id=path)
    set_model_state_dict(module, state)


def evaluate_rank(config: dict[str, Any], path: str | None, whole_file: bool) -> dict[str, Any]:
    """One rank: build the model as the run did, load the checkpoint's weights (none: the model's
    own, as built: pretrained or initialised), evaluate."""
    from framework.callbacks.evaluation import build_eval_data, evaluate
    from framework.config import resolve_backend, resolve_device
    from framework.data import build_dataset
    from framework.dist import destroy_distributed, init_distributed
    from framework.parallel.dims import Strategy
    from framework.run.build import build

    cfg = OmegaConf.create(config)
    backend = resolve_backend(cfg) if Strategy.of(cfg.parallel).needs_backend else None
    info = init_distributed(resolve_device(cfg), backend, cfg.backend.timeout_s, cfg.backend.init_method)
    try:
        setup = build(cfg, info)
        if path is not None:
            load_model(path, setup.par.module)
        dataset = build_dataset(cfg.data, cfg.seed, setup.task, "train") if whole_file else None
        result = evaluate(setup, build_eval_data(cfg, setup, info.device, dataset), info, cfg.eval.steps)
        return {**result, "task": setup.task}
    finally:
        destroy_distributed()


def run(target: str | None, overrides: list[str]) -> dict[str, Any]:
    """Evaluate; returns (and, for a checkpoint, writes to <target>/eval.json) the figures.
    target None: the model the overrides compose, before any training."""
    from framework.config import resolve_nproc
    from framework.dist import launched_as_worker

    path = resolve_checkpoint(target) if target is not None else None
    cfg = eval_config(path, overrides) if path is not None else fresh_config(overrides)
    validate(cfg)
    config = OmegaConf.to_container(cfg, resolve=True)
    whole_file = any(o.startswith("data.path=") for o in overrides)
    nproc = resolve_nproc(cfg)
    if launched_as_worker() or nproc == 1:
        result = evaluate_rank(config, path, whole_file)
    else:
        from framework.machine import launch_local

        result = launch_local(nproc, evaluate_rank, config, path, whole_file)[0]
    step = checkpoint.read_trainer_state(path).step if path is not None else 0
    data = f"data.path={cfg.data.path}" if whole_file else "the validation split"
    out = {**result, "checkpoint": path, "step": step, "data": data, "parallel": cfg.parallel.name}
    if int(os.environ.get("RANK", 0)) == 0:
        if target is not None:
            with open(os.path.join(target, "eval.json"), "w") as f:
                json.dump(out, f, indent=2)
        print_table(out)
    return out


def print_table(out: dict[str, Any]) -> None:
    unit = "tokens" if out["task"] == "lm" else "samples"
    model = f"{out['checkpoint']} (step {out['step']})" if out["checkpoint"] else "as built (no checkpoint)"
    rows = [("checkpoint", model), ("data", out["data"]),
            ("loss", f"{out['loss']:.6f}"), (unit, str(out["terms"]))]  # fmt: skip
    metric = "perplexity" if out["task"] == "lm" else "accuracy"
    rows.append((metric, f"{out[metric]:.4f}"))
    for name, value in rows:
        print(f"{name:<12}{value}")


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    target, overrides = (None, argv) if "=" in argv[0] and not os.path.exists(argv[0]) else (argv[0], argv[1:])
    try:
        run(target, overrides)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
