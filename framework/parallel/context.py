"""Context parallel: each sequence split over the ranks of the mesh's ``cp`` axis, attention
computed by a ring (``framework.parallel.ring``, ``parallel.cp_impl=ring``, any device) or by
torch's own ``context_parallel`` (``cp_impl=torch``, CUDA SDPA kernels only).

Sharding is zigzag (torch's "head-tail" load balancing): the sequence is cut into ``2cp`` equal
chunks and cp rank ``r`` holds chunks ``r`` and ``2cp-1-r``, so under a causal mask every rank
has the same amount of attention to compute. Inputs, targets and the tokens' global positions
are sharded alike; everything but attention is per token, so only attention talks.

Around the model nothing is wrapped: the strategy hands the trainer a batch splitter (this
rank's part of inputs, targets and positions) and a context that, for the forward and the
backward (activation checkpointing recomputes attention there), routes
``torch.nn.functional.scaled_dot_product_attention`` to the ring, as torch's context_parallel
patches it. The model's attention must be plain causal SDPA, and its forward must take
``positions`` (the global index of each token).

Gradients: cp ranks hold the same parameters and read the same batch, a part of its tokens each.
FSDP shards over dp_shard x cp (cp ranks share model state as dp ranks do) and averages over
that group; the trainer weighs each rank's loss by dp x cp / (tokens of the global batch), so
every token counts once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from framework.parallel.ring import ring_attention
from framework.parallel.ring_mask import MaskRule, zigzag_indices


def zigzag_shard(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """This rank's zigzag part of `x` along `dim` (a new, contiguous tensor)."""
    return x.index_select(dim, zigzag_indices(x.size(dim), cp, rank, x.device))


def zigzag_unshard(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole tensor from every cp rank's part, in rank order (the inverse of zigzag_shard)."""
    halves = [p.chunk(2, dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim)


def ring_sdpa(group: dist.ProcessGroup, rule: MaskRule) -> Callable:
    """A drop-in for F.scaled_dot_product_attention on zigzag shards: causal, no dropout, within
    `rule`'s window and documents. Where the rule has either, the mask the model built for its own
    part of the sequence is that rule seen locally, and the ring applies the rule to every block."""

    @torch.compiler.disable  # a compiled block runs up to it and on from it: the ring's sends stay eager
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, **options):
        # F.scaled_dot_product_attention's keyword options: is_causal, scale, enable_gqa
        is_causal, scale = options.pop("is_causal", False), options.pop("scale", None)
        if rule.active() and attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask, is_causal = None, True  # the model's local view of the rule (see above)
        if attn_mask is not None or not is_causal or dropout_p > 0 or options.pop("enable_gqa", False) or options:
            raise NotImplementedError(
                "context parallel (cp_impl=ring) computes causal attention without a mask, dropout or grouped "
                f"heads; got is_causal={is_causal}, attn_mask={attn_mask is not None}, dropout_p={dropout_p}"
                + (f", {sorted(options)}" if options else "")
            )
        return ring_attention(query, key, value, group, scale, rule)

    return sdpa


@contextmanager
def attention_replaced(sdpa: Callable) -> Iterator[None]:
    """F.scaled_dot_product_attention is `sdpa` inside (process-wide: one model per process)."""
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextmanager
def torch_context_parallel(cp_mesh) -> Iterator[None]:
    """torch's ring SDPA (CUDA kernels only) over `cp_mesh`, on batches we shard ourselves: its
    head-tail load balancing is our zigzag order, so only the dispatch is torch's."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

    cp_attention._dispatch_mode = cp_attention._DispatchMode.MONKEY_PATCH
    balance = cp_attention._cp_options.enable_load_balance
    cp_attention._cp_options.enable_load_balance = True
    cp_attention._enable_context_parallel_dispatcher_impl(seq_dim=2, mesh=cp_mesh)
    try:
        yield
    finally:
        cp_attention._disable_context_parallel_dispatcher_impl()
        cp_attention._cp_options.enable_load_balance = balance


def document_positions(docs: torch.Tensor) -> torch.Tensor:
    """(B, T) place of each token within its document (document ids (B, T) in runs)."""
    places = torch.arange(docs.size(1), device=docs.device).expand_as(docs)
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    return places - torch.cummax(torch.where(starts, places, 0), dim=1).values


def batch_splitter(cp: int, rank: int, rule: MaskRule) -> Callable:
    """(inputs, target) of a whole batch -> (this rank's inputs, {"positions": ...}, target).
    Packed documents (inputs (tokens, document ids)): the ids go whole to the ring's `rule`, and
    the positions are this rank's places within their documents (B, T / cp)."""

    def split(inputs: tuple, target: torch.Tensor) -> tuple[tuple, dict, torch.Tensor]:
        if len(inputs) not in (1, 2):
            raise ValueError("context parallel takes token batches, with their document ids or without")
        tokens = inputs[0]
        positions = zigzag_indices(tokens.size(1), cp, rank, tokens.device)
        rule.docs = inputs[1] if len(inputs) == 2 else None
        if rule.docs is not None:
            positions = document_positions(rule.docs)[:, positions]
        return (zigzag_shard(tokens, 1, cp, rank),), {"positions": positions}, zigzag_shard(target, 1, cp, rank)

    return split


CP_IMPLS = ("ring", "torch")
TOKEN_DATA = ("text", "hf", "tokens")  # fixed-length token batches (tokens: documents too, data.pack)


def cp_config_problem(dims, cfg: DictConfig) -> tuple[str, str] | None:
    """What cp > 1 demands of the run's config (`dims`: its ParallelDims): the (key, message) of
    the first thing it cannot run with, or None."""
    from hydra.utils import get_object

    p, cp, target = cfg.parallel, dims.cp, cfg.model._target_
    model_cls = get_object(target)  # the model contract's declarations, read from the class
    forward = getattr(model_cls, "forward", None)  # a builder function's model (model=hf's) has none to read
    takes_positions = forward is not None and "positions" in inspect.signature(forward).parameters
    task = cfg.model.get("task") or getattr(model_cls, "task", None) or "lm"  # the contract's rule (contract.spec_of)
    name, packed = cfg.data.name, cfg.data.name == "varlen" and bool(cfg.data.get("pack"))
    seq_len = (cfg.data.pack_len if packed else cfg.data.get("seq_len")) or 0
    no_positions = (f"{target}'s forward takes no `positions` (the global index of each token, as models/gpt.py's "
                    "does): context parallel for it is not built" if forward is not None else
                    f"{target} builds a model whose attention is not this framework's (transformers'): context "
                    "parallel for it is not built")  # fmt: skip
    checks = [
        (p.get("cp_impl", "ring") in CP_IMPLS, "parallel.cp_impl", f"got {p.get('cp_impl')!r}; one of {CP_IMPLS}"),
        (task == "lm", "parallel.cp",
         f"context parallel splits a language model's sequences; {target} declares task={task!r}, which has none"),
        (takes_positions, "parallel.cp", no_positions),
        (name in TOKEN_DATA or packed, "data", f"context parallel takes fixed-length token batches (data="
         f"{','.join(TOKEN_DATA)}, or varlen with data.pack=true); got data={name}"),
        (not (cfg.data.get("pack") and p.get("cp_impl", "ring") == "torch"), "data.pack",
         "torch's context parallel has no document masks; use parallel.cp_impl=ring"),
        (seq_len % (2 * cp) == 0, f"data.{'pack_len' if packed else 'seq_len'}",  # no seq_len: data= above refuses
         f"zigzag sharding cuts each sequence into 2 x cp = {2 * cp} chunks; {seq_len} does not divide"),
        (p.get("version", 2) == 2, "parallel.version", "context parallel shards with FSDP2 (version=2) only"),
        (not cfg.model.get("dropout", 0.0), "model.dropout", "context parallel's attention has no dropout; set 0"),
    ]  # fmt: skip
    return next(((key, message) for ok, key, message in checks if not ok), None)


def check_cp_model(model: nn.Module) -> None:
    if "positions" not in inspect.signature(model.forward).parameters:
        raise ValueError(
            f"parallel.cp: {type(model).__name__}.forward takes no `positions`; context parallel needs the "
            "global index of each token (see models/gpt.py)"
        )


def apply_cp(model: nn.Module, cp_mesh, impl: str) -> tuple[Callable, Callable]:
    """(batch splitter, attention context) for context parallel over the 1-D mesh `cp_mesh`."""
    check_cp_model(model)
    rule = MaskRule(getattr(model, "sliding_window", None))  # the model's window; the batch's documents
    split = batch_splitter(cp_mesh.size(), cp_mesh.get_local_rank(), rule)
    if impl == "torch":
        return split, lambda: torch_context_parallel(cp_mesh)
    sdpa = ring_sdpa(cp_mesh.get_group(), rule)
    return split, lambda: attention_replaced(sdpa)
