"""The `callbacks` entries, checked before any worker starts: each names a class that imports and
defines at least one hook, takes the arguments given beside its `_target_`, and declares its
figures (framework/figures.py) once, with a known reduce."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf

from framework.config.errors import ConfigError
from framework.figures import FigureError, Registry
from framework.hooks import HOOKS, declared_figures, defined_hooks

# the framework's own callbacks' names (framework/callbacks/build.py): a user's entry takes another
OWN_NAMES = ("model", "mixture", "nonfinite", "eval", "profiler", "progress", "loggers")


def check_callbacks(cfg: DictConfig) -> None:
    entries = cfg.get("callbacks") or {}
    figures = Registry()
    for name, entry in entries.items():
        if entry is None:  # ~callbacks.mine or callbacks.mine=null: switched off
            continue
        key = f"callbacks.{name}"
        if name in OWN_NAMES:
            raise ConfigError(key, f"{name!r} is one of the framework's own callbacks ({', '.join(OWN_NAMES)}); "
                              "name yours otherwise")  # fmt: skip
        if not isinstance(entry, Mapping) or not entry.get("_target_"):
            raise ConfigError(f"{key}._target_", "not set; a callback is a class: +callbacks.NAME._target_=pkg.Class")
        cls = _class(entry["_target_"], f"{key}._target_")
        if not defined_hooks(cls):
            raise ConfigError(f"{key}._target_", f"{entry['_target_']} defines no hook; a callback defines at least "
                              f"one of {', '.join(HOOKS)} (docs/callbacks.md)")  # fmt: skip
        _check_arguments(cls, entry, key)
        for spec in declared_figures(cls):
            try:
                figures.declare(spec, key)
            except FigureError as err:
                raise ConfigError(f"{key}.figures", str(err)) from None


def _class(target: str, key: str) -> type:
    try:
        cls = get_class(target)
    except Exception as err:  # noqa: BLE001 - any import failure is the same bad input
        cause = err.__cause__ or err
        raise ConfigError(key, f"{target!r} does not import: {type(cause).__name__}: "
                          f"{(str(cause).splitlines() or [''])[0]}") from None  # fmt: skip
    return cls


def _check_arguments(cls: type, entry: Mapping, key: str) -> None:
    """The entry's other keys are the class's constructor arguments."""
    kwargs = {k: v for k, v in OmegaConf.to_container(OmegaConf.create(dict(entry))).items() if not k.startswith("_")}
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as err:
        raise ConfigError(key, f"{cls.__name__}{inspect.signature(cls)}: {err}") from None
