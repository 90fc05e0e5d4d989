"""The `callbacks` entries, checked before any worker starts: each names a class that imports and
defines at least one hook, takes the arguments given beside its `_target_`, and declares its
figures (framework/figures.py) once, with a known reduce."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping

from omegaconf import DictConfig, OmegaConf

from framework.components import nearest
from framework.config.errors import ConfigError

# the framework's own callbacks' names (framework/callbacks/build.py): a user's entry takes another
OWN_NAMES = ("model", "mixture", "nonfinite", "eval", "goodput", "profiler", "progress", "loggers")


def check_callbacks(cfg: DictConfig) -> None:
    from framework.figures import FigureError, Registry  # torch: composing a config imports none
    from framework.hooks import HOOKS, declared_figures, defined_hooks

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
        if hasattr(cls, "check_config"):  # the callback's own check of its arguments against the run's config
            cls.check_config(cfg, key, OmegaConf.to_container(OmegaConf.create(dict(entry)), resolve=True))
        for spec in declared_figures(cls):
            try:
                figures.declare(spec, key)
            except FigureError as err:
                raise ConfigError(f"{key}.figures", str(err)) from None


def _class(target: str, key: str) -> type:
    """The class `target` names ("pkg.module.Class"), imported as Python would: its module, then
    the name in it (each failure said as what is missing)."""
    module_name, _, name = target.rpartition(".")
    try:
        module = importlib.import_module(module_name) if module_name else None
    except Exception as err:  # noqa: BLE001 - any failure to import is the same bad input
        raise ConfigError(key, f"{target!r} does not import: module {module_name!r}: {type(err).__name__}: "
                          f"{(str(err).splitlines() or [''])[0]}") from None  # fmt: skip
    cls = getattr(module, name, None) if module is not None else None
    if not isinstance(cls, type):
        where = f"module {module_name!r} has no class {name!r}" if module is not None else "not a dotted path"
        raise ConfigError(key, f"{target!r} does not import: {where} (a callback is pkg.module.Class)")
    return cls


def _check_arguments(cls: type, entry: Mapping, key: str) -> None:
    """The entry's other keys are the class's constructor arguments: each one it takes, each one it
    needs given."""
    kwargs = {k: v for k, v in OmegaConf.to_container(OmegaConf.create(dict(entry))).items() if not k.startswith("_")}
    params = inspect.signature(cls).parameters
    takes = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        for arg in kwargs:
            if arg not in takes:
                hint = f"did you mean {near!r}? " if (near := nearest(arg, takes)) else ""
                what = f"it takes: {', '.join(takes)}" if takes else "it takes no arguments"
                raise ConfigError(f"{key}.{arg}", f"{cls.__name__} takes no argument {arg!r}; {hint}{what}")
    for arg in takes:
        if params[arg].default is inspect.Parameter.empty and arg not in kwargs:
            raise ConfigError(f"{key}.{arg}", f"not set; {cls.__name__} needs it: +{key}.{arg}=...")
