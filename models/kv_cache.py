"""A key/value cache for decoding: each attention layer keeps the keys and values of the tokens it
has seen, so a new token attends to them without the sequence being run again.

Plain single-device code, as the models are. An attention module that supports it has a `cache`
attribute (None while training) and a `cache_shape()` method, (key/value heads, head dim);
`caching(model, batch, max_len)` gives each such module a KVCache for the duration of a
generation. Inside it, a forward takes only the tokens not yet seen: their positions continue
from what the cache holds (KVCache.pos), and they attend causally to every cached token.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class KVCache:
    """One layer's keys and values, (batch, heads, max_len, head_dim), filled up to `pos`."""

    def __init__(self, batch: int, heads: int, max_len: int, head_dim: int, dtype: torch.dtype, device):
        self.k = torch.zeros(batch, heads, max_len, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.pos = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' keys and values (batch, heads, T, head_dim); every cached one's back."""
        end = self.pos + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"the KV cache holds {self.k.shape[2]} tokens; {end} were given")
        self.k[:, :, self.pos : end] = k
        self.v[:, :, self.pos : end] = v
        self.pos = end
        return self.k[:, :, :end], self.v[:, :, :end]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Attention of the last q.shape[2] positions over all k.shape[2], causally: query i (at
    position start + i) sees keys 0..start + i (within a sliding `window`: the last `window` of them)."""
    T, total = q.shape[2], k.shape[2]
    start = total - T
    if window is None or total <= window:
        if start == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if T == 1:  # the newest token sees everything
            return F.scaled_dot_product_attention(q, k, v)
    keys, queries = torch.arange(total, device=q.device), torch.arange(start, total, device=q.device)
    behind = queries[:, None] - keys[None, :]
    seen = behind >= 0 if window is None else (behind >= 0) & (behind < window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=seen)


def cached_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "cache_shape") and hasattr(m, "cache")]


def supports_cache(model: nn.Module) -> bool:
    return bool(cached_modules(model))


@contextmanager
def caching(model: nn.Module, batch: int, max_len: int) -> Iterator[None]:
    """Give each attention layer of `model` a cache of `max_len` tokens while inside."""
    modules = cached_modules(model)
    weight = next(model.parameters())
    for m in modules:
        heads, head_dim = m.cache_shape()
        m.cache = KVCache(batch, heads, max_len, head_dim, weight.dtype, weight.device)
    root = hasattr(model, "cache") and model not in modules  # a model whose positions start at the cache's
    if root and modules:
        model.cache = modules[0].cache
    try:
        yield
    finally:
        for m in modules + [model] * root:
            m.cache = None


def cache_position(model: nn.Module) -> int:
    """The tokens the model's caches hold (0 outside `caching`)."""
    modules = cached_modules(model)
    return modules[0].cache.pos if modules and modules[0].cache is not None else 0
