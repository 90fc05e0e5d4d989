"""The keys a config may hold, and the line that names one it may not:

    checkpoint.evry: no such key; did you mean 'checkpoint.every'?

Hydra composes `+group.key=value` with OmegaConf's force_add, which puts the key into a node in
struct mode whatever the node's schema (a dataclass) declares: the plain form fails to compose and
train.py names it (framework/config/overrides.py), while the added form composed and changed
nothing. `check_declared(cfg)` finds such a key in the composed config, in every section alike: a
node typed by a dataclass holds only that dataclass's fields. A component's node (one with a
`_target_`: the model, a user's dataset) takes what its class takes; the component's own check
judges those keys (framework/components.py, config/model.py, config/callback_checks.py), and the
nodes below it are checked here as any other.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from dataclasses import fields, is_dataclass
from typing import get_type_hints

from omegaconf import DictConfig, OmegaConf

from framework.config.errors import ConfigError

CHECKED = "keys_checked"  # the flag of a config whose keys passed (OmegaConf keeps it through copies)
# keys that are spelt another way
SPELT_AS = {"memory.cpu_offload": "memory=offload (FSDP CPU offload)"}


def check_declared(cfg: DictConfig) -> None:
    """ConfigError naming the first key a typed node holds that its schema does not declare. A
    config that passed is marked so: validation then writes what it resolves in place (a widened
    tp axis' `parallel.sequence_parallel`), which a second validation must not take for an added key."""
    if cfg._get_flag(CHECKED):
        return
    key = next(undeclared(cfg), None)
    if key is not None:
        raise ConfigError(key, no_such_key(key, cfg))
    cfg._set_flag(CHECKED, True)


def undeclared(cfg: DictConfig, prefix: str = "") -> Iterator[str]:
    """The dotted keys of `cfg` that the schema of the node holding them does not declare."""
    schema = OmegaConf.get_type(cfg)
    if is_dataclass(schema) and "_target_" not in cfg:
        declared = {f.name for f in fields(schema)}
        yield from (f"{prefix}{k}" for k in cfg.keys() if k not in declared)
    for k in cfg.keys():
        node = cfg._get_node(k)
        if isinstance(node, DictConfig) and not (node._is_none() or node._is_missing() or node._is_interpolation()):
            yield from undeclared(node, f"{prefix}{k}.")


def first_undeclared(cfg: DictConfig, key: str) -> str | None:
    """The part of `key` (itself, or a section above it) the schema does not declare, read by the
    config's choices (a saved run's config is a plain dict, which no node's type tells); None
    where it is declared, or falls in an untyped section (a component's node, the callbacks' entries)."""
    from framework.config.schema import GROUP_SCHEMAS, Config, group_schema

    schema, node, parts = Config, cfg, key.split(".")
    for i, part in enumerate(parts):
        if schema is None or (OmegaConf.is_dict(node) and "_target_" in node):
            return None
        hints = get_type_hints(schema)
        if part not in hints:
            return ".".join(parts[: i + 1])
        node = node.get(part) if OmegaConf.is_dict(node) else None
        if schema is Config and part in GROUP_SCHEMAS:
            schema = group_schema(part, node.get("name")) if OmegaConf.is_dict(node) else None
        else:
            schema = hints[part] if is_dataclass(hints[part]) else None
    return None


def no_such_key(key: str, cfg: DictConfig | None) -> str:
    """Why `key` is not one of `cfg`'s (which may hold it, added): the choice of its group that
    has it, else the nearest key, else what its section takes."""
    if key in SPELT_AS:
        return f"no such key; use {SPELT_AS[key]}"
    group, _, leaf = key.partition(".")
    if leaf and cfg is not None and group in cfg and OmegaConf.is_dict(cfg[group]):
        owners, choice = choices_with(group, key.rsplit(".", 1)[1]), cfg[group].get("name")
        if owners and choice is not None:
            return f"no such key with {group}={choice}; {', '.join(owners)} {'has' if len(owners) == 1 else 'have'} it"
    near = nearest_key(key, cfg)
    if near is not None:
        return f"no such key; did you mean {near!r}?"
    parent = key.rpartition(".")[0]
    node = OmegaConf.select(cfg, parent, throw_on_missing=False) if cfg is not None and parent else None
    takes = [k for k in node.keys() if f"{parent}.{k}" != key] if OmegaConf.is_dict(node) else []
    return f"no such key; {parent} takes: {', '.join(map(str, takes))}" if takes else "no such key"


def choices_with(group: str, leaf: str) -> list[str]:
    """The choices of `group` whose schema has the key `leaf`."""
    from framework.config.schema import GROUP_SCHEMAS

    schemas = GROUP_SCHEMAS.get(group, {})
    return [name for name, schema in schemas.items() if name != "base" and leaf in {f.name for f in fields(schema)}]


def nearest_key(key: str, cfg: DictConfig | None) -> str | None:
    """The config key closest to `key` by its last part (`lr`: `optim.lr`; `evry`: `every`; the
    start of a longer one), the whole dotted name telling those apart; in another section only a
    near-certain match (the right key in the wrong group); never `key`, a key above it or below it."""
    if cfg is None:
        return None
    leaf, section = key.rsplit(".", 1)[-1], key.split(".")[0] if "." in key else ""

    def score(k: str) -> tuple[float, float]:
        other = k.rsplit(".", 1)[-1]
        near = 1.0 if _abbreviates(leaf, other) or _abbreviates(other, leaf) else 0.0
        spelt = max(_ratio(leaf, other), _ratio(leaf, other[: len(leaf) + 1]))  # nprocs: nproc_per_node
        return max(near, spelt), _ratio(key, k)

    def close(k: str) -> bool:
        return score(k)[0] >= (0.6 if (k.split(".")[0] if "." in k else "") == section else 0.85)

    keys = [k for k in dotted_keys(cfg) if not (k == key or key.startswith(f"{k}.") or k.startswith(f"{key}."))]
    return max(filter(close, keys), key=score, default=None)


def _ratio(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _abbreviates(short: str, name: str) -> bool:
    """`short` is `name`'s abbreviation by the initials of its words: lr for learning_rate, bs for
    batch_size (what spelling alone cannot see: the two share no letters in order)."""
    words = [w for w in name.split("_") if w]
    return len(words) > 1 and short == "".join(w[0] for w in words)


def dotted_keys(cfg: DictConfig, prefix: str = "") -> Iterator[str]:
    for k in cfg.keys():
        name = f"{prefix}{k}"
        yield name
        node = cfg._get_node(k)
        if isinstance(node, DictConfig) and not node._is_missing() and not node._is_none():
            yield from dotted_keys(node, name + ".")
