"""The component protocol: a choice a run is made of (its optimizer, its LR schedule) is a class
named by `_target_` in its group's config, its keyword arguments beside it: the form
lightning-hydra-template's files take,

    _target_: torch.optim.AdamW     # a torch class, the framework's own or a user's package's
    _partial_: true                 # the framework passes what only a run has (the parameters)
    lr: 1e-3

The framework's own choices are files of this form in conf/, so a copy of one is a working start.
A group may keep settings of the run beside the kwargs (`optim.grad_clip`): its `own` keys, read by
the framework and never passed to the class.

What the framework asks of a component's class, each optional, found by attribute (a class of
torch's is priced by its room, framework/optimizers/prices.py):

- `check(cfg)`: a classmethod raising ValueError("<dotted key>: why") where the run's config (its
  own group's kwargs, the layout) cannot run it, the key in full (`optim.momentum`,
  `parallel.version`); asked before any worker starts, after the kwargs are checked against the
  signature here;
- `planner_price`: what it costs the planner's forecast (its room says in what terms); a component
  without one is planned as if it cost nothing, and the forecast says so.

Every refusal here is a `ComponentError` ("key: why", one line); the config checks raise it as
their ConfigError.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import inspect
from collections.abc import Collection
from typing import Any

from omegaconf import DictConfig, OmegaConf


class ComponentError(ValueError):
    """A component that cannot run, naming the key at fault: `key: why`."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


def locate(node: DictConfig, group: str) -> Any:
    """The class (or function) `<group>._target_` names; one line where it cannot be imported, with
    its real cause (no such module, or a module without that name)."""
    target = str(node.get("_target_") or "")
    if not target:
        example = "pkg.module.MyModel" if group == "model" else "torch.optim.AdamW"
        raise ComponentError(f"{group}._target_", f"not set: name the class or factory, e.g. {example}")
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module, then attributes
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and not module_name.startswith(err.name):
                raise ComponentError(f"{group}._target_", f"importing {module_name!r} failed: {err}") from None
            continue
        except Exception as err:  # noqa: BLE001 - the module's own error (a syntax error, a failed import in it)
            why = str(err).splitlines()[0] if str(err) else ""
            raise ComponentError(
                f"{group}._target_", f"importing {module_name!r} failed: {type(err).__name__}: {why}"
            ) from None
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                raise ComponentError(f"{group}._target_", f"cannot import {target!r}: module {module_name!r} has no "
                                     f"{attr!r}")  # fmt: skip
            obj = getattr(obj, attr)
        return obj
    raise ComponentError(f"{group}._target_", f"cannot import {target!r}: no module {parts[0]!r}; is its folder on "
                         "PYTHONPATH?")  # fmt: skip


def kwargs_of(node: DictConfig, own: Collection[str] = ()) -> dict[str, Any]:
    """The keyword arguments a component's class gets: its keys less `_target_`-like and `own` ones."""
    values = OmegaConf.to_container(node, resolve=True)
    return {k: v for k, v in values.items() if not k.startswith("_") and k not in own}


def check_component(cfg: DictConfig, group: str, own: Collection[str] = (), runtime: int = 1,
                    given: Collection[str] = ()) -> type:  # fmt: skip
    """Refuse, in one line, a key the class does not take (with the nearest it does), a value whose
    type its default's contradicts, and an argument it needs that is not set. `runtime`: the
    leading positional arguments the framework passes (the parameters); `given`: keywords it passes
    where the class takes them (an LR schedule's `total_steps`). Then the class's own `check(cfg)`
    (the run's whole config: a component may refuse a layout). Returns the class."""
    node = OmegaConf.select(cfg, group)  # a group (optim), or an entry of one (converters.freeze)
    cls = locate(node, group)
    params = _parameters(cls)[runtime:]
    named = {p.name: p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    open_ended = any(p.kind is p.VAR_KEYWORD for p in params)
    target = node._target_
    for key, value in kwargs_of(node, own).items():
        if key not in named and not open_ended:
            near = nearest(key, [*named, *own])
            hint = f"did you mean {near!r}? " if near else ""
            raise ComponentError(f"{group}.{key}", f"{target} takes no such argument; {hint}it takes: "
                              f"{', '.join([*named, *own]) or 'nothing'}")  # fmt: skip
        default = named[key].default if key in named else inspect.Parameter.empty
        if _contradicts(default, value):
            raise ComponentError(f"{group}.{key}", f"got {value!r}; {target} expects a {type(default).__name__} "
                              f"(its default: {default!r})")  # fmt: skip
    missing = [n for n, p in named.items() if p.default is p.empty and n not in node and n not in given]
    if missing:
        raise ComponentError(f"{group}.{missing[0]}", f"not set; {target} needs it: add {group}.{missing[0]}=...")
    if hasattr(cls, "check"):
        try:
            cls.check(cfg)
        except ValueError as err:
            key, _, why = str(err).partition(": ")
            raise ComponentError(key, why) from None
    return cls


def build_component(node: DictConfig, own: Collection[str], *runtime: Any, **given: Any) -> Any:
    """The class called with the framework's `runtime` arguments, the config's kwargs, and those of
    `given` its signature takes that the config does not set."""
    cls = locate(node, "component")
    names = {p.name for p in _parameters(cls)}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in _parameters(cls))
    kwargs = kwargs_of(node, own)
    extra = {k: v for k, v in given.items() if (k in names or takes_any) and k not in kwargs}
    return cls(*runtime, **kwargs, **extra)


def nearest(key: str, names: list[str]) -> str | None:
    """The name `key` misspells, or abbreviates by its words' initials (lerning_rate: lr)."""
    initials = "".join(w[0] for w in key.split("_") if w)
    if "_" in key and initials in names:
        return initials
    near = difflib.get_close_matches(key, names, n=1)
    return near[0] if near else None


def takes(cls: Any, name: str) -> bool:
    """`cls` takes keyword argument `name`."""
    return any(p.name == name for p in _parameters(cls))


@functools.cache
def _parameters(cls: Any) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(cls).parameters.values())
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]


def _contradicts(default: Any, value: Any) -> bool:
    """A string where the default is a number or a bool, or a number where it is a bool."""
    if default is inspect.Parameter.empty or default is None or value is None:
        return False
    if isinstance(default, bool):
        return not isinstance(value, bool)
    if isinstance(default, int | float):
        return isinstance(value, str | bool | list | dict)
    return False
