"""Checkpoints: everything a run needs to continue exactly where it stopped.

A checkpoint is one folder `step-NNNNNN` holding
- the model and optimizer state, written with torch.distributed.checkpoint (DCP): every rank
  writes its own shards in parallel, and DCP reshards on load, so a checkpoint saved under one
  strategy and world size loads under another (ddp at 2 ranks -> fsdp at 4);
- `trainer.json` (rank 0): the step, the LR schedule, the loss scaler, the data position (epoch,
  batches consumed, and the global batch it was counted in) and the layout it was saved under;
- `rng-rank<r>.pt` (every rank): that rank's random states (Python, torch CPU and CUDA, the
  device-side augmentation's generator).

Every rank writes its small files and its shards, then digests them (framework/checkpoint/integrity.py);
the coordinator writes `manifest.json` with every rank's entries, and DCP writes `.metadata` last:
a folder with `.metadata` is complete, and it verifies when its files match the manifest. A save
that fails (a full disk) removes its partial folder (it holds the space the next attempt needs;
without `.metadata` it is never taken for a checkpoint, should the process die before) and names a
full disk as one; a save that would not fit is refused before it writes (framework/checkpoint/space.py).
Loading reads tensors, JSON and plain numbers only (`weights_only`, and `.metadata` through an
unpickler that knows DCP's metadata classes only); nothing arbitrary is unpickled.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import sys
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from framework.checkpoint import space
from framework.checkpoint.integrity import CheckpointError

TRAINER_FILE = "trainer.json"
STEP_DIR = re.compile(r"step-\d+$")


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


def complete(path: str) -> bool:
    return os.path.exists(os.path.join(path, ".metadata")) and os.path.exists(os.path.join(path, TRAINER_FILE))


def checkpoints(root: str) -> list[str]:
    """The complete checkpoints under `root`, oldest first."""
    return [path for path in step_folders(root) if complete(path)]


def step_folders(root: str) -> list[str]:
    """Every `step-N` folder under `root`, complete or not, oldest first."""
    if not os.path.isdir(root):
        return []
    names = [d for d in os.listdir(root) if STEP_DIR.match(d)]
    return [os.path.join(root, d) for d in sorted(names, key=step_of)]


def step_of(path: str) -> int:
    """The step a `step-N` folder holds (numeric order: `step-1000000` is newer than `step-999500`)."""
    return int(os.path.basename(os.path.normpath(path)).rpartition("-")[2])


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
    data: dict[str, Any]  # {"epoch", "samples" (of the epoch's order read, all ranks), "size"}
    layout: dict[str, Any]  # {"parallel", "world_size", "dp_size"}: what the RNG files belong to
    counters: dict[str, Any] = field(default_factory=dict)  # e.g. nonfinite steps skipped so far


def move_aside(path: str) -> str:
    """Rename an earlier attempt's folder at `path` (a checkpoint that did not verify, a failed
    save) to `superseded-<name>[-k]`, kept for inspection: a new save never overwrites it."""
    root, name = os.path.split(path)
    target, k = os.path.join(root, f"superseded-{name}"), 1
    while os.path.exists(target):
        k += 1
        target = os.path.join(root, f"superseded-{name}-{k}")
    os.rename(path, target)
    return target


class Checkpointer:
    """Saves one rank's part of every checkpoint; `options` is the config's `checkpoint` node
    (keep_last, async_save, verify, on_error). `async_save` writes the model and optimizer in a
    background thread (DCP's async_save, over a gloo group of its own so its collectives never
    interleave with training's) while training goes on. A failed save stops the run with a
    CheckpointError (on_error=stop), or (warn) prints one line and the next save tries again."""

    def __init__(self, root: str, rank: int, options: Any):
        self.root, self.rank = root, rank
        self.keep_last, self.async_save = options.keep_last, options.async_save
        self.digests, self.on_error = options.verify == "full", options.on_error
        self.pending: Future | None = None
        self.pending_path = ""
        self.failed = 0  # saves that failed (on_error=warn)
        self.need, self.measured = 0, False  # what a checkpoint takes; measured: the last complete one's size
        self._group = None
        if self.async_save and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")  # collective: every rank builds it

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState,
        generators: dict[str, torch.Generator],
    ) -> str | None:  # fmt: skip
        """Save after `step` optimizer steps (collective: every rank calls it). Returns the
        folder, or None when the save failed under on_error=warn (async: when the previous did)."""
        ok = self.wait()  # one save in flight at a time; the previous one is complete after this
        path = step_dir(self.root, step)
        if self.rank == 0 and os.path.exists(path):
            print(f"checkpoint: {path} is left from an earlier attempt; kept as {move_aside(path)}", flush=True)
        if dist.is_initialized():  # no rank begins the folder before rank 0 has looked (and moved aside);
            dist.barrier()  # fits() below is a collective too, but that is a check of its own, not this order
        buffer = io.BytesIO()
        torch.save(rng_state(generators), buffer)
        small = {rng_file(self.rank): buffer.getvalue()}
        if self.rank == 0:
            small[TRAINER_FILE] = json.dumps(state.__dict__, indent=2).encode()
        import torch.distributed.checkpoint as dcp  # here: a run that never saves never imports it

        from framework.checkpoint.io import VerifiedWriter
        from framework.checkpoint.optim_state import state_dicts

        model_sd, optim_sd = state_dicts(model, optimizer)
        if not self.fits(model_sd, optim_sd):  # refused before it writes: nothing to clean up
            full = space.no_space(self.root, self.need, self.measured)
            return self._failed(path, CheckpointError(f"checkpoint {path} not saved: {full}"))
        writer = VerifiedWriter(path, small, self.digests)
        tensors = {"model": model_sd, "optim": optim_sd}
        try:
            if self.async_save:
                self.pending, self.pending_path = dcp.async_save(tensors, storage_writer=writer,
                                                                 process_group=self._group), path  # fmt: skip
                return path if ok else None
            dcp.save(tensors, storage_writer=writer)
        except (Exception, dcp.api.CheckpointException) as err:
            return self._failed(path, err)
        self._prune()
        return path

    def wait(self) -> bool:
        """Block until the save in flight (async) is on disk, then prune older checkpoints.
        False when it failed (on_error=warn)."""
        if self.pending is None:
            return True
        from torch.distributed.checkpoint.api import CheckpointException

        pending, self.pending = self.pending, None
        try:
            pending.result()
        except (Exception, CheckpointException) as err:
            self._failed(self.pending_path, err)
            return False
        self._prune()
        return True

    def fits(self, model_sd: dict, optim_sd: dict) -> bool:
        """Whether one more checkpoint fits the free space (the newest complete one's size, else the
        state's bytes): rank 0's verdict, every rank's (collective), so they skip a save together."""
        last = latest(self.root)
        self.need, self.measured = (
            (space.folder_bytes(last), True) if last else (space.state_bytes([model_sd, optim_sd]), False)
        )
        verdict = [space.free_bytes(self.root) >= self.need]
        if dist.is_initialized():
            dist.broadcast_object_list(verdict, src=0)
        return bool(verdict[0])

    def _failed(self, path: str, err: BaseException) -> None:
        """Stop (on_error=stop) or warn about a failed save; what it wrote is removed first (rank 0:
        every rank's write is over once DCP reports the failure), the space it held given back."""
        error = err
        if not isinstance(err, CheckpointError):
            full = space.is_full(space.causes_of(err), path, self.need)
            if self.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            error = CheckpointError(
                space.failure(path, err, full and space.no_space(self.root, self.need, self.measured))
            )
        if self.on_error == "stop":
            raise error from None
        self.failed += 1
        if self.rank == 0:
            print(f"warning: {error} (checkpoint.on_error=warn: training goes on; the next save tries again; "
                  f"newest complete checkpoint: {latest(self.root) or 'none'})", file=sys.stderr, flush=True)  # fmt: skip
        return None

    def _prune(self) -> None:
        if self.rank == 0:  # after a complete save only: a failed one never costs the last good one
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
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, ties: dict[str, str] | None = None
) -> tuple[TrainerState, dict[str, torch.Tensor] | None]:
    """Load `path` into model and optimizer in place (resharding as needed). Returns the trainer
    state and this rank's saved random states (None when the checkpoint has none for this rank).
    Tensors, plain values and DCP's metadata only: nothing else is unpickled. `ties` (alias ->
    source): a layout that holds a tie twice (a pipeline) loads a copy the checkpoint does not
    have (a one-process save keeps one optimizer state for the tied parameter) from its source's."""
    import torch.distributed.checkpoint as dcp

    from framework.checkpoint.io import SafeLoadPlanner, SafeReader, read_metadata
    from framework.checkpoint.optim_state import borrow_tied_state, load_state_dicts, return_tied_state, state_dicts

    model_sd, optim_sd = state_dicts(model, optimizer)
    tensors = {"model": model_sd, "optim": optim_sd}
    saved = read_metadata(path).state_dict_metadata if ties else {}
    borrowed = borrow_tied_state(optim_sd, ties or {}, saved)
    dcp.load(tensors, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
    return_tied_state(optim_sd, borrowed)
    load_state_dicts(model, optimizer, tensors["model"], tensors["optim"])
    rng_path = os.path.join(path, rng_file(rank))
    rng = torch.load(rng_path, weights_only=True) if os.path.exists(rng_path) else None
    return read_trainer_state(path), rng


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
    try:
        with open(tmp, "w") as f:
            json.dump(config, f, indent=2)
        os.replace(tmp, os.path.join(root, CONFIG_FILE))
    except OSError as err:  # a full disk: no half-written tmp left holding space
        if os.path.exists(tmp):
            os.remove(tmp)
        reason = f"no space left on {root}" if err.errno in space.FULL else err.strerror or str(err)
        raise OSError(err.errno, f"writing {os.path.join(root, CONFIG_FILE)} failed: {reason}") from None


def find_config(path: str) -> dict[str, Any] | None:
    """The config saved beside checkpoint `path` (its root, or the root above `best/`), else None."""
    for folder in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        candidate = os.path.join(folder, CONFIG_FILE)
        if os.path.exists(candidate):
            with open(candidate) as f:
                return json.load(f)
    return None
