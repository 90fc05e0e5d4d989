"""The error every config check raises: one line naming the key at fault and what is allowed."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration that cannot run. ``key`` is the dotted config key at fault."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")
