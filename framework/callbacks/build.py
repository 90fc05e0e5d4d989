"""The run's callbacks, built in one place: the framework's own, chosen by the config they have
always had (eval.*, nonfinite, progress, profile, logger, data.sources) and goodput, then the
`callbacks` entries: the health callbacks conf/config.yaml lists (spike, straggler, checksum: off
until set) and the user's (`+callbacks.mine._target_=pkg.Mine`, with their arguments beside it),
each instantiated once, in the order given. The loggers come last, so that the summary they upload
holds what every other callback added to it."""

from __future__ import annotations

from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from framework.callbacks.evaluation import Evaluation
from framework.callbacks.health.goodput import Goodput
from framework.callbacks.loggers import Loggers
from framework.callbacks.mixture import MixtureSources
from framework.callbacks.model import ModelSteps
from framework.callbacks.nonfinite import NonFiniteCheck
from framework.callbacks.profiler import Profiler
from framework.callbacks.progress import ProgressBar
from framework.config.callback_checks import OWN_NAMES
from framework.dist import DistInfo
from framework.hooks import Callbacks
from framework.tracking import build_tracker


def own_callbacks(cfg: DictConfig, is_main: bool) -> list[tuple[str, Any]]:
    """The framework's callbacks this config asks for, by name (a user's entry of the same name
    is refused by the config check)."""
    named: list[tuple[str, Any]] = [("model", ModelSteps())]
    if cfg.data.get("sources"):
        named.append(("mixture", MixtureSources()))
    if cfg.nonfinite == "stop":
        named.append(("nonfinite", NonFiniteCheck()))
    named.append(("eval", Evaluation()))
    named.append(("goodput", Goodput()))
    if cfg.profile:
        named.append(("profiler", Profiler()))
    if cfg.progress and is_main:
        named.append(("progress", ProgressBar()))
    return named


def user_callbacks(cfg: DictConfig) -> list[tuple[str, Any]]:
    """The `callbacks` entries, instantiated (framework.config.callback_checks checked them). One
    whose instance says `active = False` (the health callbacks switched off, as conf/config.yaml
    has them) is left out: a callback that is off costs no call."""
    entries = cfg.get("callbacks") or {}
    built = [(name, instantiate(entry)) for name, entry in entries.items() if entry is not None]
    return [(name, callback) for name, callback in built if getattr(callback, "active", True)]


def build_callbacks(cfg: DictConfig, info: DistInfo, run_dir: str, choices: dict[str, str]) -> Callbacks:
    """Every callback of this rank's run, and the figures they declare up front. The trackers
    start last, and are finished (as failed) should the rest fail to build."""
    named = [*own_callbacks(cfg, info.is_main), *user_callbacks(cfg)]
    tracker = build_tracker(cfg.logger, OmegaConf.to_container(cfg), run_dir, choices, info.is_main)
    try:
        return Callbacks([*named, ("loggers", Loggers(tracker))], info.world_size, own=OWN_NAMES)
    except BaseException:
        tracker.finish(ok=False)
        raise
