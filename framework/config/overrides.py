"""`check_overrides(argv)`: a misspelt choice, an unknown key or a value of the wrong type on the
command line is one line and exit 2, before Hydra's own report (a multi-line dump, exit 1):

    parallel: got 'fdsp'; did you mean 'fsdp'? allowed: auto, cp, ddp, dp, fsdp, hybrid, none, pp, tp
    lr: no such key; did you mean 'optim.lr'?

It composes the command line's overrides as Hydra will (each value of a sweep once) and names what
Hydra refuses, and a key `+group.key=value` adds that the group's schema lacks (which Hydra adds
all the same: framework/config/keys.py); what it cannot name it leaves to Hydra.
"""

from __future__ import annotations

import contextlib
import difflib
import re
import sys
from collections.abc import Iterator

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, Override, RangeSweep
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

from framework.config.errors import ConfigError
from framework.config.keys import choices_with, first_undeclared, no_such_key, undeclared

# Hydra's flags that take a value, and those after which the overrides compose differently (or not
# at all): the check then stays out of the way
_WITH_VALUE = {"--cfg", "-c", "--package", "-p"}
_INFO, _INFO_VALUES = {"--info", "-i"}, {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}
_HANDS_OFF = {"--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun",
              "--shell-completion", "-sc", "--help", "-h", "--hydra-help", "--version"}  # fmt: skip


def check_overrides(argv: list[str]) -> None:
    """Exit 2 with one line on stderr for the first override Hydra would refuse (train.py's argv)."""
    problem = first_problem(argv)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)


def first_problem(argv: list[str]) -> str | None:
    """The one-line message for the first override of `argv` that does not compose, else None."""
    overrides = _overrides_of(argv)
    if overrides is None:
        return None
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception:  # noqa: BLE001 - a syntax error: Hydra's own message points at the character
        return None
    for trial in _trials(parsed):
        problem = _compose_problem(trial)
        if problem is not None:
            return problem
    return None


def _overrides_of(argv: list[str]) -> list[str] | None:
    """The overrides among Hydra's flags, or None where a flag changes what composes."""
    out, i = [], 0
    while i < len(argv):
        arg, i = argv[i], i + 1
        if arg.split("=", 1)[0] in _HANDS_OFF:
            return None
        if arg in _WITH_VALUE:
            i += 1
        elif arg in _INFO:
            i += int(argv[i : i + 1] != [] and argv[i] in _INFO_VALUES)
        elif not arg.startswith("-"):
            out.append(arg)
    return out


def _trials(parsed: list[Override]) -> Iterator[list[str]]:
    """The overrides with each sweep at its first value, then each other value of each sweep once
    (the others at their first). Sweeps over an interval (Optuna's) are left out."""
    values = [_values(o) for o in parsed]
    first = [v[0] for v in values if v]
    yield first
    for i, vals in enumerate(values):
        for value in vals[1:]:
            yield [value if j == i else v[0] for j, v in enumerate(values) if v]


def _values(override: Override) -> list[str]:
    if not override.is_sweep_override():
        return [override.input_line]
    if not isinstance(override.value(), ChoiceSweep | RangeSweep):
        return []
    key = override.get_key_element()
    return [f"{key}={v}" for v in override.sweep_string_iterator()]


def _compose_problem(overrides: list[str]) -> str | None:
    from framework.config import compose

    try:
        cfg = compose(overrides)
    except MissingConfigException as err:
        return _missing_choice(err)
    except ConfigCompositionException as err:
        cause = err.__cause__ or err.__context__  # a preset's own key: Hydra chains it implicitly
        source = re.match(r"In '([^'/]+)/([^']+)'", str(err))
        if isinstance(cause, ConfigAttributeError | ConfigKeyError) and source:
            return _set_by_preset(cause.full_key or "", f"{source[1]}={source[2]}", overrides)
        if isinstance(cause, ConfigAttributeError | ConfigKeyError):
            return _unknown_key(cause.full_key or "", overrides)
        if isinstance(cause, ValidationError) and source:
            return f"{cause.full_key}: {source[1]}={source[2]} sets {cause.value!r}: {str(cause.msg).splitlines()[0]}"
        if isinstance(cause, ValidationError):
            return _bad_value(cause, overrides)
        if held := re.search(r"An item is already at '([^']+)'", str(err)):  # +key=value on a key it has
            line = next((o for o in overrides if o.split("=", 1)[0].lstrip("+") == held[1]), f"{held[1]}=...")
            return f"{held[1]}: already in the config; + adds a key it lacks: set it with {line.lstrip('+')}"
        return f"{getattr(cause, 'full_key', '') or 'config'}: {str(err).splitlines()[0]}"
    except ValueError as err:  # group=null: Hydra's "Config group override must be a string or a list"
        return _null_choice(overrides) if "Config group override" in str(err) else None
    except Exception:  # noqa: BLE001 - what it cannot name, Hydra reports
        return None
    key = next(undeclared(cfg), None)  # +group.key=value: Hydra adds it whatever the group's schema declares
    return None if key is None else f"{key}: {no_such_key(key, cfg)}"


def _set_by_preset(key: str, preset: str, overrides: list[str]) -> str:
    """A preset (experiment=smoke) sets a key the group's choice on the command line lacks."""
    group, _, leaf = key.partition(".")
    choice = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == group), None)
    owners = choices_with(group, leaf.rsplit(".", 1)[-1])
    have = f" ({', '.join(owners)} {'has' if len(owners) == 1 else 'have'} it)" if owners else ""
    return f"{key}: {preset} sets it, but {group}={choice or '?'} has no such key{have}; choose another {group}"


def _missing_choice(err: MissingConfigException) -> str | None:
    if not err.missing_cfg_file or not err.options:
        return None
    group, _, got = err.missing_cfg_file.rpartition("/")
    return _not_allowed(group, got, [str(o) for o in err.options])


def _null_choice(overrides: list[str]) -> str | None:
    """GROUP=null (Hydra's ValueError names neither): a group takes one of its choices, `none` where it has one."""
    from framework.config import CONF_DIR

    for override in overrides:
        key, _, value = override.partition("=")
        folder = CONF_DIR / key.lstrip("+~")
        if value == "null" and folder.is_dir():
            allowed = sorted(p.stem for p in folder.glob("*.yaml"))
            hint = "did you mean 'none'? " if "none" in allowed else ""
            return f"{folder.name}: got null; {hint}allowed: {', '.join(allowed)}"
    return None


def _no_callback(key: str, overrides: list[str]) -> str:
    """callbacks.NAME... where the callbacks choice holds no NAME entry (callbacks=none callbacks.spike.action=warn)."""
    from framework.config import compose

    name = key.split(".")[1]
    choice = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == "callbacks"), "default")
    fix = f"add one with +callbacks.{name}._target_=pkg.Class (docs/callbacks.md)"
    if choice != "default" and name in compose(["callbacks=default"]).callbacks:
        fix = f"pick callbacks=default, which holds it, or {fix}"
    return f"{key}: callbacks={choice} has no {name!r} entry; {fix}"


def _not_allowed(key: str, got: str, allowed: list[str]) -> str:
    near = difflib.get_close_matches(got, allowed, n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return f"{key}: got {got!r}; {hint}allowed: {', '.join(allowed)}"


def _unknown_key(key: str, overrides: list[str]) -> str:
    if key.startswith("callbacks.") and key.count(".") == 1:  # an entry the callbacks choice lacks
        return _no_callback(key, overrides)
    if own := _own_setting(key, overrides):  # a user's component file leaves a run setting out
        return own
    return f"{key}: {no_such_key(key, _compose_without(key, overrides))}"


def _own_setting(key: str, overrides: list[str]) -> str | None:
    """`optim.grad_clip=0` where the optim file (a user's) leaves that run setting out: add it with `+`."""
    from framework.optimizers import OWN

    if (group := key.partition(".")[0]) != "optim" or (leaf := key.partition(".")[2]) not in OWN:
        return None
    choice = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+~") == group), "adamw")
    value = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0] == key), "...")
    return f"{key}: optim={choice} leaves it out (default {OWN[leaf]}); add it with +{key}={value}"


def _bad_value(cause: ValidationError, overrides: list[str]) -> str:
    key = cause.full_key or ""
    got = next((o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].lstrip("+") == key), str(cause.value))
    base = _compose_without(key, overrides)
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(base, parent) if base is not None and parent else base
    enum_type = getattr(node._get_node(leaf), "enum_type", None) if isinstance(node, DictConfig) else None
    if enum_type is not None:
        return _not_allowed(key, got, list(enum_type.__members__))
    return f"{key}: got {got!r}; {str(cause.msg).splitlines()[0]}"


def _compose_without(key: str, overrides: list[str]) -> DictConfig | None:
    """The config the other overrides compose (None where they do not)."""
    from framework.config import compose

    rest = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") != key]
    try:
        return compose(rest)
    except Exception:  # noqa: BLE001 - another problem: no suggestion from it
        return None


def compose_checked(overrides: list[str]) -> DictConfig:
    """Compose as train.py does, for the other front doors (the planner): what train.py's check
    names is raised as its ConfigError, and what Hydra still refuses is one line too."""
    from framework.config import compose

    try:
        return compose(overrides)  # once: only a config that does not compose is composed again, to name the key
    except Exception as err:  # noqa: BLE001 - a syntax error: Hydra's first line points at it
        problem = first_problem(overrides)
        if problem is not None:
            raise ConfigError(*problem.split(": ", 1)) from None
        raise ConfigError("overrides", str(err).splitlines()[0]) from None


def apply_overrides(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """`overrides` onto a saved run's config (python -m framework.evaluate): a group's choice
    (parallel=ddp) replaces that group with what train.py composes for it, checked as train.py
    checks it; a key (eval.steps=4) must be one of the config's, as under train.py's struct mode."""
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except Exception as err:  # noqa: BLE001 - Hydra's parse error: its first line points at the character
        raise ConfigError("overrides", str(err).splitlines()[0]) from None
    for override in parsed:
        key = override.get_key_element().lstrip("+~")
        if override.is_sweep_override():
            raise ConfigError(key, f"got {override.input_line!r}; one value here (a sweep is train.py -m's)")
        if key in GROUPS and "." not in key:
            _replace_group(cfg, key, override.input_line)
        else:
            _set_key(cfg, key, override)
    return cfg


GROUPS = (
    "backend",
    "parallel",
    "precision",
    "memory",
    "peft",
    "data",
    "model",
    "optim",
    "schedule",
    "logger",
    "callbacks",
)


def _replace_group(cfg: DictConfig, group: str, line: str) -> None:
    from framework.config import compose

    problem = first_problem([line])
    if problem is not None:
        raise ConfigError(*problem.split(": ", 1))
    node = OmegaConf.to_container(compose([line])[group], resolve=False)  # resolved later, in this config
    with open_dict(cfg):
        cfg[group] = node


def _set_key(cfg: DictConfig, key: str, override: Override) -> None:
    if override.is_delete():
        with open_dict(cfg):
            parent, _, leaf = key.rpartition(".")
            (OmegaConf.select(cfg, parent) if parent else cfg).pop(leaf, None)
        return
    value = override.value()
    if override.is_add() and (undeclared_key := first_undeclared(cfg, key)):  # as train.py's schema refuses it
        raise ConfigError(undeclared_key, no_such_key(undeclared_key, cfg))
    if not override.is_add():  # +key=value adds a key: nothing saved to match
        value = _as_saved(OmegaConf.select(cfg, key, throw_on_missing=False), value, key)
    try:
        with open_dict(cfg) if override.is_add() else contextlib.nullcontext():
            OmegaConf.update(cfg, key, value, merge=True)
    except (ConfigAttributeError, ConfigKeyError):
        raise ConfigError(key, no_such_key(key, cfg)) from None
    except ValidationError as err:
        raise ConfigError(key, f"got {value!r}; {str(err.msg).splitlines()[0]}") from None


def _as_saved(old: object, new: object, key: str) -> object:
    """`new` in the type the run's saved value has: a saved config is a plain dict, without the
    schema that types train.py's keys (a number stays a number; a path given as digits, a string)."""
    number = (int, float)
    if old is None or new is None or isinstance(old, dict | list):
        return new
    if isinstance(old, bool) != isinstance(new, bool) or (isinstance(old, number) and not isinstance(new, number)):
        raise ConfigError(key, f"got {new!r}; the run's value is {type(old).__name__} {old!r}")
    return str(new) if isinstance(old, str) and not isinstance(new, str) else new
