"""The error every config check raises: one line naming the key at fault and what is allowed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue


class ConfigError(ValueError):
    """A configuration that cannot run. ``key`` is the dotted config key at fault."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


def check_mandatory(cfg: DictConfig) -> None:
    """A value the config marks `???` (data=tokens' data.path, data=custom's data._target_) is
    named before any check reads it: omegaconf's own error is a traceback from wherever it was read."""
    mixture = OmegaConf.is_dict(cfg.get("data")) and cfg.data.get("sources")
    missing = [k for k in _missing_keys(cfg) if not (mixture and k == "data.path")]  # each source has its own
    if missing:
        group = missing[0].split(".", 1)[0]
        choice = cfg[group].get("name") if OmegaConf.is_dict(cfg.get(group)) else None
        needs = f"{group}={choice} needs it" if choice else "it is mandatory (???)"
        raise ConfigError(missing[0], f"not set; {needs}: add {missing[0]}=...")


def _missing_keys(cfg: DictConfig, prefix: str = "") -> Iterator[str]:
    """The dotted keys whose value is `???`, read without resolving (OmegaConf.missing_keys resolves
    every interpolation on its way, and fails on one that does not)."""
    for key in cfg.keys():
        node = cfg._get_node(key)
        if node._is_missing():
            yield f"{prefix}{key}"
        elif isinstance(node, DictConfig) and not node._is_none() and not node._is_interpolation():
            yield from _missing_keys(node, f"{prefix}{key}.")


@contextmanager
def resolution_named() -> Iterator[None]:
    """A value that does not resolve (an interpolation into a key the other group lacks, such as
    lstm's `${data.vocab_size}` under data=text) is one line naming the key, not omegaconf's traceback."""
    try:
        yield
    except (InterpolationResolutionError, MissingMandatoryValue) as err:
        reason = str(getattr(err, "msg", err)).splitlines()[0]
        raise ConfigError(err.full_key or "config", f"does not resolve: {reason}") from None
