"""The mask ring attention applies beyond plain causality: a sliding window (a query sees itself
and the ``window - 1`` tokens before it) and packed documents (a query sees only keys of its own
document), both given by global places in the sequence, which the zigzag sharding fixes: cp rank
``r`` holds chunks ``r`` and ``2cp-1-r`` of the ``2cp`` equal chunks (``zigzag_indices``).

A ``MaskRule`` is the model's window (a declaration, fixed for the run) and the document ids of
the whole batch (every cp rank reads the same batch, so each holds them whole: a block's key
documents are read from them by the block's source rank, with nothing sent). For the block of
keys of rank ``source`` against this rank's queries, ``block_mask`` is (key place <= query
place) & (query place - key place < window) & (same document); a block where it holds nowhere is
skipped. Masked blocks run as plain matmuls in the accumulation dtype; a query row with no key
in a block gets weight 0 there (its log-sum-exp is -inf), and every row sees at least itself in
its own block, so the merged rows are finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def zigzag_indices(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Global indices, in order, of the positions cp rank `rank` holds: chunks rank and 2cp-1-rank."""
    if length % (2 * cp):
        raise ValueError(f"context parallel: a sequence of {length} does not split into 2 x cp = {2 * cp} chunks")
    chunk = length // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat(
        [torch.arange(first, first + chunk, device=device), torch.arange(second, second + chunk, device=device)]
    )


@dataclass
class MaskRule:
    """What masks attention beyond causality: `window` (tokens a query sees, itself included; None:
    all before it) and `docs` (B, T): the document id of every place of the whole batch (None: one
    document). The batch splitter sets `docs` for each batch."""

    window: int | None = None
    docs: torch.Tensor | None = None

    def active(self) -> bool:
        return self.window is not None or self.docs is not None


def block_mask(rule: MaskRule, size: int, rank: int, source: int, local: int, device) -> torch.Tensor:
    """(B or 1, 1, local, local) bool: which keys of rank `source`'s shard this rank's queries see."""
    length = local * size
    qpos, kpos = zigzag_indices(length, size, rank, device), zigzag_indices(length, size, source, device)
    gap = qpos[:, None] - kpos[None, :]  # query place - key place
    mask = gap >= 0
    if rule.window is not None:
        mask = mask & (gap < rule.window)
    mask = mask[None, None]
    if rule.docs is not None:
        docs = rule.docs.to(device)
        if docs.size(1) != length:
            raise ValueError(f"ring attention: document ids of {docs.size(1)} places for a sequence of {length}")
        qdoc, kdoc = docs[:, qpos], docs[:, kpos]
        mask = mask & (qdoc[:, None, :, None] == kdoc[:, None, None, :])
    return mask


def masked_scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor) -> torch.Tensor:
    return (torch.matmul(q, k.transpose(-2, -1)) * scale).masked_fill(~mask, float("-inf"))


def masked_attend(q, k, v, scale: float, mask: torch.Tensor, acc: torch.dtype):
    """One block under `mask`: (output, log-sum-exp per query) in `acc`; rows with no key: 0, -inf."""
    s = masked_scores(q.to(acc), k.to(acc), scale, mask)
    lse = torch.logsumexp(s, dim=-1)
    safe = lse.masked_fill(torch.isinf(lse), 0.0)  # exp(-inf - 0) = 0: no weight, not nan
    return torch.matmul(torch.exp(s - safe.unsqueeze(-1)), v.to(acc)), lse


def masked_attend_backward(rows, k, v, scale: float, mask: torch.Tensor):
    """(dq, dk, dv) of one block under `mask`, given the rows' final output and log-sum-exp
    (`rows`: framework.parallel.ring.Rows), in the log-sum-exp's dtype."""
    q, dout, _, lse, delta = rows
    acc = lse.dtype
    q, k, v, dout = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    p = torch.exp(masked_scores(q, k, scale, mask) - lse.unsqueeze(-1))  # the row's true probabilities
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv
