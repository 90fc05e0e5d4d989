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

from omegaconf import DictConfig

from framework.plan.activations import checkpoint_every
from framework.plan.model import Layout, Shapes


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
    """Operators one rank dispatches per step: per block and micro-batch about 40 forward and 80
    backward (norms, projections, attention, the MLP, residuals; more under tensor parallel's
    DTensor redistributions), again a forward's worth in a checkpointed block, the optimizer's
    few per parameter tensor, and the step's own bookkeeping (the batch, the loss, clipping, the
    step's figures: about 200)."""
    if shapes.gpt is None:
        return 0.0
    n_layer = shapes.gpt["n_layer"]
    blocks = n_layer / layout.pp
    every = checkpoint_every(cfg)
    recomputed = blocks / every if every else 0
    micro = layout.n_microbatches if layout.pp > 1 else cfg.accumulation_steps
    per_block = 120 * (1.5 if layout.tp > 1 else 1.0) + 20 * (layout.cp > 1) * layout.cp
    return micro * (per_block * blocks + 40 * recomputed + 30) + 12 * len(shapes.params) / layout.pp + 200


def step_time(cfg: DictConfig, layout: Layout, shapes: Shapes, ranks: list, profile, compute: bool = True) -> float:
    """Seconds per optimizer step (compute=False: the communication alone)."""
    busy = 0.0
    if compute:
        flops = shapes.hardware_flops_per_token * step_tokens(cfg, layout) / max(layout.world, 1)
        busy = flops / profile.peak_flops + ops_per_step(shapes, cfg, layout) * profile.op_overhead_s
        busy /= 1 - bubble(layout)
    nodes = cfg.plan.nodes  # read once: a config lookup costs more than the term it feeds
    per_node = max(1, layout.world // max(1, nodes))
    worst = 0.0
    for t in ranks:
        hidden, exposed = 0.0, 0.0
        for _op, calls, wire, group, kind in t.seconds_terms:
            spans_nodes = nodes > 1 and group > per_node
            seconds = calls * profile.latency_s + wire / (
                profile.inter_bytes_per_s if spans_nodes else profile.intra_bytes_per_s
            )
            if kind == "dp":
                hidden += seconds
            else:
                exposed += seconds
        worst = max(worst, exposed + max(0.0, hidden - profile.overlap * busy))
    figures = profile.latency_s if layout.world > 1 else 0.0  # the step's loss and counts, all-reduced
    return busy + worst + figures
