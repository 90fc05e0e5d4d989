"""Initialisation that any shard can reproduce on its own.

Row r (index along dim 0) of parameter `name` is drawn from a generator seeded by (seed, name,
r), so the values of an element do not depend on who fills it: one process filling the whole
tensor and a rank filling only its shard (meta-device initialisation, framework.modules.
materialize) write the same numbers, and no rank ever needs the full tensor to get its part.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

Rule = tuple[str, float]  # ("normal", std) | ("ones", 0) | ("zeros", 0)


def row_seed(seed: int, name: str, row: int) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode()) * 7_919 + row) % (2**63 - 1)


@torch.no_grad()
def fill_(
    local: torch.Tensor,
    rule: Rule,
    seed: int,
    name: str,
    global_shape: Sequence[int] | None = None,
    offset: Sequence[int] | None = None,
) -> torch.Tensor:
    """Fill `local`, the block of a tensor of `global_shape` that starts at `offset` (default: the
    whole tensor), with the values `rule` gives the whole tensor."""
    kind, std = rule
    if kind in ("ones", "zeros"):
        return local.fill_(1.0 if kind == "ones" else 0.0)
    if kind != "normal":
        raise ValueError(f"unknown init rule {kind!r}")
    global_shape = tuple(local.shape if global_shape is None else global_shape)
    offset = tuple(offset or (0,) * len(global_shape))
    if local.numel() == 0:
        return local
    rows = local.shape[0] if local.dim() else 1
    row_shape = global_shape[1:]
    cols = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:], strict=True))
    out = torch.empty((rows, *local.shape[1:]), dtype=torch.float32)
    g = torch.Generator()
    for i in range(rows):
        g.manual_seed(row_seed(seed, name, offset[0] + i))
        row = torch.empty(row_shape, dtype=torch.float32).normal_(0.0, std, generator=g)
        out[i] = row[cols] if cols else row
    local.copy_(out.reshape(local.shape))
    return local
