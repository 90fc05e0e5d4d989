"""One way in for the front doors that read a model (`python -m framework.evaluate`, `.generate`,
`.harness`, `.export`): `resolve_input(target, overrides)` composes once, resolves and validates as train.py
does, before any model is built or any worker starts. What it refuses is a ConfigError naming the
key, which the door prints as one line and exits 2 on.

- TARGET, a checkpoint folder or a run folder (its best checkpoint, else its newest): the config
  saved beside the checkpoints, the overrides on top (a group's choice composed as train.py composes it);
- no TARGET: the config the overrides compose, as `python train.py OVERRIDES` would
  (`model=llama model.pretrained=DIR`, `model=hf model.pretrained=DIR`, a `_target_` model).

Either way one process, nothing saved or logged, unless the overrides say otherwise. Under
data=text, a `data.path=FILE` override is a file scored whole (`whole_file`): consecutive windows
of all of it, nothing held out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from framework.checkpoint import store as checkpoint
from framework.config.errors import ConfigError, resolution_named
from framework.config.validate import validate

ALL_BYTES = 1 << 62  # data.max_bytes of a file scored whole
# what a door sets unless the overrides say otherwise: one process, nothing saved, logged or
# evaluated along the way. Groups take their choice; keys their value.
DOOR_GROUPS = {"parallel": "none", "logger": "none"}
DOOR_KEYS = {"launch.nproc_per_node": 1, "checkpoint.resume": None, "checkpoint.every": 0, "checkpoint.monitor": None,
             "checkpoint.export": False, "eval.every": 0, "eval.at_start": False, "eval.patience": 0,
             "progress": False}  # fmt: skip


@dataclass(frozen=True)
class DoorInput:
    """What a door reads: the config, where the weights come from, how the data is read."""

    cfg: DictConfig  # validated and resolved, in struct mode: what a worker runs with
    checkpoint: str | None  # the checkpoint folder the weights come from; None: the model as built
    whole_file: bool  # data=text given data.path: the file scored whole


def split_target(argv: list[str]) -> tuple[str | None, list[str]]:
    """(TARGET, overrides): a first argument that is a path, or not key=value, is the checkpoint or run folder."""
    if argv and ("=" not in argv[0] or os.path.exists(argv[0])):
        return argv[0], list(argv[1:])
    return None, list(argv)


def resolve_input(
    target: str | None, overrides: list[str], config_file: str | None = None, reads_data: bool = True
) -> DoorInput:
    """The config a door runs with: a checkpoint's (TARGET; `config_file` read in place of the one
    saved beside it) or the one the overrides compose, checked as train.py checks it, resolved;
    ConfigError for the first problem. `reads_data=False` (export): the data's files are not checked,
    a run's data may have moved since it trained."""
    path = resolve_checkpoint(target) if target is not None else None
    cfg = saved_config(path, overrides, config_file) if path is not None else composed_config(overrides)
    given = keys_of(overrides)
    whole_file = "data.path" in given and cfg.data.name == "text" and not cfg.data.get("sources")
    whole_file = whole_file and not given & {"data.val_fraction", "data.val_path"}  # else: that file's split
    if whole_file:
        OmegaConf.update(cfg, "data.val_fraction", 0.0)
        OmegaConf.update(cfg, "data.val_path", None)
        if "data.max_bytes" not in given:
            OmegaConf.update(cfg, "data.max_bytes", ALL_BYTES)
    try:
        validate(cfg, reads_data)
    except (ConfigAttributeError, ConfigKeyError) as err:  # a key a check reads that the saved config lacks
        key = err.full_key or str(err.key)
        raise ConfigError(key, f"not in the run's config (an older run's?); set it with +{key}=VALUE") from None
    with resolution_named():
        resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    OmegaConf.set_struct(resolved, True)
    return DoorInput(resolved, path, whole_file)


def resolve_checkpoint(target: str) -> str:
    """A checkpoint folder, or a run directory's best (else newest) complete checkpoint."""
    if checkpoint.complete(target):
        return target
    root = os.path.join(target, "checkpoints")
    found = checkpoint.latest(checkpoint.best_root(root)) or checkpoint.latest(root)
    if found is None:
        raise ConfigError("checkpoint", f"{target!r} is neither a complete checkpoint nor a run directory with one "
                          "(a run saves them with checkpoint.every=N)")  # fmt: skip
    return found


def saved_config(path: str, overrides: list[str], config_file: str | None = None) -> DictConfig:
    """The config saved beside checkpoint `path` (or `config_file`, a run's config.yaml), the
    door's settings and then `overrides` on top."""
    from framework.config.overrides import apply_overrides

    saved = read_config_file(config_file) if config_file else checkpoint.find_config(path)
    if saved is None:
        raise ConfigError("checkpoint", f"no {checkpoint.CONFIG_FILE} beside {path} (saved by runs since issue 21)")
    cfg = OmegaConf.create(with_defaults(saved, "--config" if config_file else "checkpoint"))
    for group, choice in DOOR_GROUPS.items():
        OmegaConf.update(cfg, f"{group}.name", choice, force_add=True)
    for key, value in DOOR_KEYS.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    OmegaConf.set_struct(cfg, True)
    return apply_overrides(cfg, overrides)  # as train.py composes and checks them: one line naming the key


def read_config_file(config_file: str) -> dict:
    """`--config FILE`, a run's config.yaml, as a dict; what does not read as one is one line."""
    if not os.path.isfile(config_file):
        raise ConfigError("--config", f"no file at {config_file!r}")
    try:
        loaded = OmegaConf.to_container(OmegaConf.load(config_file))
    except Exception as err:  # noqa: BLE001 - yaml's scanner and parser errors, a scalar file: the file's fault
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        reason = getattr(err, "problem", None) or (str(err).splitlines() or [type(err).__name__])[0]
        raise ConfigError("--config", f"{config_file!r} does not read as YAML: {reason}{where}") from None
    if not isinstance(loaded, dict):
        raise ConfigError("--config", f"{config_file!r} holds a {type(loaded).__name__}, not a run's config "
                          "(a mapping of its keys, as .hydra/config.yaml)")  # fmt: skip
    return loaded


def with_defaults(saved: dict, source: str) -> dict:
    """A run's saved config with what it lacks (an older run's: no `peft`, no `plan`) as train.py
    composes it by default: a group it lacks whole, a section's missing keys one by one. One without
    a model or data is no run's config."""
    from framework.config import compose
    from framework.config.overrides import GROUPS

    for key in ("model", "data"):
        if not isinstance(saved.get(key), dict):
            raise ConfigError(source, f"no {key!r} section: not a run's config (its .hydra/config.yaml)")
    return filled(saved, OmegaConf.to_container(compose(), resolve=False), GROUPS)


def filled(saved: dict, defaults: dict, whole: tuple[str, ...] = ()) -> dict:
    """`saved` with the keys of `defaults` it lacks, within each section too (a key of `whole`, a
    group of another choice's keys, only where it is missing whole)."""
    out = dict(saved)
    for key, value in defaults.items():
        if key not in out:
            out[key] = value
        elif key not in whole and isinstance(value, dict) and isinstance(out[key], dict):
            out[key] = filled(out[key], value)
    return out


def composed_config(overrides: list[str]) -> DictConfig:
    """The config `python train.py OVERRIDES` composes (and checks as it checks), the door's
    settings under the overrides."""
    from framework.config.overrides import compose_checked

    given = keys_of(overrides)
    door = [f"{g}={c}" for g, c in DOOR_GROUPS.items() if g not in given]
    door += [f"{k}={as_override(v)}" for k, v in DOOR_KEYS.items() if k not in given]
    return compose_checked(door + overrides)


def keys_of(overrides: list[str]) -> set[str]:
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides}


def as_override(value: object) -> str:
    """A value as an override writes it: null, false, 0.01 (lm_eval's --model_args come typed)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def check_validation_split(cfg: DictConfig) -> None:
    """The data holds a validation split out for framework.evaluate to read; else one line naming
    the keys that make one (the worker's own error was a traceback, after the workers started)."""
    d = cfg.data
    if d.get("val_path") or d.get("_target_") or d.name == "chat" or (d.name == "hf" and not d.streaming):
        return  # a file of its own; else, with nothing held out, the whole dataset is the split
    if d.name == "hf":
        raise ConfigError("data.val_path", "a stream holds no validation split out; set data.val_path=FILE (read "
                          "map-style), or data.streaming=false (all rows, or data.val_fraction=F of them)")  # fmt: skip
    if d.name == "tokens":
        from framework.data.tokens import read_manifest

        for folder in [s.get("path", d.path) for s in d.sources] if d.get("sources") else [d.path]:
            if not any(s["split"] == "val" for s in read_manifest(folder)["shards"]):
                raise ConfigError("data.path", f"the shards at {folder!r} hold no validation split; make one with "
                                  "python -m framework.data.prepare INPUT OUT --val-fraction F")  # fmt: skip
        return
    if d.val_fraction > 0:
        return
    text = ", data.val_path=FILE, or data.path=FILE (scored whole)" if d.name == "text" else ""
    raise ConfigError("data.val_fraction", f"data={d.name} holds no validation split out; set "
                      f"data.val_fraction=F (0 < F < 1){text}")  # fmt: skip
