"""Context parallel: our ring attention against full causal attention on real gloo ranks, the
zigzag sharding, and gpt training under cp (alone, with FSDP, with tensor parallel) following
the single-process trajectory, with the ring's sends and receives counted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framework.parallel.context import zigzag_indices, zigzag_shard, zigzag_unshard
from tests.helpers import run_workers

# (dtype, tolerance on outputs and gradients): fp64 and fp32 are the same arithmetic reordered;
# bf16 inputs against an fp32 reference, the ring accumulating in fp32 as flash attention does
DTYPES = {"float64": 1e-6, "float32": 1e-5, "bfloat16": 2e-2}
SHAPES = [(2, 3, 16, 8), (1, 2, 24, 16), (3, 1, 40, 4)]  # (B, H, T, D); T divides by 2 x 4


def _ring_worker(rank: int, world: int):
    import torch.distributed as dist

    from framework.parallel.ring import ring_attention

    group = dist.new_group(list(range(world)))
    errors = {}
    for shape_id, shape in enumerate(SHAPES):
        gen = torch.Generator().manual_seed(shape_id)
        q, k, v, dout = (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(4))
        for name in DTYPES:
            dtype = getattr(torch, name)
            # reference: full causal SDPA on the whole sequence, in fp64 (bf16: from the bf16-rounded inputs)
            full = [t.to(dtype).double().clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*full, is_causal=True)
            ref.backward(dout.to(dtype).double())
            local = [zigzag_shard(t.to(dtype), 2, world, rank).requires_grad_() for t in (q, k, v)]
            out = ring_attention(*local, group)
            out.backward(zigzag_shard(dout.to(dtype), 2, world, rank))
            want = [zigzag_shard(t, 2, world, rank) for t in (ref, *(t.grad for t in full))]
            got = [out, *(t.grad for t in local)]
            errors[(shape, name)] = [
                ((g.double() - w).abs().max() / w.abs().max().clamp(min=1e-30)).item()
                for g, w in zip(got, want, strict=True)
            ] + [out.dtype == dtype and all(t.grad.dtype == dtype for t in local)]
    return errors


@pytest.mark.parametrize("world", [2, 4])
def test_ring_attention_equals_full_causal_attention(world):
    results = run_workers(_ring_worker, world)
    assert set(results) == set(range(world))
    for rank, errors in results.items():
        assert len(errors) == len(SHAPES) * len(DTYPES)
        for (shape, name), (*rel, same_dtype) in errors.items():
            assert same_dtype, (rank, shape, name)
            for what, err in zip(("out", "dq", "dk", "dv"), rel, strict=True):
                assert err <= DTYPES[name], f"cp={world} rank {rank} {shape} {name}: {what} off by {err:.2e}"


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_shard_round_trip(cp):
    x = torch.arange(2 * 3 * 24).view(2, 24, 3)
    parts = [zigzag_shard(x, 1, cp, r) for r in range(cp)]
    assert torch.equal(zigzag_unshard(parts, 1), x)
    # rank r holds chunks r and 2cp-1-r: the same causal work on every rank
    chunk = 24 // (2 * cp)
    for r in range(cp):
        idx = zigzag_indices(24, cp, r)
        assert idx.tolist() == [
            *range(r * chunk, (r + 1) * chunk),
            *range((2 * cp - 1 - r) * chunk, (2 * cp - r) * chunk),
        ]
        assert torch.equal(parts[r], x[:, idx])
    work = {(zigzag_indices(24, cp, r) + 1).sum().item() for r in range(cp)}  # keys seen under a causal mask
    assert len(work) == 1
    with pytest.raises(ValueError, match="2 x cp"):
        zigzag_indices(26, 4, 0)
