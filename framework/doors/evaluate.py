"""`python -m framework.evaluate RUN_DIR|CHECKPOINT [key=value ...]`: the held-out loss of a saved
checkpoint, under any layout (DCP reshards on load), written to `eval.json` and printed.
`python -m framework.evaluate key=value ...` (no checkpoint): the loss of a model before any
training here (`model=llama model.pretrained=DIR`, `model=hf model.pretrained=DIR`, a `_target_`
model), its config composed as train.py composes it, under any strategy; printed.

- The input is read as every door reads it (framework/config/door.py): RUN_DIR's best checkpoint
  (checkpoint.monitor), else its newest; CHECKPOINT that folder; its model and data the run's (the
  config saved beside the checkpoints), the overrides on top, checked as train.py checks them:
  `parallel=fsdp launch.nproc_per_node=2` evaluates under the launcher, as train.py launches it
  (any strategy but none, one process too; default: one process, parallel=none); `eval.steps=N`
  reads N batches per rank.
- Data, any data choice: its validation split (data.val_fraction, data.val_path, the shards'
  val split; data=chat, data=hf and a `_target_` dataset: all of it unless data.val_fraction holds
  some out); where there is none, one line naming the keys that make one. Under data=text,
  `data.path=FILE` is the whole file as consecutive windows at 0, T, 2T, ... (inputs [i, i+T),
  targets [i+1, i+T+1), the last incomplete window dropped), and the loss is the mean over all
  predicted tokens: any other tool can reproduce it.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from omegaconf import OmegaConf

from framework.checkpoint import store as checkpoint
from framework.config import ConfigError
from framework.config.door import check_validation_split, resolve_input, split_target


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
        setup = build(cfg, info, train_data=False)
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
    from framework.parallel.dims import Strategy

    door = resolve_input(target, overrides)  # composed, checked and resolved: one line for what it refuses
    if not door.whole_file:
        check_validation_split(door.cfg)
    cfg, path = door.cfg, door.checkpoint
    config = OmegaConf.to_container(cfg)
    if launched_as_worker() or Strategy.of(cfg.parallel).one_process:  # as train.py: a process group is launched
        result = evaluate_rank(config, path, door.whole_file)
    else:
        from framework.machine import launch_local

        result = launch_local(resolve_nproc(cfg), evaluate_rank, config, path, door.whole_file)[0]
    step = checkpoint.read_trainer_state(path).step if path is not None else 0
    data = f"data.path={cfg.data.path}" if door.whole_file else "the validation split"
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
    try:
        run(*split_target(argv))
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
