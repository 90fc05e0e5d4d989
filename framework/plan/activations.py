"""Saved activations (gpt-like blocks): per block, the tensors autograd keeps, in units of one
micro-batch's residual stream (b x T x D): 16 in fp32 (the block input, the norms' outputs, q/k/v,
attention's output, the MLP's 4x-wide hidden before and after GELU), split 1/tp where tensor
parallel splits them and 1/cp along the sequence under context parallel (each rank holds T/cp
tokens; ring attention saves the same q, k, v, output and log-sum-exp as SDPA does); under autocast
the 16-bit copies each linear makes of its input and weight instead; a checkpointed block keeps
its input only. The embeddings' indices and the head's log-softmax (b x T x vocab, fp32) come on
top. A pipeline rank holds several micro-batches at its peak: how many is the schedule's (GPipe
all, 1F1B one per stage still ahead). FSDP's gathered parameters are here too: what is unsharded
at once.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

from omegaconf import DictConfig

from framework.plan.model import Layout, Shapes, stage_rank


def tokens_per_rank(cfg: DictConfig, layout: Layout) -> int:
    """Sequence positions one rank holds: the whole sequence, or its 1/cp under context parallel."""
    return cfg.data.seq_len // layout.cp


def checkpoint_every(cfg: DictConfig) -> int:
    """Every k-th block is checkpointed, whole or selectively (0: none)."""
    return cfg.memory.checkpoint_every if cfg.memory.name in ("checkpoint", "selective") else 0


def host_apart(cfg: DictConfig) -> bool:
    """A host memory apart from the device's: a plan for a GPU (plan.gpu) or a run on CUDA."""
    from framework.config import resolve_device

    return cfg.plan.get("gpu") is not None or resolve_device(cfg) == "cuda"


def offloaded(cfg: DictConfig, layout: Layout) -> bool:
    """memory=offload_activations where the host is apart: the blocks' saved tensors are in host
    memory (on the CPU the host is the device: they count as they are; tensor parallel's
    DTensors stay)."""
    return cfg.memory.name == "offload_activations" and host_apart(cfg) and layout.tp == 1


def selected_bytes(tokens: int, g: SimpleNamespace, cfg: DictConfig, layout: Layout) -> float | None:
    """What memory=selective keeps of a block beyond its input, for `tokens` positions on a rank:
    the outputs of the named operators (framework/levers/selective.py). Matmuls: column-parallel
    outputs split 1/tp, row-parallel ones whole (partial sums before their collective), in 16 bits
    unless fp32, every `matmul_every`-th in the block's order; attention: SDPA's output (1/tp) and
    its fp32 log-sum-exp; collectives: tensor parallel's outputs. None where the planner cannot
    tell (a routed MLP, an aten operator by name)."""
    names, tp, D = set(cfg.memory.save_ops), layout.tp, g.n_embd
    if names - {"matmul", "attention", "collectives"} or getattr(g, "moe_experts", 0):
        return None
    m = 4 if cfg.precision.name == "fp32" else 2
    kept = 0.0
    if "matmul" in names:
        kept += m * sum(width for width, _, _ in kept_matmuls(g, cfg, layout))
    if "attention" in names:
        kept += m * D / tp + 4 * g.n_head / tp
    if "collectives" in names and tp > 1:  # two per block: gathers to whole, or reductions
        kept += 2 * m * (D + (D / tp if layout.sequence_parallel else 0))
    return tokens * kept


def block_matmuls(g: SimpleNamespace, layout: Layout) -> list[tuple[float, float, bool]]:
    """A block's matmuls in the order its forward runs them, on a rank: (output width, weight
    elements, row-parallel). Llama: wq, wk, wv, wo, w1, w3, w2; gpt: q, k, v, proj, fc, proj.
    The column-parallel ones split 1/tp; the row-parallel ones output whole partial sums."""
    tp, D = layout.tp, g.n_embd
    if getattr(g, "ffn_hidden", None):
        kv, F = g.kv_width, g.ffn_hidden
        shapes = [(D, D), (kv, D), (kv, D), (D, -D), (F, D), (F, D), (D, -F)]
    else:
        shapes = [(D, D)] * 3 + [(D, -D), (4 * D, D), (D, -4 * D)]
    # (out, in): a negative in marks a row-parallel matmul (its input split 1/tp)
    return [(o, o * -i / tp, True) if i < 0 else (o / tp, o * i / tp, False) for o, i in shapes]


def kept_matmuls(g: SimpleNamespace, cfg: DictConfig, layout: Layout) -> list[tuple[float, float, bool]]:
    """The matmuls memory=selective keeps: every `matmul_every`-th. Under compile the partitioner
    saves only what backward reads: not the row-parallel outputs (wo, w2), which only the
    residual add takes."""
    kept = block_matmuls(g, layout)[:: cfg.memory.get("matmul_every", 1)]
    return [mm for mm in kept if not (cfg.compile and mm[2])]


def recomputed_matmul_share(g: SimpleNamespace, cfg: DictConfig, layout: Layout) -> float:
    """The share of a block's matmul FLOPs memory=selective runs again in backward: those whose
    outputs it does not keep (all of them where it keeps no matmul)."""
    if "matmul" not in cfg.memory.save_ops:
        return 1.0
    every, flops = cfg.memory.get("matmul_every", 1), [mm[1] for mm in block_matmuls(g, layout)]
    return 1 - sum(flops[::every]) / sum(flops)


def budgeted_bytes(b: int, g: SimpleNamespace, cfg: DictConfig, layout: Layout) -> float | None:
    """What memory=budget keeps of a gpt block (framework/levers/budget.py): below a budget of 1,
    the block's input and, of what the partitioner may keep beyond it (q, k, v, attention's output
    with its log-sum-exp, the mid-block residual, the MLP's 4x-wide hidden: the outputs of the
    matmuls and attention, which FLOPs make costly to recompute), the most bytes that fit in the
    budget's share of the gap between compile's own set and the input: torch's knapsack fills
    whole tensors. None where the planner cannot tell (a Llama block, routed experts, autocast's
    copies)."""
    if getattr(g, "ffn_hidden", None) or getattr(g, "moe_experts", 0) or _casts(cfg, layout):
        return None
    budget, full = cfg.memory.activation_budget, _all_kept_bytes(b, g, cfg, layout)
    if budget >= 1:
        return full
    tokens = b * tokens_per_rank(cfg, layout)
    floor, items = _budget_items(g, cfg)
    room = budget * (full / tokens - floor)
    fits = (sum(c) for r in range(len(items) + 1) for c in itertools.combinations(items, r) if sum(c) <= room)
    return tokens * (floor + max(fits))


def budget_kept_share(g: SimpleNamespace, cfg: DictConfig, layout: Layout) -> float:
    """The share of memory=budget's candidates (the matmuls' and attention's outputs) it keeps:
    the rest runs again in backward (1 under compile alone)."""
    kept = budgeted_bytes(1, g, cfg, layout)
    if kept is None or cfg.memory.activation_budget >= 1:
        return 1.0
    floor, items = _budget_items(g, cfg)
    return (kept / tokens_per_rank(cfg, layout) - floor) / sum(items)


def _budget_items(g: SimpleNamespace, cfg: DictConfig) -> tuple[float, list[float]]:
    """Per token: a gpt block's input, and what the partitioner may keep beyond it."""
    e = 4 if cfg.precision.name == "fp32" else 2
    return e * g.n_embd, [e * g.n_embd] * 4 + [e * g.n_embd + 4 * g.n_head, 4 * e * g.n_embd]


def micro_batch(cfg: DictConfig, layout: Layout) -> int:
    """Samples per micro-batch on one rank (a pipeline cuts the local batch into micro-batches)."""
    batch = max(cfg.data.rank_batch_sizes or [cfg.data.batch_size])
    if layout.pp > 1:
        return batch * cfg.accumulation_steps // layout.n_microbatches
    return batch


def _casts(cfg: DictConfig, layout: Layout) -> bool:
    """Autocast over fp32 parameters: each linear casts its input and weight to 16 bits (and saves
    the copies). Under FSDP's mixed precision the gathered parameters, and so the whole forward,
    are 16-bit already: nothing to cast."""
    return cfg.precision.name != "fp32" and not layout.fsdp


def block_activation_bytes(b: int, g: SimpleNamespace, cfg: DictConfig, layout: Layout, checkpointed: bool) -> float:
    """Bytes one gpt block (dims `g`: the model's planner_shape) saves for backward for a micro-batch of `b` samples."""
    T = tokens_per_rank(cfg, layout)
    seq_split = layout.tp if layout.sequence_parallel else 1
    e = 4 if cfg.precision.name == "fp32" or _casts(cfg, layout) else 2  # the residual stream's bytes
    if checkpointed:  # the block's input, kept for the recomputation; selective's kept outputs
        return e * b * T * g.n_embd / seq_split + (
            selected_bytes(b * T, g, cfg, layout) or 0 if cfg.memory.name == "selective" else 0
        )
    if cfg.memory.name == "budget" and cfg.compile:
        return budgeted_bytes(b, g, cfg, layout) or 0.0
    return _all_kept_bytes(b, g, cfg, layout)


def _all_kept_bytes(b: int, g: SimpleNamespace, cfg: DictConfig, layout: Layout) -> float:
    """A block with no lever, as autograd saves it (compile's partitioner keeps as much)."""
    T = tokens_per_rank(cfg, layout)
    u = b * T * g.n_embd  # elements of the residual stream
    tp, seq_split = layout.tp, (layout.tp if layout.sequence_parallel else 1)
    e = 4 if cfg.precision.name == "fp32" or _casts(cfg, layout) else 2  # the residual stream's bytes
    if getattr(g, "ffn_hidden", None):
        return _llama_block_bytes(b * T, g, e, layout, _casts(cfg, layout))
    small = e * 4 * b * T / seq_split + 4 * b * g.n_head * T / tp  # two norms' mean and rstd; logsumexp
    if not _casts(cfg, layout):
        # split 1/tp: q, k, v, attention's output, the MLP's hidden before and after GELU (12);
        # the norms' outputs are whole (gathered); the block input and the mid-residual follow
        # the residual stream's layout
        return e * u * (2 + 12 / tp + 2 / seq_split) + small
    # autocast: each linear saves its own 16-bit copy of input and weight; the residual stays fp32
    casts = 2 * u * (3 + 1) + 2 * 12 * g.n_embd**2 / tp
    return 4 * u * 2 / seq_split + 2 * u * 12 / tp + casts + small


def _llama_block_bytes(tokens: int, g: SimpleNamespace, e: int, layout: Layout, casts: bool = False) -> float:
    """A Llama block (models/llama.py: RMSNorm in fp32, rotary embeddings, GQA, SwiGLU), per token,
    as autograd saves it: each norm its fp32 input, its normalised e-byte value (both local under
    sequence parallel) and its output, which the linears take whole; attention the rotated q, the
    repeated k and v, SDPA's output, its reshaped copy (1/tp each) and the logsumexp; the MLP its
    two projections, silu's output and their product (ffn_hidden wide, 1/tp). Under autocast each
    linear also keeps a 16-bit copy of its weight."""
    tp, D, F = layout.tp, g.n_embd, g.ffn_hidden
    seq_split = tp if layout.sequence_parallel else 1
    if casts:  # autocast over fp32 weights: _llama_autocast_bytes
        return _llama_autocast_bytes(tokens, g, layout)
    routed = getattr(g, "moe_experts", 0)  # under sequence parallel it takes its T / tp tokens local
    norms = 2 * (4 + e) * D / seq_split + e * D * (1 + (1 / seq_split if routed else 1)) + 8 / seq_split
    attention = 5 * e * D / tp + 4 * g.n_head / tp
    mlp = 4 * e * F / tp if not routed else _routed_bytes(g, e, layout) / seq_split
    weights = 2 * (2 * D * D + 2 * D * g.kv_width + 3 * D * F) / tp if e == 2 and layout.fsdp == 0 else 0
    return tokens * (norms + attention + mlp) + weights


def _llama_autocast_bytes(tokens: int, g: SimpleNamespace, layout: Layout) -> float:
    """A Llama block under autocast (16-bit compute over fp32 weights), per token, as autograd
    saves it (traced on models/llama.py): each norm's fp32 input and normalised value and its
    reciprocal RMS; each linear's own 16-bit copy of its input (q, k, v, w1 and w3 take the
    norms' whole outputs, wo the attention's 1/tp) and of its weight; SDPA's q, repeated k and
    v and output in 16 bits, its fp32 log-sum-exp; the MLP's two projections, silu's output and
    their product in 16 bits."""
    tp, D, F = layout.tp, g.n_embd, g.ffn_hidden
    seq_split = tp if layout.sequence_parallel else 1
    norms = (16 * D + 8) / seq_split
    inputs = 2 * 5 * D + 2 * D / tp
    attention = (8 * D + 4 * g.n_head) / tp
    routed = getattr(g, "moe_experts", 0)  # under sequence parallel it takes its T / tp tokens local
    inputs -= 2 * 2 * D * (1 - 1 / seq_split) if routed else 0  # w1 and w3 are the routed layer's
    mlp = 8 * F / tp if not routed else _routed_bytes(g, 2, layout) / seq_split
    weights = 2 * (2 * D * D + 2 * D * g.kv_width + 3 * D * F) / tp
    return tokens * (norms + inputs + attention + mlp) + weights


def _routed_bytes(g: SimpleNamespace, e: int, layout: Layout) -> float:
    """A routed layer (models/moe.py) in place of the MLP, per token it routes (all of them on every
    tp rank; T / tp of them under sequence parallel, framework/parallel/routed.py): each
    of its top_k assignments' gathered row, its expert's two projections, silu's output and their
    product (moe_hidden wide), the expert's output row and its weighted copy, its fp32 routing
    weight and the three int64 indices that choose, sort and scatter it; the router's fp32 scores
    and the token's kept flag; under expert parallel the rows the mean rank received."""
    k, h, D = g.moe_top_k, g.moe_hidden, g.n_embd
    per_assignment = 4 * e * h + 3 * e * D + 4 + 3 * 8 + (e * D if layout.ep > 1 else 0)
    return k * per_assignment + 4 * g.moe_experts + 4 + 4 * e * g.moe_shared_hidden


def head_activation_bytes(b: int, g: SimpleNamespace, cfg: DictConfig, layout: Layout) -> float:
    """The final norm, the output head and the fp32 log-softmax, for `b` samples."""
    T = tokens_per_rank(cfg, layout)
    u, seq_split = b * T * g.n_embd, (layout.tp if layout.sequence_parallel else 1)
    vocab_split = layout.tp if layout.loss_parallel else 1
    e = 4 if cfg.precision.name == "fp32" or _casts(cfg, layout) else 2
    if getattr(g, "norm", None) == "rms":  # its fp32 input and normalised value, and a 1/rms per token
        norm = ((4 + e) * u + 4 * b * T) / seq_split
    else:
        norm = (e * u + 2 * e * b * T) / seq_split
    head_input = 2 * u + 2 * g.vocab_size * g.n_embd / layout.tp if _casts(cfg, layout) else e * u
    return norm + head_input + 4 * b * T * g.vocab_size / vocab_split + 8 * b * T + 4


def in_flight(stage: int, layout: Layout) -> int:
    """Micro-batches whose activations a pipeline stage holds at its peak."""
    m, p = layout.n_microbatches, layout.stages
    if layout.pp == 1:
        return 1
    if layout.schedule == "GPipe":
        return m
    if layout.schedule == "1F1B":
        return min(m, layout.pp - stage)
    if layout.schedule == "Interleaved1F1B":
        return _interleaved_in_flight(stage, layout)
    # zero-bubble, one round (m = stages): one per stage ahead, as measured. Over several rounds
    # they hold more than this (+35% at two and four rounds of the smoke gpt and the 100M one),
    # and more than their action order's forwards-not-yet-weight-backwarded explain: not modelled,
    # so parallel=auto searches them at one round only
    return min(m, p - stage)


def _interleaved_in_flight(stage: int, layout: Layout) -> int:
    """Interleaved 1F1B: rank r runs (v-1)·p + 2(p-1-r) warm-up forwards and one more before its
    first backward, in rounds of p micro-batches through its stages in turn."""
    m, p, v = layout.n_microbatches, layout.pp, layout.stages_per_rank
    rank, local = stage_rank(stage, layout), stage // layout.pp
    forwards = min(v * m, (v - 1) * p + 2 * (p - 1 - rank) + 1)
    held = 0
    for k in range(forwards):  # the k-th forward runs local stage (k // p) % v
        held += (k // p) % v == local
    return held


def activation_bytes(shapes: Shapes, cfg: DictConfig, layout: Layout) -> int | None:
    """Peak bytes saved for backward on the rank holding most: for models that declare a gpt-like
    block (``planner_shape``); None (not predicted) for others."""
    if shapes.gpt is None:
        return None
    b, g = micro_batch(cfg, layout), SimpleNamespace(**shapes.gpt)
    every = checkpoint_every(cfg)
    if cfg.memory.name == "selective" and selected_bytes(1, g, cfg, layout) is None:
        return None
    if cfg.memory.name == "budget" and cfg.compile and budgeted_bytes(1, g, cfg, layout) is None:
        return None
    per_rank: dict[int, float] = defaultdict(float)
    for stage, layers in enumerate(shapes.stage_layers):
        kept = len(layers[::every]) if every else 0  # checkpointed blocks keep their input (and selected outputs)
        saved = kept * block_activation_bytes(b, g, cfg, layout, True)
        if not offloaded(cfg, layout):  # offloaded: the other blocks' saved tensors are in host memory
            saved += (len(layers) - kept) * block_activation_bytes(b, g, cfg, layout, False)
        if stage == 0:
            saved += 8 * b * tokens_per_rank(cfg, layout) + 8 * tokens_per_rank(
                cfg, layout
            )  # token and position indices
        if stage == layout.stages - 1:
            saved += head_activation_bytes(b, g, cfg, layout)
        per_rank[stage_rank(stage, layout)] += saved * in_flight(stage, layout)
    return round(max(per_rank.values()))


def gathered_bytes(shapes: Shapes, cfg: DictConfig, layout: Layout) -> int:
    """FSDP's unsharded parameters at once: two units (the one running and the one prefetched)
    when units reshard after forward, else every unit of the rank."""
    if not layout.fsdp:
        return 0
    units: dict[str, float] = {}
    size = 2 if cfg.precision.name != "fp32" else 4
    for p in shapes.params:  # bytes gathered: the mixed precision's, or a converter's (float8's 1)
        if p.expert and layout.ep > 1:  # a unit of its own: this rank's experts / ep, whole over tp
            units[f"{p.unit}:experts"] = units.get(f"{p.unit}:experts", 0) + size * (math.prod(p.shape) // layout.ep)
            continue
        units[p.unit] = units.get(p.unit, 0) + (p.gather_bytes or size) * (math.prod(p.shape) // layout.tp)
    if layout.reshard:
        return int(sum(sorted(units.values())[-2:]))
    return int(sum(units.values()) // layout.pp)


def offloaded_bytes(shapes: Shapes, cfg: DictConfig, layout: Layout) -> float:
    """What memory=offload_activations copies to the host and back per step on the busiest rank:
    its blocks' saved tensors, each micro-batch's (0 where nothing leaves the device)."""
    if not offloaded(cfg, layout) or shapes.gpt is None:
        return 0.0
    b, g = micro_batch(cfg, layout), SimpleNamespace(**shapes.gpt)
    per_rank: dict[int, float] = defaultdict(float)
    for stage, layers in enumerate(shapes.stage_layers):
        per_rank[stage_rank(stage, layout)] += len(layers) * block_activation_bytes(b, g, cfg, layout, False)
    micro = layout.n_microbatches if layout.pp > 1 else cfg.accumulation_steps
    return micro * max(per_rank.values())
