"""The planner's collectives per optimizer step on one rank, by op: calls, payload bytes and ring
wire bytes, in the shape `framework.measure.comm` measures them (so the two compare figure by figure).

- ddp: one all-reduce of every gradient per step (accumulation skips the others), in buckets:
  of `bucket_cap_mb` (rebuilt so after the first step); compression hooks halve the payload;
  with `broadcast_buffers`, a broadcast of the buffers (BatchNorm statistics) per forward and dtype.
- fsdp: per unit (each block, and the root holding the rest) an all-gather in forward, another
  in backward when it reshards after forward (blocks; never the root), a reduce-scatter of its
  gradients, and under HSDP an all-reduce of the shard across replicas; payloads padded as the
  shards are. Accumulation communicates once per step unless `sync_every_microbatch`.
- tp: per block and micro-batch, with sequence parallel two all-gathers and two reduce-scatters of
  the residual stream each way, without it two all-reduces forward and four backward; the head gathers its input
  and (without loss parallel) the logits; norms' partial gradients are all-reduced at clipping.
- pp: per micro-batch each stage sends its output forward and its input's gradient back.
- ep: per routed layer and micro-batch, five all-to-alls among the ep ranks (counts, tokens,
  outputs, and the two gradients), on the mean rank's dropless volume.
- cp (ring attention): per block and micro-batch the stacked key/value block travels cp-1 hops
  forward and again backward (and once more in a checkpointed block's recomputation), and its
  gradient (float32, the ring's accumulation dtype) cp hops backward; each hop a send and a receive.
  torch's own `context_parallel` (cp_impl=torch) is not modelled.
- clipping: one 4-byte all-reduce of the squared norm (mesh strategies and FSDP1).
- the optimizer's own (framework.plan.state.optimizer_step_cost): Muon gathers each sharded matrix
  whole in its step, over FSDP's shard group and tensor parallel's group in turn.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from omegaconf import DictConfig

from framework.measure.comm import RING_FACTOR
from framework.plan.activations import checkpoint_every, micro_batch, tokens_per_rank
from framework.plan.model import Layout, Shapes, _numel, _tp_local, fsdp_rows, stage_rank
from framework.plan.state import optimizer_step_cost

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "amp": 2}


class Traffic:
    """Collectives of one rank, accumulated by op."""

    def __init__(self) -> None:
        self.calls: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, float] = defaultdict(float)
        self.wire: dict[str, float] = defaultdict(float)
        # (op, calls, wire bytes, group size, kind, stride): "dp" traffic can overlap compute, "model"
        # cannot; stride: the rank distance between the group's members on the mesh (tp innermost),
        # which places the group on nodes (framework.plan.timing.comm_s);
        # op is "fsdp:all_gather" or "tp:all_reduce" where the strategy's own path issues it (the
        # profile prices a call by who issues it: FSDP's hooks and DTensor's redistributes cost more
        # than the bare collective)
        self.seconds_terms: list[tuple[str, float, float, int, str, int]] = []

    def add(self, op: str, payload: float, group: int, calls: float = 1, kind: str = "model", stride: int = 1) -> None:
        """`op`: the collective ("all_gather"), or "fsdp:all_gather" as a strategy's own path issues it."""
        if group <= 1 or calls == 0:
            return
        via, _, op = op.rpartition(":")
        wire = payload * RING_FACTOR[op](group)
        self.calls[op] += calls
        self.bytes[op] += payload
        self.wire[op] += wire
        self.seconds_terms.append((f"{via}:{op}" if via else op, calls, wire, group, kind, stride))
        if op == "send":  # the peer's matching receive is a call too (no bytes of its own)
            self.calls["recv"] += calls
            self.bytes["recv"] += payload

    def add_tp(self, op: str, payload: float, group: int, calls: float = 1) -> None:
        self.add(f"tp:{op}", payload, group, calls)

    def totals(self) -> dict[str, Any]:
        return {
            "calls": round(sum(self.calls.values())),
            "bytes": round(sum(self.bytes.values())),
            "wire_bytes": round(sum(self.wire.values())),
            "by_op": {
                op: {"calls": round(self.calls[op]), "bytes": round(self.bytes[op])} for op in sorted(self.calls)
            },
        }


def traffic(shapes: Shapes, cfg: DictConfig, layout: Layout) -> list[Traffic] | None:
    """Each pipeline rank's traffic (one entry without a pipeline); None where not modelled."""
    if layout.name in ("none", "dp"):
        return [Traffic()]
    if layout.comm_hook == "powersgd":
        return None  # low-rank compression: its payload depends on the rank and the warm-up
    ranks = [Traffic() for _ in range(layout.pp)]
    if layout.name == "ddp":
        _ddp(ranks[0], shapes, layout)
        if cfg.parallel.name == "ddp" and cfg.parallel.broadcast_buffers and shapes.buffers:
            # rank 0's buffers (BatchNorm statistics) go to every replica before each forward,
            # coalesced into one broadcast per dtype
            n = cfg.accumulation_steps
            ranks[0].add("broadcast", n * sum(shapes.buffers.values()), layout.world, n * len(shapes.buffers), "dp")
        _sync_batchnorm(ranks[0], shapes, cfg, layout.world)
        return ranks
    if layout.fsdp:
        _fsdp(ranks, shapes, cfg, layout)
        _sync_batchnorm(ranks[0], shapes, cfg, layout.dp, stride=layout.cp * layout.tp)
    if layout.tp > 1:
        _tensor_parallel(ranks, shapes, cfg, layout)
    if layout.pp > 1:
        _pipeline(ranks, shapes, cfg, layout)
    if layout.ep > 1:
        _expert_parallel(ranks, shapes, cfg, layout)
    if layout.cp > 1:
        if layout.cp_impl != "ring" or shapes.gpt is None:
            return None
        _ring_attention(ranks, shapes, cfg, layout)
    for rank, (_, gathers) in enumerate(optimizer_step_cost(shapes, cfg, layout)):  # Muon's whole matrices
        for elements, group, stride in gathers:
            ranks[rank].add("tp:all_gather", 4 * elements, group, stride=stride)
    for t in ranks:  # clipping's global norm
        t.add("all_reduce", 4, layout.world)
        if cfg.precision.name == "amp":  # the sharded loss scaler's found_inf (framework/precision.py)
            t.add("all_reduce", 4, layout.world)
    return ranks


def _sync_batchnorm(t: Traffic, shapes: Shapes, cfg: DictConfig, dp: int, stride: int = 1) -> None:
    """parallel.sync_batchnorm (framework/parallel/batchnorm.py), per BatchNorm layer and micro-batch:
    the count and per-channel sums all-reduced forward, and their gradients backward (fp32): the
    CPU implementation's; torch's SyncBatchNorm on accelerators all-gathers the per-rank statistics
    forward instead, dp times the bytes of that one call."""
    if dp > 1 and shapes.batchnorm and cfg.parallel.get("sync_batchnorm", True):
        n = cfg.accumulation_steps
        payload = sum(4 * (2 * c + 1) for c in shapes.batchnorm)
        t.add("all_reduce", 2 * n * payload, dp, 2 * n * len(shapes.batchnorm), "dp", stride=stride)


def _ddp(t: Traffic, shapes: Shapes, layout: Layout) -> None:
    trainable = [p for p in shapes.params if p.trainable]
    grad = 4 * sum(_numel(p.shape) for p in trainable)
    payload = grad // 2 if layout.comm_hook in ("fp16", "bf16") else grad
    cap = layout.bucket_cap_mb * 1024**2
    buckets = -(-grad // cap)  # after the first step DDP rebuilds its buckets to the cap
    t.add("all_reduce", payload, layout.world, calls=min(buckets, len(trainable)), kind="dp")


def _fsdp(ranks: list[Traffic], shapes: Shapes, cfg: DictConfig, layout: Layout) -> None:
    from framework.parallel.fsdp import mixed_precision_dtypes

    param_dtype, reduce_dtype = mixed_precision_dtypes(cfg.precision.name, cfg.parallel.get("reduce_dtype", "fp32"))
    gather_bytes = 4 if param_dtype is None else param_dtype.itemsize
    reduce_bytes = reduce_dtype.itemsize
    units: dict[tuple[int, str], int] = defaultdict(int)  # (pp rank, unit) -> padded elements
    sent: dict[tuple[int, str], float] = defaultdict(float)  # (pp rank, unit) -> padded bytes gathered
    flat: dict[tuple[int, str], int] = defaultdict(int)
    trained: dict[tuple[int, str], int] = defaultdict(int)  # of them with gradients (reduce-scattered)
    for p in shapes.params:
        local = _tp_local(p, layout.tp)
        key = (stage_rank(p.stage, layout), p.unit if p.unit != "root" else f"root{p.stage}")
        rows, group = local[0], layout.shard
        if p.expert and layout.ep > 1:  # a unit of its own: experts / ep, over the dp_shard ranks left
            key, rows, group = (key[0], f"{key[1]}:experts"), rows // layout.ep, layout.expert_shard
        units[key] += fsdp_rows(rows, group)[1] * _numel(local[1:])
        sent[key] += fsdp_rows(rows, group)[1] * _numel(local[1:]) * (p.gather_bytes or gather_bytes)  # a converter's
        trained[key] += fsdp_rows(rows, group)[1] * _numel(local[1:]) * p.trainable
        flat[key] += _numel(local)
    if layout.fsdp == 1:  # one flat parameter per unit, padded to divide evenly
        units = {k: -(-n // layout.shard) * layout.shard for k, n in flat.items()}
        sent = {k: n * gather_bytes for k, n in units.items()}
        trained = {k: min(trained[k], units[k]) for k in units}
    rounds = cfg.accumulation_steps if layout.sync_every_microbatch else 1
    # FSDP1's no_sync skips the reduce-scatter only: every micro-batch gathers again (FSDP2's
    # accumulation here keeps the parameters gathered between micro-batches)
    gather_rounds = cfg.accumulation_steps if layout.fsdp == 1 else rounds
    for rank, unit in units:
        t = ranks[rank]
        # experts' units (expert parallel): over the dp_shard ranks ep leaves, ep x tp apart
        group, stride = (
            (layout.expert_shard, layout.ep * layout.tp) if unit.endswith(":experts") else (layout.shard, layout.tp)
        )
        gathers = (1 + (layout.reshard and not unit.startswith("root"))) * gather_rounds
        t.add("fsdp:all_gather", gathers * sent[(rank, unit)], group, gathers, "dp", stride)
        grads = trained[(rank, unit)]
        if grads:  # a unit of frozen parameters (peft=lora's base) reduces nothing
            t.add("fsdp:reduce_scatter", rounds * grads * reduce_bytes, group, rounds, "dp", stride)
            shard = grads // group * reduce_bytes
            t.add("all_reduce", rounds * shard, layout.dp_replicate, rounds, "dp", stride=layout.shard * layout.tp)


def _tensor_parallel(ranks: list[Traffic], shapes: Shapes, cfg: DictConfig, layout: Layout) -> None:
    """Each plan entry's collectives (DTensor's styles): a row-wise linear all-reduces its output
    forward (reduce-scatters it under sequence parallel, and all-gathers its output gradient
    backward); a column-wise one all-reduces its input gradient backward, each on its own;
    under sequence parallel a gather point all-gathers the sequence forward and reduce-scatters its
    gradient backward, and each norm parameter's partial gradient is all-reduced once."""
    tps, T, tp = shapes.tp, tokens_per_rank(cfg, layout), layout.tp
    mb = micro_batch(cfg, layout)
    n_micro = layout.n_microbatches if layout.pp > 1 else cfg.accumulation_steps
    out_bytes = 4 if cfg.precision.name == "fp32" else 2  # a linear's output under autocast
    stream = mb * T * tps.hidden  # residual-stream elements of one micro-batch
    rows, cols, gathers = (tps.per_block.get(k, 0) for k in ("rowwise", "colwise", "gather_input"))
    for stage, layers in enumerate(shapes.stage_layers):
        t = ranks[stage_rank(stage, layout)]
        blocks = len(layers) * n_micro
        norms = []
        if layout.sequence_parallel:
            t.add_tp(
                "all_gather", blocks * stream * (gathers * 4 + rows * out_bytes), tp, calls=(gathers + rows) * blocks
            )
            t.add_tp(
                "reduce_scatter",
                blocks * stream * (rows * out_bytes + gathers * 4),
                tp,
                calls=(gathers + rows) * blocks,
            )
            norms = tps.block_norm_params * len(layers)
        else:
            t.add_tp("all_reduce", blocks * stream * (rows * out_bytes + cols * 4), tp, calls=(rows + cols) * blocks)
        vocab_split = tps.top.get("vocab_embedding", 0)
        if stage == 0 and vocab_split and not layout.sequence_parallel:  # partial lookups summed
            t.add_tp("all_reduce", n_micro * 4 * stream * vocab_split, tp, calls=n_micro * vocab_split)
        if stage == 0 and layout.sequence_parallel:  # embeddings leave split along the sequence
            lookups = tps.top.get("embedding", 0) + vocab_split
            embedded = lookups * stream + tps.top.get("position_embedding", 0) * T * tps.hidden
            calls = (lookups + tps.top.get("position_embedding", 0)) * n_micro
            t.add_tp("reduce_scatter", n_micro * 4 * embedded, tp, calls=calls)
            t.add_tp("all_gather", n_micro * 4 * embedded, tp, calls=calls)  # their gradients
        if stage == layout.stages - 1 and tps.top.get("output"):
            if layout.sequence_parallel:
                t.add_tp("all_gather", n_micro * 4 * stream, tp, calls=n_micro)
                t.add_tp("reduce_scatter", n_micro * 4 * stream, tp, calls=n_micro)
                norms = norms + tps.top_norm_params
            else:
                t.add_tp("all_reduce", n_micro * 4 * stream, tp, calls=n_micro)
            if not layout.loss_parallel:
                t.add_tp("all_gather", n_micro * out_bytes * mb * T * tps.vocab, tp, calls=n_micro)
        t.add_tp("all_reduce", 4 * sum(norms), tp, calls=len(norms))  # partial norm-parameter gradients


def _pipeline(ranks: list[Traffic], shapes: Shapes, cfg: DictConfig, layout: Layout) -> None:
    seq_split = layout.tp if layout.sequence_parallel else 1
    activation = 4 * micro_batch(cfg, layout) * tokens_per_rank(cfg, layout) * shapes.hidden // seq_split
    m, stride = layout.n_microbatches, layout.dp * layout.cp * layout.tp
    for stage in range(layout.stages):
        rank = stage_rank(stage, layout)
        if stage < layout.stages - 1 and stage_rank(stage + 1, layout) != rank:
            ranks[rank].add("send", m * activation, 2, calls=m, stride=stride)  # outputs forward
        if stage > 0 and stage_rank(stage - 1, layout) != rank:
            ranks[rank].add("send", m * activation, 2, calls=m, stride=stride)  # input gradients back


def _expert_parallel(ranks: list[Traffic], shapes: Shapes, cfg: DictConfig, layout: Layout) -> None:
    """Expert parallel's all-to-alls (framework/parallel/expert.py), per routed layer and micro-batch:
    the counts (one int64 per expert), the tokens to their experts' ranks and the outputs back,
    and the two reversed in backward. A rank sends each of its T x top_k assignments' rows (dim
    wide, the activations' dtype) twice (tokens forward, outputs' gradients backward), and twice
    the rows it received: what the ep ranks receive is what they sent, so the mean rank receives
    T x top_k. Counted as sent (framework.measure.comm), each layer: 8 E + 4 T k dim bytes on the
    mean rank, exactly when dropless (a capacity factor sends fewer: dropped rows stay home); the
    busiest rank sends more, by how unevenly its experts are loaded (summary `moe`)."""
    moe, n_micro = shapes.moe, layout.n_microbatches if layout.pp > 1 else cfg.accumulation_steps
    rows = micro_batch(cfg, layout) * tokens_per_rank(cfg, layout) * moe.top_k
    width = 4 if cfg.precision.name == "fp32" else 2  # ep runs under FSDP2: its mixed precision's 16-bit forward
    for stage, layers in enumerate(shapes.stage_layers):
        routed = n_micro * len(moe.blocks.intersection(layers))
        t = ranks[stage_rank(stage, layout)]
        t.add("all_to_all", routed * 8 * moe.experts, layout.ep, routed, stride=layout.tp)
        t.add("all_to_all", routed * 4 * rows * moe.dim * width, layout.ep, 4 * routed, stride=layout.tp)


def _ring_attention(ranks: list[Traffic], shapes: Shapes, cfg: DictConfig, layout: Layout) -> None:
    """Ring attention's sends (framework/parallel/ring.py): a message is this rank's keys and
    values stacked, 2 x b x T/cp x D/tp elements (repeated to every query head), in the compute
    dtype; its gradient in float32. Per pipeline rank: its stages' blocks, each micro-batch. Kind
    "cp": each hop's send runs while the attention of the block it carried runs (timing.comm_s)."""
    b, cp = micro_batch(cfg, layout), layout.cp
    elements = 2 * b * tokens_per_rank(cfg, layout) * shapes.gpt["n_embd"] // layout.tp
    kv_bytes = 4 if cfg.precision.name == "fp32" else 2
    every = checkpoint_every(cfg)
    n_micro = layout.n_microbatches if layout.pp > 1 else cfg.accumulation_steps
    for stage, layers in enumerate(shapes.stage_layers or [list(range(shapes.gpt["n_layer"]))]):
        t = ranks[stage_rank(stage, layout)]
        recomputed = sum(1 for i in layers if every and i % every == 0)
        kv_hops = n_micro * (cp - 1) * (2 * len(layers) + recomputed)
        grad_hops = n_micro * cp * len(layers)
        t.add("send", kv_hops * elements * kv_bytes, cp, calls=kv_hops, kind="cp", stride=layout.tp)
        t.add("send", grad_hops * elements * 4, cp, calls=grad_hops, kind="cp", stride=layout.tp)
