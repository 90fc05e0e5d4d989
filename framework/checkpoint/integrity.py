"""Checkpoint integrity: a manifest of every file a checkpoint wrote, and its verification.

Each rank digests the files it has just written (one pass over bytes still in the page cache,
with xxh3, faster than the disk), the coordinator writes `manifest.json` with every rank's
entries, and only then DCP writes `.metadata`. A folder is taken for a checkpoint only when
`.metadata` is there, and trusted only when every file of its manifest has the recorded size
(`checkpoint.verify=size`) and digest (`full`). Verification is split over the ranks (each reads
a share of the files) so a large checkpoint is read once, in parallel.

`.metadata` itself cannot be in the manifest (it is written after it); it is checked by
reading it with the restricted unpickler DCP loads go through (framework/checkpoint/store.py).
"""

from __future__ import annotations

import json
import os
from typing import Any

import xxhash

MANIFEST = "manifest.json"
ALGORITHM = "xxh3_64"
METADATA = ".metadata"
VERIFY_MODES = ("full", "size", "off")
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint that does not verify, or a save that failed: the message is one line naming
    the file or folder, and the run stops with it (no traceback)."""


def digest_file(path: str) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_entries(folder: str, names: list[str], digests: bool) -> dict[str, dict[str, Any]]:
    """{name: {"size", "digest"}} of files just written into `folder` (digest only if asked)."""
    out = {}
    for name in names:
        path = os.path.join(folder, name)
        out[name] = {"size": os.path.getsize(path), "digest": digest_file(path) if digests else None}
    return out


def write_manifest(folder: str, files: dict[str, dict[str, Any]]) -> None:
    """Write `manifest.json` atomically and durably (before DCP's `.metadata`)."""
    path = os.path.join(folder, MANIFEST)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(folder: str) -> dict[str, dict[str, Any]]:
    """The manifest's files; raises CheckpointError naming manifest.json when missing or unreadable."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: missing (no manifest: the save did not finish, or the file was removed)")
    try:
        with open(path) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest.get("algorithm") != ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"unknown manifest format (algorithm {manifest.get('algorithm')!r})")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path}: unreadable ({type(err).__name__}: {err})") from None
    return files


def check_file(folder: str, name: str, entry: dict[str, Any], mode: str) -> str | None:
    """Why `name` does not match its manifest entry, or None."""
    path = os.path.join(folder, name)
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return f"{path}: missing"
    except OSError as err:
        return f"{path}: unreadable ({err})"
    if size != entry["size"]:
        return f"{path}: size {size} bytes, the manifest says {entry['size']} (truncated or overwritten)"
    if mode == "full" and entry.get("digest") is not None:
        try:
            digest = digest_file(path)
        except OSError as err:
            return f"{path}: unreadable ({err})"
        if digest != entry["digest"]:
            return f"{path}: {ALGORITHM} digest {digest}, the manifest says {entry['digest']} (the bytes changed)"
    return None


def verify_share(folder: str, mode: str, share: tuple[int, int] = (0, 1)) -> str | None:
    """The first problem (sorted by file name) among this rank's share (`rank`, `world`: every
    world-th file of the manifest) of checkpoint `folder`, or None. mode=off only asks that the
    save finished (`.metadata` and `trainer.json` are there)."""
    rank, world = share
    for required in (METADATA, "trainer.json"):
        if not os.path.exists(os.path.join(folder, required)):
            return f"{os.path.join(folder, required)}: missing (the save did not finish)"
    if mode == "off":
        return None
    try:
        files = read_manifest(folder)
    except CheckpointError as err:
        return str(err)
    for i, (name, entry) in enumerate(sorted(files.items())):
        if i % world == rank:
            problem = check_file(folder, name, entry, mode)
            if problem is not None:
                return problem
    return None
