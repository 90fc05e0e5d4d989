"""A refused run leaves no folder behind: `NewRunFolder` (a Hydra callback, conf/config.yaml) notes
which folders of `hydra.run.dir` are missing before Hydra creates them and writes `.hydra/` into
the run folder; `discard_refused` removes them again when the config is refused (exit 2), so an
`error:` line leaves no empty `outputs/<date>/<time>/` holding only the composed config and the lock.
A folder that held anything before this invocation is never removed."""

from __future__ import annotations

import os
import shutil

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from framework.checkpoint.runlock import LOCK_FILE, RunLock

_created: list[str] = []  # the run folder and its parents this invocation creates, deepest first
_OURS = {".hydra", LOCK_FILE}  # what a refused run has written by then


class NewRunFolder(Callback):
    """Before a single run (not a sweep: its failed jobs keep their summary): what does not exist yet."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _created.clear()
        try:
            path = os.path.abspath(str(OmegaConf.select(config, "hydra.run.dir")))
        except Exception:  # noqa: BLE001 - a folder named by what resolves only later: nothing is removed
            return
        while path and not os.path.exists(path):
            _created.append(path)
            path = os.path.dirname(path)


def discard_refused(run_dir: str, lock: RunLock | None) -> None:
    """Release the lock, then remove the run folder a refused config made (it holds only `.hydra/`
    and `run.lock`) and the parents made with it that are empty now; nothing that existed before.
    No lock: the folder is another live run's (FolderInUse), and nothing is touched."""
    if lock is None:
        return
    lock.release()
    run_dir = os.path.abspath(run_dir)
    if not _created or _created[0] != run_dir or not set(os.listdir(run_dir)) <= _OURS:
        return
    shutil.rmtree(run_dir, ignore_errors=True)
    for parent in _created[1:]:
        try:
            os.rmdir(parent)  # only when empty: another run may have made its folder there since
        except OSError:
            return
