"""Long runs that stay healthy, each a callback in its own file (docs/health.md): loss spikes
(`callbacks.spike`), stragglers (`callbacks.straggler`), silent data corruption
(`callbacks.checksum`), and the goodput account every run keeps."""

from __future__ import annotations

import os


def is_run_checkpoint(checkpoint_root: str, path: str | None) -> bool:
    """A save into the run's own checkpoints (those a rollback can go back to): not a failed one
    (None), nor evaluation's best checkpoint (kept under `best/`)."""
    return path is not None and os.path.dirname(os.path.normpath(path)) == os.path.normpath(checkpoint_root)
