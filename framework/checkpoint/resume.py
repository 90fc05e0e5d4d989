"""Which checkpoint a run continues from, verified before a byte of it is loaded.

- `checkpoint.resume=PATH`: PATH, which must verify; if it does not, the run stops with one line
  naming the file and why. Nothing is changed on disk.
- `checkpoint.resume=auto`, and every elastic restart (a worker died, launch.max_restarts): the
  newest checkpoint of the run that verifies; each newer one is skipped with one line naming its
  file and why (missing, size, digest, unreadable). The skipped folders are left as they are
  (a later save at the same step moves such a folder aside, framework/checkpoint/store.py). If only
  unfinished saves are there, the run starts fresh; if complete checkpoints are there and none
  verifies, it stops rather than start over on top of them.

Every rank verifies its share of the files (framework/checkpoint/integrity.py) and the verdicts are
gathered, so all ranks pick the same checkpoint.
"""

from __future__ import annotations

import os
import time

from omegaconf import DictConfig

from framework.checkpoint import store as checkpoint
from framework.checkpoint.integrity import CheckpointError, verify_share
from framework.dist import DistInfo, all_gather_object, restart_count


def verify(path: str, mode: str, info: DistInfo) -> str | None:
    """The first problem of checkpoint `path` over all ranks' shares, the same on every rank."""
    problem = verify_share(path, mode, (info.rank, info.world_size))
    if problem is None and mode != "off" and info.rank == 0:
        try:  # `.metadata` comes after the manifest, so it is checked by reading it (safely)
            from framework.checkpoint.io import read_metadata

            read_metadata(path)
        except Exception as err:
            problem = f"{os.path.join(path, '.metadata')}: unreadable ({type(err).__name__}: {err})"
    problems = [p for p in all_gather_object(problem, info) if p is not None]
    return min(problems) if problems else None


def choose(cfg: DictConfig, root: str, info: DistInfo) -> tuple[str | None, float]:
    """(the checkpoint to start from, or None: a fresh start; seconds spent verifying)."""
    t0, mode, resume = time.perf_counter(), cfg.checkpoint.verify, cfg.checkpoint.resume
    if resume == "best":  # checkpoint.monitor's best (launch checked that one exists)
        resume = checkpoint.latest(checkpoint.best_root(root))
    if resume not in (None, "auto") and restart_count() > 0 and checkpoint.checkpoints(root):
        resume = "auto"  # an elastic restart continues from this run's newest save, not from where it began
    if resume not in (None, "auto"):
        problem = verify(resume, mode, info)
        if problem is not None:
            raise CheckpointError(
                f"checkpoint.resume={resume} does not verify: {problem} (checkpoint.verify={mode}; "
                "nothing was changed: resume=auto takes the newest checkpoint that verifies)"
            )
        return resume, time.perf_counter() - t0
    if resume != "auto" and restart_count() == 0:
        return None, 0.0
    folders = all_gather_object(checkpoint.step_folders(root), info)[0]  # rank 0's listing, for all
    found = 0
    for path in reversed(folders):
        problem = verify(path, mode, info)
        if problem is None:
            return path, time.perf_counter() - t0
        found += checkpoint.complete(path)
        if info.is_main:
            print(f"checkpoint.resume=auto: skipping {path}: {problem}", flush=True)
    if found:
        raise CheckpointError(
            f"checkpoint.resume=auto: none of the {found} checkpoints under {root} verifies (each is named "
            "above); they are left as they are: move them aside to start fresh, or checkpoint.verify=off to load anyway"
        )
    if info.is_main and resume == "auto":  # a run that meant to continue hears that it does not
        print(fresh_start_line(root), flush=True)
    return None, time.perf_counter() - t0


def fresh_start_line(root: str) -> str:
    """What `checkpoint.resume=auto` says when the run has no checkpoint yet."""
    return (
        f"checkpoint.resume=auto: no checkpoint under {root}; starting fresh "
        "(to continue a run, pass its folder: hydra.run.dir=<run dir>)"
    )
