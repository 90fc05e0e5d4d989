"""The time model: seconds per optimizer step of one layout on a machine profile.

step = compute / (1 - bubble) + exposed communication
compute = the rank's share of the step's hardware FLOPs at the profile's matmul rate
          + per-op dispatch overhead x the ops a rank issues per step
a collective = calls x latency + wire bytes / bandwidth (within a node, or across nodes for a
               group wider than a node); data-parallel traffic hides behind `overlap` of the
               compute (DDP's buckets in backward, FSDP's prefetch); tensor parallel's and the
               ring's blocking exchanges never do.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

from omegaconf import DictConfig

from framework.plan.activations import (
    budget_kept_share,
    checkpoint_every,
    offloaded_bytes,
    recomputed_matmul_share,
    tokens_per_rank,
)
from framework.plan.model import Layout, Shapes, stage_rank
from framework.plan.ops import BACKWARD_ATTENTION, BACKWARD_BYTES, BACKWARD_OPS, Region, Trace
from framework.plan.state import optimizer_step_cost


def bubble(layout: Layout) -> float:
    """Idle share of a pipeline step: (p-1)/(v·m + p-1) for v stages per rank and m micro-batches
    (GPipe and 1F1B: v=1); the zero-bubble schedules fill about two thirds of it with the weight
    gradients they split off."""
    if layout.pp == 1:
        return 0.0
    p, m, v = layout.pp, layout.n_microbatches, layout.stages_per_rank
    fill = 3 if "ZeroBubble" in layout.schedule else 1
    return (p - 1) / (fill * v * m + p - 1)


def step_tokens(cfg: DictConfig, layout: Layout) -> int:
    batch = sum(cfg.data.rank_batch_sizes) if cfg.data.rank_batch_sizes else cfg.data.batch_size * layout.dp
    return batch * cfg.accumulation_steps * cfg.data.get("seq_len", 1)


def ops_per_step(shapes: Shapes, cfg: DictConfig, layout: Layout) -> float:
    """Operators one rank dispatches per step, where no trace prices them (a model the planner
    has no forward of): per block and micro-batch about 40 forward and 80 backward, again a
    forward's worth in a checkpointed block, the optimizer's few per parameter tensor, and the
    step's own bookkeeping (about 200)."""
    if shapes.gpt is None:
        return 0.0
    blocks = shapes.gpt["n_layer"] / layout.pp
    every = checkpoint_every(cfg)
    recomputed = blocks / every if every else 0
    micro = layout.n_microbatches if layout.pp > 1 else cfg.accumulation_steps
    per_block = 120 * (1.5 if layout.tp > 1 else 1.0) + 20 * (layout.cp > 1) * layout.cp
    return micro * (per_block * blocks + 40 * recomputed + 30) + 12 * len(shapes.params) / layout.pp + 200


def compute_s(cfg: DictConfig, layout: Layout, shapes: Shapes, profile, trace: Trace | None) -> tuple[float, float]:
    """(the slowest rank's, the mean rank's) seconds of arithmetic per optimizer step, on the
    threads a rank has to itself: the traced forward of its pipeline stage, priced operator by
    operator (framework.plan.ops), its backward, checkpointing's second forward, the optimizer
    over its share of the parameters, and the data-parallel gradient copies. Without a trace or a
    probed machine: the FLOPs at the profile's peak, plus a dispatch overhead per estimated operator."""
    kernels = profile.kernels
    # an optimizer whose step multiplies whole matrices (Muon): its FLOPs on the busiest pipeline rank
    optimizer_s = max((flops for flops, _ in optimizer_step_cost(shapes, cfg, layout)), default=0) / profile.peak_flops
    if trace is None or kernels is None:
        flops = shapes.hardware_flops_per_token + _budget_recomputed_flops(shapes, cfg, layout)
        flops *= step_tokens(cfg, layout) / max(layout.world, 1)
        seconds = flops / profile.peak_flops + ops_per_step(shapes, cfg, layout) * profile.op_overhead_s + optimizer_s
        return seconds, seconds * profile.share  # the profile's peak is already a rank's share of the cores
    micro = layout.n_microbatches if layout.pp > 1 else cfg.accumulation_steps
    if cfg.get("compile") and hasattr(kernels, "spec"):  # a GPU's compiled step: fused elementwise kernels
        trace = trace.compiled()
    every, redo = checkpoint_every(cfg), _redo(shapes, cfg, layout)
    if not redo.elementwise:  # memory=budget: every block runs again what its knapsack did not keep
        every = 1
    block_keys = sorted({k[0] for k in trace.regions if isinstance(k, tuple)}, key=_block_order)
    stage_layers = shapes.stage_layers or [list(range(len(block_keys)))]
    per_rank = []
    for rank in range(layout.pp):
        mine = {block_keys[i] for s, ids in enumerate(stage_layers) if stage_rank(s, layout) == rank for i in ids}
        seconds = 0.0
        for key, region in trace.regions.items():
            if isinstance(key, tuple):
                if key[0] not in mine:
                    continue
                seconds += _region_s(region, key[1], layout, kernels, profile)
                if every and block_keys.index(key[0]) % every == 0:  # recomputed in backward
                    seconds += _recomputed_s(region, key[1], layout, kernels, profile, redo)
            elif (key == "pre" and rank == 0) or (key == "post" and rank == layout.pp - 1):
                seconds += _region_s(region, "post" if layout.loss_parallel else key, layout, kernels, profile)
        per_rank.append(seconds)
    local_params = sum(math.prod(p.shape) for p in shapes.params) / (layout.tp * layout.pp * max(layout.shard, 1))
    update = local_params * kernels.optimizer_s_per_param + _grad_copies_s(shapes, layout, kernels) + optimizer_s
    scale = kernels.in_situ  # the operators as a real step runs them (framework.plan.calibrate)
    return scale * (micro * max(per_rank) + update), scale * (micro * sum(per_rank) / len(per_rank) + update)


@dataclasses.dataclass(frozen=True)
class Redo:
    """What a recomputed block runs again in backward: shares of its matmuls and attention, and
    whether its elementwise work (the compiler's partitioner recomputes that anyway)."""

    matmuls: float
    attention: float
    elementwise: bool = True


def _redo(shapes: Shapes, cfg: DictConfig, layout: Layout) -> Redo:
    """Checkpointing: all of a block; memory=selective: none of what it keeps; memory=budget: the
    matmuls and attention whose outputs its knapsack leaves (in the planner's count of bytes)."""
    if cfg.memory.name == "selective":
        g = SimpleNamespace(**shapes.gpt) if shapes.gpt else None
        matmuls = recomputed_matmul_share(g, cfg, layout) if g else float("matmul" not in cfg.memory.save_ops)
        return Redo(matmuls, float("attention" not in cfg.memory.save_ops))
    if cfg.memory.name == "budget" and cfg.compile:
        redo = 1 - budget_kept_share(SimpleNamespace(**shapes.gpt), cfg, layout) if shapes.gpt else 0.0
        return Redo(redo, redo, elementwise=False)
    return Redo(1.0, 1.0)


def _budget_recomputed_flops(shapes: Shapes, cfg: DictConfig, layout: Layout) -> float:
    """memory=budget, per token: the matmuls and attention (a gpt block's 24·D² + 4·T·D forward
    FLOPs) that its knapsack leaves to run again, in every block."""
    redo = _redo(shapes, cfg, layout)
    if redo.elementwise or not shapes.gpt:
        return 0.0
    D, T = shapes.gpt["n_embd"], tokens_per_rank(cfg, layout)
    return redo.matmuls * shapes.gpt["n_layer"] * (24 * D * D + 4 * T * D)


def _recomputed_s(region: Region, kind: str, layout: Layout, kernels, profile, redo: Redo) -> float:
    """A block's second forward, as much of it as runs again (`redo`)."""

    def again(part: Region) -> float:
        return _region_s(part, kind, layout, kernels, profile, forwards=2) - _region_s(
            part, kind, layout, kernels, profile
        )

    bare = dataclasses.replace(region, matmuls=[], attention=[])
    out = again(bare) if redo.elementwise else 0.0
    out += redo.matmuls * (again(dataclasses.replace(bare, matmuls=region.matmuls)) - again(bare))
    return out + redo.attention * (again(dataclasses.replace(bare, attention=region.attention)) - again(bare))


def _block_order(name: str) -> tuple:
    tail = name.rsplit(".", 1)[-1]
    return (0, int(tail)) if tail.isdigit() else (1, tail)


def _region_s(region: Region, kind: str, layout: Layout, kernels, profile, forwards: int = 1) -> float:
    """Seconds of a region's forward(s) and backward on one rank of `layout`. Autocast casts the
    parameters in each forward, and their gradients back once, unless FSDP gathers them already
    cast (its copies are _grad_copies_s's)."""
    tp = layout.tp
    split = tp if kind == "sharded" or (kind == "replicated" and layout.sequence_parallel) else 1
    matmul = 0.0
    for m, k, n, style, formats in region.matmuls:
        if tp > 1 and kind in ("sharded", "post"):
            if style in ("colwise", "output"):
                n = n / tp
            elif style == "rowwise":
                k = k / tp
            elif kind == "sharded":
                m = m / tp  # a batched matmul over the heads (attention written out)
        elif split > 1:
            m = m / split
        share = [kernels.format_share(f) for f in formats] if formats else (1.0, 1.0, 1.0)  # a converter's format
        forward = kernels.matmul_s(m, k, n) / share[0]
        matmul += (forward * forwards + kernels.matmul_s(m, k, n, "input_grad") / share[1]
                   + kernels.matmul_s(m, k, n, "weight_grad") / share[2])  # fmt: skip
    attention = sum(kernels.attention_s(m / split, k, n) for m, k, n in region.attention) * layout.cp
    if region.causal:  # a GPU's FlashAttention skips the masked half (context parallel balances it: zigzag)
        attention *= getattr(kernels, "causal_share", 1.0)
    elementwise = (region.bytes / kernels.bytes_per_s + region.math_bytes / kernels.math_bytes_per_s) / split
    casts = 0.0 if layout.fsdp else region.cast_bytes / kernels.bytes_per_s / split * (forwards + 1)
    converted = region.converted_bytes  # a converter's own casts (float8's), forward and backward
    casts += (converted[0] * forwards + converted[1]) / kernels.bytes_per_s / split
    ops = region.ops * profile.op_overhead_s
    return (
        matmul
        + attention * (forwards + BACKWARD_ATTENTION)
        + elementwise * (forwards + BACKWARD_BYTES)
        + casts
        + ops * (forwards + BACKWARD_OPS)
    )


def _grad_copies_s(shapes: Shapes, layout: Layout, kernels) -> float:
    """DDP copies each gradient into its bucket and back; FSDP copies parameters into and out of
    each all-gather's buffer (twice under reshard: forward and backward) and gradients into the
    reduce-scatter's."""
    total = 4 * sum(math.prod(p.shape) for p in shapes.params) / (layout.tp * layout.pp)
    if layout.fsdp:
        gathers = 2 if layout.reshard else 1
        return (2 * gathers + 2) * total / kernels.bytes_per_s
    if layout.dp > 1:
        return 2 * total / kernels.bytes_per_s
    return 0.0


def step_time(
    cfg: DictConfig, layout: Layout, shapes: Shapes, ranks: list, profile, trace: Trace | None = None
) -> float:
    """Seconds per optimizer step: the sum of step_split's terms."""
    return sum(step_split(cfg, layout, shapes, ranks, profile, trace).values())


SPLIT = ("compute", "memory_bound", "bubble", "exposed_comm")  # step_split's terms, in the printed order


def step_split(
    cfg: DictConfig, layout: Layout, shapes: Shapes, ranks: list, profile, trace: Trace | None = None
) -> dict[str, float]:
    """A step's seconds by term, summing to the step: the busier of two bounds on the arithmetic
    (compute_s) and the communication that does not hide behind it. The slowest rank's work,
    stretched by the pipeline's bubble, is the critical path; the ranks' work together over the
    cores is the other bound, which decides where more ranks than cores share them (a CPU's
    `profile.share` < 1): a pipeline rank idle in its bubble then lends its core to the others.

    compute: matmuls, attention and dispatch; memory_bound: what HBM's rate adds to them (the
    norms, activations, casts and the optimizer; a GPU's kernels only, else 0); bubble: the
    pipeline's idle share; exposed_comm: the collectives (and activation offload's copies) that
    the arithmetic does not hide."""
    slowest, mean = compute_s(cfg, layout, shapes, profile, trace)
    work = max(slowest, mean / profile.share)
    busy = max(slowest / (1 - bubble(layout)), work)
    window = busy
    if layout.pp > 1:  # gathers in the fill, reductions in the drain, and one micro-batch's work
        window = busy - slowest + slowest / max(1, layout.n_microbatches)
    exposed = comm_s(cfg, layout, ranks, profile, window, work) + host_copies_s(cfg, layout, shapes, profile, busy)
    bound = 0.0
    if hasattr(profile.kernels, "spec") and work > 0:  # the same arithmetic with HBM free
        fast = dataclasses.replace(profile.kernels.spec, hbm_tb_s=math.inf)
        free = dataclasses.replace(profile, kernels=dataclasses.replace(profile.kernels, spec=fast))
        quick = max(compute_s(cfg, layout, shapes, free, trace)[0], 0.0)
        bound = work * max(0.0, 1 - quick / slowest) if slowest else 0.0
    return {"compute": work - bound, "memory_bound": bound, "bubble": busy - work, "exposed_comm": exposed}


def host_copies_s(cfg: DictConfig, layout: Layout, shapes: Shapes, profile, busy: float) -> float:
    """Activation offload's copies out (during the forward) and back (during the backward), on a
    side stream: what `busy` seconds of arithmetic do not hide of them."""
    copies = offloaded_bytes(shapes, cfg, layout)
    if not copies or not profile.host_bytes_per_s:
        return 0.0
    return max(0.0, 2 * copies / profile.host_bytes_per_s - profile.overlap * busy)


def comm_s(
    cfg: DictConfig, layout: Layout, ranks: list, profile, busy: float = 0.0, ring: float | None = None
) -> float:
    """Seconds of communication per step on the slowest rank that `busy` seconds of arithmetic do
    not hide (busy=0: all of it). A call costs the profile's latency, its ring's steps (or a
    tree's, for an all-reduce, whichever is shorter) at a step's latency within or across nodes,
    and its wire bytes at the bandwidth of where its group lies (comm_seconds)."""
    nodes = cfg.plan.nodes  # read once: a config lookup costs more than the term it feeds
    per_node = max(1, layout.world // max(1, nodes))
    worst = 0.0
    for t in ranks:
        hidden, exposed, hops = 0.0, 0.0, 0.0
        for term in t.seconds_terms:
            seconds = comm_seconds(profile, term, per_node if nodes > 1 else 0)
            if term[4] == "dp":
                hidden += seconds
            elif term[4] == "cp":
                hops += seconds
            else:
                exposed += seconds
        # a ring's hops run beside the arithmetic of every micro-batch (`ring`, else `busy`)
        hops = max(0.0, hops - profile.overlap * (busy if ring is None else ring))
        worst = max(worst, exposed + hops + max(0.0, hidden - profile.overlap * busy))
    figures = profile.latency_of("all_reduce") if layout.world > 1 else 0.0  # the step's loss and counts, all-reduced
    return worst + figures


RING_STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1, "all_to_all": 1}


def comm_seconds(profile, term: tuple, per_node: int) -> float:
    """Seconds of a Traffic term (`calls` calls of `op` moving `wire` bytes per rank in a group of
    `group` ranks `stride` apart on the mesh), with `per_node` ranks to a node (0: one node). A group wider
    than its node sends across nodes at the network's rate per rank times its members on each
    node (one NIC per rank: their rings cross over all of them), at most the rate within."""
    op, calls, wire, group, _, stride = term
    members = group if not per_node or group * stride <= per_node else max(1, min(group, per_node // stride))
    spans = members < group
    bandwidth = profile.bandwidth_of(op, False)
    if spans:
        bandwidth = min(bandwidth, profile.inter_bytes_per_s * members)
    within, across = profile.step_latency_s
    kind = op.rpartition(":")[2]
    if kind == "send":
        steps = across if spans else within
    else:
        factor, node_count = RING_STEPS.get(kind, 1), group // members
        inter_steps = factor * (node_count - 1) if spans else 0
        steps = (factor * (group - 1) - inter_steps) * within + inter_steps * across
        if kind == "all_reduce" and group > 2:  # a tree: up and down log2 of the nodes, then of the members
            tree = 2 * (math.ceil(math.log2(node_count)) * across + math.ceil(math.log2(members)) * within)
            steps = min(steps, tree)
    return calls * (profile.latency_of(op) + steps) + wire / bandwidth
