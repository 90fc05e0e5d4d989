"""What a rank's state holds (parameters, gradients, the optimizer's state) under a layout, and
what the optimizer's step adds (its own FLOPs and collectives): each as the optimizer component
prices itself (framework/optimizers/prices.py)."""

from __future__ import annotations

from collections import defaultdict

from omegaconf import DictConfig

from framework.plan.model import Layout, Shapes, _numel, _tp_local, fsdp_rows, stage_rank


def state_bytes(shapes: Shapes, layout: Layout, cfg: DictConfig) -> dict[str, int]:
    """Parameter, gradient and optimizer bytes on the rank holding most (fp32 throughout); the
    optimizer's state as its component prices it (framework/optimizers/prices.py; none: 0)."""
    # pp rank -> [elements, trainable tensors, extra grad, trainable elements, of them the blocks'
    # matrices' elements and tensors]
    per_rank: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0, 0])
    units: dict[tuple[int, str, bool], int] = defaultdict(int)
    for p in shapes.params:
        local = _tp_local(p, layout.tp)
        rank = stage_rank(p.stage, layout)
        per_rank[rank][1] += p.trainable
        per_rank[rank][5] += p.trainable and p.matrix
        if (
            p.tp_dim is not None
            and p.style in ("embedding", "position_embedding", "vocab_embedding")
            and not layout.fsdp
        ):
            # a row-wise (vocabulary-split) embedding's gradient comes back whole-size from
            # DTensor's embedding backward: a tp rank holds all of it
            per_rank[rank][2] += _numel(p.shape) - _numel(local)
        if p.expert and layout.ep > 1:  # experts / ep of them, sharded by FSDP over the dp_shard ranks left
            held = fsdp_rows(local[0] // layout.ep, layout.expert_shard)[0] * _numel(local[1:])
        elif layout.fsdp == 2:
            held = fsdp_rows(local[0], layout.shard)[0] * _numel(local[1:])
        elif layout.fsdp == 1:
            units[(rank, p.unit, p.trainable)] += _numel(local)
            continue
        else:
            held = _numel(local)
        per_rank[rank][0] += held
        per_rank[rank][3] += held * p.trainable
        per_rank[rank][4] += held * (p.trainable and p.matrix)
    for (rank, _, trainable), numel in units.items():  # FSDP1: one flat parameter per unit, split evenly
        per_rank[rank][0] += -(-numel // layout.shard)
        per_rank[rank][3] += -(-numel // layout.shard) * trainable
    price = optimizer_price(cfg.optim) or (lambda elements, tensors, matrix: 0)

    def optim_bytes(counts: list[int]) -> int:
        _, tensors, _, elements, matrix_elements, matrix_tensors = counts
        return price(elements - matrix_elements, tensors - matrix_tensors, False) + price(
            matrix_elements, matrix_tensors, True
        )

    # each kind on the rank holding most of it (a tp embedding's whole-size gradient can put the
    # most gradient bytes on another pipeline rank than the most parameter bytes)
    ranks = per_rank.values()
    return {"param_bytes": max(4 * c[0] for c in ranks), "grad_bytes": max(4 * (c[3] + c[2]) for c in ranks),
            "optim_bytes": max(optim_bytes(c) for c in ranks)}  # fmt: skip


def optimizer_price(optim: DictConfig):
    """The optimizer component's state price (framework/optimizers/prices.py), or None."""
    from framework.components import locate
    from framework.optimizers import optimizer_kwargs
    from framework.optimizers.prices import state_price

    return state_price(locate(optim, "optim"), optimizer_kwargs(optim))


def optimizer_step_cost(shapes: Shapes, cfg: DictConfig, layout: Layout) -> list[tuple[float, list[tuple]]]:
    """Per pipeline rank: (the FLOPs its optimizer's step adds, the gathers it issues as
    (elements gathered, group size, the group's rank stride) each), for an optimizer that declares them per matrix of the
    blocks (framework/optimizers/prices.py `step_price`: Muon's whole-matrix orthogonalisation);
    [] for the others (their step is elementwise, in the update the timing counts already).
    A matrix sharded by FSDP2 (over `layout.shard`) and by tensor parallel is gathered over both
    groups in turn, shard group first; every rank of the groups runs the whole iteration."""
    from framework.components import locate
    from framework.optimizers import optimizer_kwargs
    from framework.optimizers.prices import step_price

    price = step_price(locate(cfg.optim, "optim"), optimizer_kwargs(cfg.optim))
    if price is None:
        return []
    out = [(0.0, []) for _ in range(layout.pp)]
    for p in shapes.params:
        if not (p.matrix and p.trainable):
            continue
        whole, flops = price(p.shape)
        flops_so_far, gathers = out[stage_rank(p.stage, layout)]
        local = _tp_local(p, layout.tp)
        if layout.fsdp == 2 and layout.shard > 1:  # FSDP2's row shards, padded as it pads them
            gathers.append((fsdp_rows(local[0], layout.shard)[1] * _numel(local[1:]), layout.shard, layout.tp))
        if p.tp_dim is not None and layout.tp > 1:
            gathers.append((whole, layout.tp, 1))
        out[stage_rank(p.stage, layout)] = (flops_so_far + flops, gathers)
    return out
