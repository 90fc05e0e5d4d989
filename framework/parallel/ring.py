"""Ring attention: causal attention over a sequence split across the ranks of a process group,
as a ``torch.autograd.Function`` over point-to-point sends and receives (any backend that has
them: gloo, NCCL), on any device and in any dtype.

Each rank holds the zigzag shard of its queries, keys and values (``framework.parallel.context``):
chunks ``r`` and ``2cp-1-r`` of the ``2cp`` equal chunks of the sequence. Forward: the key/value
block of every rank travels once round the ring (``cp-1`` hops); while the next block is in
flight, this rank attends to the block it has and merges the partial result into its output by
the online-softmax rule (outputs weighted by ``exp(lse_part - lse_total)``, the log-sum-exps
added in log space). Backward recomputes each block's probabilities from the saved log-sum-exp
(flash attention's backward), sends the key/value blocks round again, and passes each block's
key/value gradient along with it, so that after ``cp`` hops every rank holds the gradient of its
own keys and values, summed over all queries.

With zigzag sharding every rank does the same work at every step: against its own block, causal
attention on its two chunks; against a block from a lower rank, all its queries on that block's
first chunk; against one from a higher rank, its second chunk's queries on the whole block. Both
cost half a full block.

A sliding window or packed documents (a ``MaskRule``, framework/parallel/ring_mask.py) mask each
block by the global places of its queries and keys and their document ids; a block they mask
wholly is skipped (no compute; it still travels on), the others run as masked matmuls.

Blocks are merged, and gradients accumulated, in float32 (float64 inputs: float64) whatever the
input dtype, as flash attention accumulates; autocast is switched off inside. On CPU, float32 and
bfloat16 blocks run torch's fused flash kernel (which returns the log-sum-exp the merge needs,
and whose backward takes the row's final output and log-sum-exp); elsewhere, and in float64,
plain matmuls.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from framework.parallel.ring_mask import MaskRule, block_mask, masked_attend, masked_attend_backward

KV_TAG, GRAD_TAG = 1, 2  # separate message streams between the same two ranks (gloo matches tags)


class Ring:
    """This rank's neighbours in `group`: it sends to the next rank and receives from the previous."""

    def __init__(self, group: dist.ProcessGroup):
        self.group, self.size, self.rank = group, group.size(), group.rank()
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def exchange(self, send: torch.Tensor, tag: int) -> tuple[torch.Tensor, list]:
        """Start sending `send` to the next rank and receiving a tensor like it from the previous;
        returns the receive buffer and the works to wait for before reading it (or reusing `send`)."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for work in works:
        work.wait()


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if causal:  # square block on the diagonal: query i sees keys 0..i
        n = s.size(-1)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)


def attend(q, k, v, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: (output, log-sum-exp of the scores per query), in the accumulation dtype."""
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out.float(), lse
    acc = _accumulation_dtype(q.dtype)
    s = _scores(q.to(acc), k.to(acc), scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(acc)), lse


class Rows(NamedTuple):
    """What backward needs of a set of query rows: the queries, the output's gradient, the row's
    final output, its log-sum-exp and delta = rowsum(dout * out) (over every block of the row)."""

    q: torch.Tensor
    dout: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    delta: torch.Tensor

    def part(self, r: slice) -> Rows:
        """The rows `r` (along the sequence) of each."""
        return Rows(self.q[..., r, :], self.dout[..., r, :], self.out[..., r, :], self.lse[..., r], self.delta[..., r])


def attend_backward(rows: Rows, k, v, scale: float, causal: bool):
    """Gradients (dq, dk, dv) of one block, in the accumulation dtype, given the rows' final
    output and log-sum-exp (over every block of the row)."""
    q, dout, out, lse, delta = rows
    acc = lse.dtype
    if _fused(q):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
        return tuple(g.to(acc) for g in grads)
    q, k, v, dout = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    p = torch.exp(_scores(q, k, scale, causal) - lse.unsqueeze(-1))  # the row's true probabilities
    dv = torch.matmul(p.transpose(-2, -1), dout)
    ds = p * (torch.matmul(dout, v.transpose(-2, -1)) - delta.unsqueeze(-1))
    return torch.matmul(ds, k) * scale, torch.matmul(ds.transpose(-2, -1), q) * scale, dv


def _merge(out: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Fold a block's (output, lse) over the same rows into the running ones, in place."""
    total = torch.logaddexp(lse, part_lse)
    out.mul_(torch.exp(lse - total).unsqueeze(-1)).add_(part * torch.exp(part_lse - total).unsqueeze(-1))
    lse.copy_(total)


def _masked_block(q, kv, ring: Ring, step: int, scale: float, rule: MaskRule):
    """(output, lse) of the block held at `step` under `rule`, or None where it masks all of it."""
    mask = block_mask(rule, ring.size, ring.rank, (ring.rank - step) % ring.size, q.size(-2), q.device)
    if step and not bool(mask.any()):  # a block wholly outside the window or the documents: skipped
        return None
    return masked_attend(q, kv[0], kv[1], scale, mask, _accumulation_dtype(q.dtype))


def ring_forward(q, k, v, ring: Ring, scale: float, rule: MaskRule | None = None):
    """This rank's attention output (accumulation dtype) and log-sum-exp over the whole sequence
    (`rule`: a window or documents beyond causality, framework.parallel.ring_mask)."""
    half = q.size(-2) // 2
    kv = torch.stack([k, v])  # one message per hop
    out = lse = None
    for step in range(ring.size):
        if step + 1 < ring.size:  # the next block travels while this one is computed
            incoming, works = ring.exchange(kv, KV_TAG)
        source = (ring.rank - step) % ring.size
        if rule is not None:  # its own block (step 0) comes first: every row sees itself there
            part = _masked_block(q, kv, ring, step, scale, rule)
            if step == 0:
                out, lse = part
            elif part is not None:
                _merge(out, lse, *part)
        elif step == 0:
            out, lse = attend(q, kv[0], kv[1], scale, causal=True)
        elif source < ring.rank:  # every query sees the block's first (earlier) chunk only
            first_k, first_v = kv[0, ..., :half, :].contiguous(), kv[1, ..., :half, :].contiguous()
            _merge(out, lse, *attend(q, first_k, first_v, scale, causal=False))
        else:  # only this rank's second (later) chunk sees the block, all of it
            _merge(out[..., half:, :], lse[..., half:], *attend(q[..., half:, :], kv[0], kv[1], scale, causal=False))
        if step + 1 < ring.size:
            _wait(works)
            kv = incoming
    return out, lse


def _block_grads(rows: Rows, kv, scale: float, ring: Ring, step: int, rule: MaskRule | None):
    """(dq, dkv) of this rank's query rows against the block `kv` held at `step`."""
    q, lse = rows.q, rows.lse
    half = q.size(-2) // 2
    source = (ring.rank - step) % ring.size
    dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
    dkv = torch.zeros(kv.shape, dtype=lse.dtype, device=q.device)
    if rule is not None:
        mask = block_mask(rule, ring.size, ring.rank, source, q.size(-2), q.device)
        if step == 0 or bool(mask.any()):
            dq[:], dkv[0], dkv[1] = masked_attend_backward(rows, kv[0], kv[1], scale, mask)
    elif step == 0:
        dq[:], dkv[0], dkv[1] = attend_backward(rows, kv[0], kv[1], scale, causal=True)
    elif source < ring.rank:
        first_k, first_v = kv[0, ..., :half, :].contiguous(), kv[1, ..., :half, :].contiguous()
        dq[:], dkv[0, ..., :half, :], dkv[1, ..., :half, :] = attend_backward(rows, first_k, first_v, scale, False)
    else:
        r = slice(half, None)
        dq[..., r, :], dkv[0], dkv[1] = attend_backward(rows.part(r), kv[0], kv[1], scale, False)
    return dq, dkv


def ring_backward(rows: Rows, k, v, ring: Ring, scale: float, rule: MaskRule | None = None):
    """(dq, dk, dv) of this rank's shards. Key/value blocks go round as in forward; each block's
    gradient accumulator follows it one hop behind and comes home after the last hop."""
    kv = torch.stack([k, v])
    dq = None
    grad_in = grad_works = None
    for step in range(ring.size):
        if step + 1 < ring.size:
            incoming, works = ring.exchange(kv, KV_TAG)
        dq_part, dkv = _block_grads(rows, kv, scale, ring, step, rule)
        dq = dq_part if dq is None else dq.add_(dq_part)
        if grad_works is not None:  # the accumulated gradient of this block from the previous rank
            _wait(grad_works)
            dkv.add_(grad_in)
        grad_in, grad_works = ring.exchange(dkv, GRAD_TAG)
        if step + 1 < ring.size:
            _wait(works)
            kv = incoming
    _wait(grad_works)  # the last hop brings this rank's own keys' and values' gradient back
    return dq, grad_in[0], grad_in[1]


class RingAttention(torch.autograd.Function):
    """Causal attention of zigzag-sharded (B, H, 2c, D) q, k, v over the ranks of `group`, within
    `rule`'s window and documents where it has them (`how`: (scale, rule))."""

    @staticmethod
    def forward(ctx, q, k, v, group, how):
        ring, (scale, rule) = Ring(group), how
        # this batch's rule, kept for backward (the splitter sets the next batch's documents on `rule`)
        rule = MaskRule(rule.window, rule.docs) if rule is not None and rule.active() else None
        with torch.autocast(q.device.type, enabled=False):
            out, lse = ring_forward(q, k, v, ring, scale, rule)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.rule = ring, scale, rule
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast(dout.device.type, enabled=False):
            delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)
            dq, dk, dv = ring_backward(Rows(q, dout, out, lse, delta), k, v, ctx.ring, ctx.scale, ctx.rule)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def ring_attention(q, k, v, group: dist.ProcessGroup, scale: float | None = None, rule: MaskRule | None = None):
    """Causal attention of this rank's zigzag shards q, k, v (B, H, 2c, D) over `group`'s ranks,
    within `rule`'s sliding window and documents (framework.parallel.ring_mask) where it has them."""
    if group.size() < 2:
        raise ValueError("ring attention needs a group of at least 2 ranks")
    if q.size(-2) % 2 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"ring attention: q, k, v must be equal (B, H, 2c, D) shards, got {q.shape}, {k.shape}")
    return RingAttention.apply(q, k, v, group, (q.size(-1) ** -0.5 if scale is None else scale, rule))
