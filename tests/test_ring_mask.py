"""Ring attention within a sliding window and packed documents (framework/parallel/ring_mask.py)
against full attention under the same mask on one process: on two gloo ranks, forward and
gradients, with blocks the mask wholly hides (skipped) among them; the batch splitter's
places within documents; and packed documents trained under cp and sequence parallel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framework.parallel.context import batch_splitter, document_positions, zigzag_indices, zigzag_shard
from framework.parallel.ring_mask import MaskRule
from tests.helpers import run_workers

T = 16  # two ranks: chunks of 4, rank 0 holds places 0-3 and 12-15, rank 1 places 4-11
DOCS = torch.tensor([[0] * 3 + [1] * 7 + [2] * 6, [0] * 10 + [1] * 6])  # (B, T): runs of documents
CASES = {"window 1": (1, None), "window 5": (5, None), "documents": (None, DOCS), "both": (6, DOCS)}


def full_mask(window: int | None, docs: torch.Tensor | None) -> torch.Tensor:
    places = torch.arange(T)
    gap = places[:, None] - places[None, :]
    mask = (gap >= 0) & (gap < (window or T + 1))
    mask = mask[None, None].expand(2, 1, T, T)
    return mask if docs is None else mask & (docs[:, None, :, None] == docs[:, None, None, :])


def _masked_ring_worker(rank: int, world: int):
    import torch.distributed as dist

    from framework.parallel.context import ring_sdpa
    from framework.parallel.ring import ring_attention

    group = dist.new_group(list(range(world)))
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 3, T, 8, generator=gen, dtype=torch.float64) for _ in range(4))
    errors = {}
    for case, (window, docs) in CASES.items():
        for dtype in (torch.float64, torch.float32):
            full = [t.to(dtype).double().clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*full, attn_mask=full_mask(window, docs))
            ref.backward(dout)
            local = [zigzag_shard(t.to(dtype), 2, world, rank).requires_grad_() for t in (q, k, v)]
            out = ring_attention(*local, group, rule=MaskRule(window, docs))
            out.backward(zigzag_shard(dout.to(dtype), 2, world, rank))
            want = [zigzag_shard(t, 2, world, rank) for t in (ref, *(t.grad for t in full))]
            got = [out, *(t.grad for t in local)]
            errors[(case, str(dtype))] = max(
                (g.double() - w).abs().max().item() for g, w in zip(got, want, strict=True)
            )
    # SDPA swapped for the ring: the mask a model builds for its own part is the rule's, seen locally
    rule, local = MaskRule(6, DOCS), [zigzag_shard(t, 2, world, rank) for t in (q, k, v)]
    own = zigzag_shard(zigzag_shard(full_mask(6, DOCS), 2, world, rank), 3, world, rank)
    swapped = ring_sdpa(group, rule)(*local, attn_mask=own)
    errors[("swapped sdpa", "float64")] = (swapped - ring_attention(*local, group, rule=rule)).abs().max().item()
    return errors


def test_ring_attention_within_a_window_and_documents_equals_full_masked_attention():
    results = run_workers(_masked_ring_worker, 2)
    for rank, errors in results.items():
        assert len(errors) == 2 * len(CASES) + 1
        for (case, dtype), err in errors.items():
            assert err <= (1e-10 if "64" in dtype else 1e-5), f"rank {rank} {case} {dtype}: off by {err:.2e}"


def test_document_positions_restart_at_each_document():
    pos = document_positions(DOCS)
    assert pos[0].tolist() == [0, 1, 2, *range(7), *range(6)]
    assert pos[1].tolist() == [*range(10), *range(6)]


def test_the_splitter_hands_the_batchs_documents_to_the_ring():
    rule, tokens = MaskRule(), torch.arange(2 * T).view(2, T)
    split = batch_splitter(2, 1, rule)
    (x,), kwargs, y = split((tokens, DOCS), tokens)
    assert rule.docs is DOCS and torch.equal(x, tokens[:, zigzag_indices(T, 2, 1)]) and torch.equal(y, x)
    assert torch.equal(kwargs["positions"], document_positions(DOCS)[:, zigzag_indices(T, 2, 1)])
    (x,), kwargs, _ = split((tokens,), tokens)  # a batch of one document each: global places, no ids
    assert rule.docs is None and torch.equal(kwargs["positions"], zigzag_indices(T, 2, 1))


def test_packed_documents_train_under_cp_and_sequence_parallel_as_one_process(tmp_path):
    """gpt on packed variable-length documents: cp x2 (the ring masks by document) and tp x2 with
    sequence parallel (the (B, T) places within documents split along the sequence) give one
    process's losses (both were refused before)."""
    from omegaconf import OmegaConf

    from framework.run.sweep import run_configs
    from framework.run.trainer import run
    from tests.helpers import losses, world_config

    packed = ["experiment=smoke", "logger=none", "steps=4", "model=gpt", "data=varlen", "data.pack=true",
              "data.pack_len=32", "data.batch_size=4", "metrics.sample_every=0"]  # fmt: skip
    run(OmegaConf.create(world_config([*packed, "parallel=none"], 1)), str(tmp_path / "one"), {"parallel": "none"})
    layouts = {"cp": ["parallel=cp"], "tp": ["parallel=tp", "parallel.sequence_parallel=true"]}
    got = run_configs({k: world_config([*packed, *v], 2) for k, v in layouts.items()}, 2, str(tmp_path))
    assert got["cp"]["parallel_dims"]["cp"] == 2 and got["tp"]["parallel_dims"]["tp"] == 2
    for name in layouts:
        assert losses(tmp_path / name) == pytest.approx(losses(tmp_path / "one"), rel=1e-5), name
