"""Checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is one folder `step-NNNNNN` holding
- the model and optimizer state, written with torch.distributed.checkpoint (DCP): every rank
  writes its own shards in parallel, and DCP reshards on load, so a checkpoint saved under one
  strategy and world size loads under another (ddp at 2 ranks -> fsdp at 4);
- `trainer.json` (rank 0): the step, the LR schedule, the loss scaler, the data position (epoch,
  batches consumed, and the global batch it was counted in) and the layout it was saved under;
- `rng-rank<r>.pt` (every rank): that rank's random states (Python, torch CPU and CUDA, the
  device-side augmentation's generator).

The small files are written before DCP's `.metadata`, which DCP writes last: a folder with
`.metadata` is complete. Loading reads tensors, JSON and plain numbers only (`weights_only`);
nothing arbitrary is unpickled.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

TRAINER_FILE = "trainer.json"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


def complete(path: str) -> bool:
    return os.path.exists(os.path.join(path, ".metadata")) and os.path.exists(os.path.join(path, TRAINER_FILE))


def checkpoints(root: str) -> list[str]:
    """The complete checkpoints under `root`, oldest first."""
    if not os.path.isdir(root):
        return []
    names = sorted(d for d in os.listdir(root) if d.startswith("step-"))
    return [os.path.join(root, d) for d in names if complete(os.path.join(root, d))]


def latest(root: str) -> str | None:
    """The newest complete checkpoint under `root`, or None."""
    done = checkpoints(root)
    return done[-1] if done else None


def prune(root: str, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (rank 0 calls it, only after the
    newest is complete); incomplete folders are left alone (one may be being written)."""
    if keep_last > 0:
        for path in checkpoints(root)[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- random states


def rng_state(extra_generators: dict[str, torch.Generator]) -> dict[str, torch.Tensor]:
    version, internal, gauss = random.getstate()
    state = {
        "python": torch.tensor([version, *internal], dtype=torch.int64),
        "python_gauss": torch.tensor([float("nan") if gauss is None else gauss], dtype=torch.float64),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    for name, generator in extra_generators.items():
        state[f"gen.{name}"] = generator.get_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor], extra_generators: dict[str, torch.Generator]) -> None:
    values = state["python"].tolist()
    gauss = float(state["python_gauss"][0])
    random.setstate((values[0], tuple(values[1:]), None if gauss != gauss else gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    for name, generator in extra_generators.items():
        generator.set_state(state[f"gen.{name}"])


# ----------------------------------------------------------------------------- save and load


@dataclass
class TrainerState:
    """What is saved besides the model and optimizer (trainer.json, plus per-rank RNG files)."""

    step: int
    scheduler: dict[str, Any]
    scaler: dict[str, Any]
    data: dict[str, Any]  # {"epoch", "offset" (batches per rank consumed this epoch), "global_batch"}
    layout: dict[str, Any]  # {"parallel", "world_size", "dp_size"}: what the RNG files belong to
    counters: dict[str, Any] = field(default_factory=dict)  # e.g. nonfinite steps skipped so far


class Checkpointer:
    """Saves and loads one rank's part of every checkpoint; `async_save` writes the model and
    optimizer in a background thread (DCP's async_save, over a gloo group of its own so its
    collectives never interleave with training's) while training goes on."""

    def __init__(self, root: str, rank: int, keep_last: int = 0, async_save: bool = False):
        self.root, self.rank, self.keep_last, self.async_save = root, rank, keep_last, async_save
        self.pending: Future | None = None
        self._group = None
        if async_save and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # collective: every rank builds it

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState,
        generators: dict[str, torch.Generator],
    ) -> str:  # fmt: skip
        """Save after `step` optimizer steps (collective: every rank calls it). Returns the folder."""
        self.wait()  # one save in flight at a time; the previous one is complete after this
        path = step_dir(self.root, step)
        os.makedirs(path, exist_ok=True)
        torch.save(rng_state(generators), os.path.join(path, rng_file(self.rank)))
        if self.rank == 0:
            with open(os.path.join(path, TRAINER_FILE), "w") as f:
                json.dump(state.__dict__, f, indent=2)
        import torch.distributed.checkpoint as dcp  # here: a run that never saves never imports it
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, optimizer)
        tensors = {"model": model_sd, "optim": optim_sd}
        if self.async_save:
            self.pending = dcp.async_save(tensors, checkpoint_id=path, process_group=self._group)
        else:
            dcp.save(tensors, checkpoint_id=path)
            self._prune()
        return path

    def wait(self) -> None:
        """Block until the save in flight (async) is on disk, then prune older checkpoints."""
        if self.pending is not None:
            self.pending.result()
            self.pending = None
            self._prune()

    def _prune(self) -> None:
        if self.rank == 0:
            prune(self.root, self.keep_last)

    def close(self) -> None:
        self.wait()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


def read_trainer_state(path: str) -> TrainerState:
    with open(os.path.join(path, TRAINER_FILE)) as f:
        return TrainerState(**json.load(f))


def load(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int
) -> tuple[TrainerState, dict[str, torch.Tensor] | None]:
    """Load `path` into model and optimizer in place (resharding as needed). Returns the trainer
    state and this rank's saved random states (None when the checkpoint has none for this rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    tensors = {"model": model_sd, "optim": optim_sd}
    dcp.load(tensors, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=tensors["model"], optim_state_dict=tensors["optim"])
    rng_path = os.path.join(path, rng_file(rank))
    rng = torch.load(rng_path, weights_only=True) if os.path.exists(rng_path) else None
    return read_trainer_state(path), rng


def full_model_state_dict(par) -> dict[str, torch.Tensor]:
    """The whole, unsharded model state on every rank, under the plain model's names (no wrapper
    prefixes): FSDP/TP shards gathered, pipeline stages merged. Collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(par.module, options=StateDictOptions(full_state_dict=True))
    state = {k: v.detach().cpu() for k, v in state.items()}
    if par.pp_group is not None:  # each stage holds some layers: merge them
        parts: list = [None] * dist.get_world_size(par.pp_group)
        dist.all_gather_object(parts, state, group=par.pp_group)
        state = {k: v for part in parts for k, v in part.items()}
    return state


def export(path: str, par, is_main: bool) -> None:
    """Write the full model state dict for use outside this framework (`torch.load(path,
    weights_only=True)` into the plain model). Rank 0 writes."""
    state = full_model_state_dict(par)
    if is_main:
        torch.save(state, path)


# ----------------------------------------------------------------------------- the best checkpoint, the config

CONFIG_FILE = "config.json"  # the run's resolved config, beside its checkpoints


def best_root(root: str) -> str:
    """Where checkpoint.monitor keeps the best evaluation's checkpoint (one `step-NNNNNN` folder)."""
    return os.path.join(root, "best")


def write_config(root: str, config: dict[str, Any]) -> None:
    """The resolved config beside the checkpoints (rank 0), so that a checkpoint alone says how to
    build its model: `framework.evaluate` and `framework.generate` read it back."""
    os.makedirs(root, exist_ok=True)
    tmp = os.path.join(root, f"{CONFIG_FILE}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(config, f, indent=2)
    os.replace(tmp, os.path.join(root, CONFIG_FILE))


def find_config(path: str) -> dict[str, Any] | None:
    """The config saved beside checkpoint `path` (its root, or the root above `best/`), else None."""
    for folder in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        candidate = os.path.join(folder, CONFIG_FILE)
        if os.path.exists(candidate):
            with open(candidate) as f:
                return json.load(f)
    return None
