"""The cache of measured machine figures, ~/.cache/hydradist/links.json (under XDG_CACHE_HOME):
one JSON object, keyed by what the figure depends on (CPU or GPU model, threads, torch version)."""

from __future__ import annotations

import json
import os


def _cache_path() -> str:
    root = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return os.path.join(root, "hydradist", "links.json")


def read_cache() -> dict:
    try:
        with open(_cache_path()) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def write_cache(key: str, value: dict) -> None:
    cache = read_cache() | {key: value}
    path = _cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(cache, f, indent=1)
    os.replace(tmp, path)
