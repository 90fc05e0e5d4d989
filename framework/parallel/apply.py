"""``parallelize`` applies the parallel strategies to a plain model in the one fixed order:

    pipeline split -> tensor (and expert) parallel -> context parallel -> activation checkpointing -> compile
    -> FSDP / DDP

Tensor parallelism first, because its plan names the model's own submodules (``attn.q``) and
checkpointing wraps them; checkpointing before FSDP so that FSDP's units are the (wrapped)
blocks and a block's parameters are gathered again for its recomputation; context parallel
wraps nothing (it shards the batch and routes attention to a ring, also in the recomputation); compilation per block
after checkpointing (the recomputation is compiled too) and before FSDP, whose hooks and
collectives stay outside the compiled graphs; the data-parallel wrapper last, over the final
parameters. A pipeline split comes before all of them: each stage is then parallelized alone.

The result, ``Parallelized``, is what the trainer needs of any strategy: the module to run, a
gradient-sync switch for accumulation, gradient clipping that knows how gradients are sharded,
which ranks hold the loss and which read distinct data, and (context parallel) which part of
each sequence a rank computes.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from torch import nn

from framework.contract import ModelSpec, block_matrices, blocks_of
from framework.converters import on_meta
from framework.dist import DistInfo
from framework.levers import apply_memory_lever, compile_block
from framework.modules import map_blocks, materialize_model
from framework.parallel.dims import Mesh, ParallelDims, Strategy
from framework.parallel.pipeline import Pipeline, trace_split
from framework.parallel.routed import summing_routed_grads
from framework.parallel.ties import SplitTies, retie, split_ties


@dataclass
class Parallelized:
    module: nn.Module  # run forward through it; its parameters are this rank's (local shards)
    grad_sync: Callable[[bool], AbstractContextManager] = lambda enabled: nullcontext()
    clip_grad_norm: Callable[[float], torch.Tensor] | None = None
    loss_context: Callable[[], AbstractContextManager] = nullcontext
    pipeline: Pipeline | None = None
    mesh: Mesh | None = None
    dp_rank: int = 0
    dp_size: int = 1
    holds_loss: bool = True  # this rank computes the loss (a pipeline's last stage)
    counts_data: bool = True  # one rank per data-parallel group counts samples and tokens
    pp_group: object = field(default=None, repr=False)
    # context parallel: (inputs, target) of the batch -> (this rank's inputs, forward kwargs, target)
    split_batch: Callable[[tuple, torch.Tensor], tuple[tuple, dict, torch.Tensor]] = lambda i, t: (i, {}, t)
    cp_size: int = 1  # ranks that split each sequence: gradients are averaged over dp x cp
    counts_loss: bool = True  # this rank's loss is a part of the step's (tp peers hold the same one)
    ties: SplitTies = field(default_factory=SplitTies)  # copies of tied parameters on other pipeline ranks
    tie_names: dict[str, str] = field(default_factory=dict)  # the model's ties (ModelSpec.ties), for loading
    decay: set[str] = field(default_factory=set)  # parameters with weight decay: the plain model's matrices
    matrices: set[str] = field(default_factory=set)  # the blocks' weight matrices (Muon's: framework/optimizers)

    def __post_init__(self):
        if self.clip_grad_norm is None:
            self.clip_grad_norm = lambda max_norm: clip_local_grad_norm(self.module, max_norm)


@torch.no_grad()
def clip_local_grad_norm(module: nn.Module, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (its two halves: fused foreach kernels, no host sync) for
    gradients whole on every rank (none, dp, ddp), without its multiply by 1 when no clipping is
    configured (inf)."""
    params = [p for p in module.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if not math.isinf(max_norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def model_dims(model: nn.Module, spec: ModelSpec) -> tuple[int | None, int | None]:
    """(blocks, attention heads) of the model, where the strategy needs them."""
    blocks = blocks_of(model, spec)
    return (len(blocks) or None), spec.heads


def parallelize(
    model: nn.Module, spec: ModelSpec, cfg: DictConfig, info: DistInfo, materialise: Callable = materialize_model
) -> Parallelized:
    """The converted model (`converted_model`) laid out by the strategy and materialised: this
    rank's part, with the values of the single-process model. (`materialise(module, spec, cfg,
    device)`: the planner's dry run allocates fake tensors instead, framework.plan.dry_run.)"""
    strategy = Strategy.of(cfg.parallel)
    held_back = on_meta(spec, cfg)
    late = strategy.materialise_late(held_back)
    if held_back and not late:
        materialise(model, spec, cfg, info.device)
    # by the plain model's names, before FSDP1 wraps and flattens them
    decay = {name for name, p in model.named_parameters() if p.dim() >= 2}
    decay |= {alias for alias, source in spec.ties.items() if source in decay}  # a pipeline's copy of a tie
    matrices = block_matrices(model, spec)
    par = _wrap(model, spec, cfg, info, strategy)
    if late:
        materialise(par.module, spec, cfg, info.device)
    par.decay, par.matrices, par.tie_names = decay, matrices, spec.ties
    return par


def _wrap(model: nn.Module, spec: ModelSpec, cfg: DictConfig, info: DistInfo, strategy: Strategy) -> Parallelized:
    if strategy.on_mesh:
        return _parallelize_on_mesh(model, spec, cfg, info, strategy)
    if strategy.name == "ddp":
        model = _global_batchnorm(model, cfg, dist.group.WORLD, info)
    _checkpoint_and_compile(model, spec, cfg)
    if strategy.name == "dp":
        from framework.parallel.dp import apply_dp

        return Parallelized(apply_dp(model))
    if strategy.name == "ddp":
        from framework.parallel.ddp import apply_ddp

        ddp = apply_ddp(model, cfg.parallel, info)
        return Parallelized(
            ddp,
            grad_sync=lambda enabled: nullcontext() if enabled else ddp.no_sync(),
            dp_rank=info.rank,
            dp_size=info.world_size,
        )
    return Parallelized(model)


def _checkpoint_and_compile(module: nn.Module, spec: ModelSpec, cfg: DictConfig) -> None:
    """Steps 3 and 4 of the order, in place: activation checkpointing, then torch.compile of each
    block (`nn.Module.compile`: the module keeps its type and parameter names, so FSDP units,
    state dicts and checkpoints are unchanged), or of the whole module for models without blocks."""
    apply_memory_lever(module, spec.blocks, cfg)  # memory=checkpoint, selective, offload_activations
    if cfg.compile:
        torch._dynamo.reset()  # compiled anew: a sweep's worker ran other configs (another budget, shape)
        if blocks_of(module, spec):
            map_blocks(module, spec.blocks, lambda block: compile_block(block, cfg))
        else:
            compile_block(module, cfg)


def _parallelize_on_mesh(
    model: nn.Module, spec: ModelSpec, cfg: DictConfig, info: DistInfo, strategy: Strategy
) -> Parallelized:
    """fsdp, tp, pp and hybrid: degrees from the config, one mesh pp x dp_replicate x dp_shard x tp."""
    from framework.parallel.pipeline import LocalStages
    from framework.parallel.schedules import build_pipeline

    dims = ParallelDims.from_config(cfg.parallel, info.world_size, *model_dims(model, spec))
    mesh = Mesh(dims, dims.build_mesh(info.device.type))
    stages, stage_ids, n_stages, ties = _stages(model, spec, cfg, info, mesh, strategy)
    par = Parallelized(
        module=stages[0] if dims.pp == 1 else LocalStages(stages, spec.blocks),
        mesh=mesh,
        dp_rank=mesh.dp_rank,
        dp_size=dims.dp,
        counts_data=mesh.tp_rank == 0 and mesh.pp_rank == 0 and mesh.cp_rank == 0,
        pp_group=mesh.device_mesh["pp"].get_group() if dims.pp > 1 else None,
        cp_size=dims.cp,
        counts_loss=mesh.tp_rank == 0 and mesh.pp_rank == 0,
        ties=ties,
    )
    if dims.pp > 1:
        par.pipeline = build_pipeline(stages, stage_ids, n_stages, cfg.parallel, par.pp_group, info.device)
        par.holds_loss = par.pipeline.has_last
    _sync_and_clip(par, stages[0], cfg.parallel, strategy)
    par.clip_grad_norm = summing_routed_grads(par.clip_grad_norm, stages, spec.blocks, mesh, cfg.parallel)
    if dims.tp > 1 and cfg.parallel.get("loss_parallel", False):
        from torch.distributed.tensor.parallel import loss_parallel

        par.loss_context = loss_parallel
    if dims.cp > 1:
        from framework.parallel.context import apply_cp

        par.split_batch, attention = apply_cp(model, mesh.device_mesh["cp"], cfg.parallel.get("cp_impl", "ring"))
        par.loss_context = _stacked(par.loss_context, attention)
    return par


def _stages(model: nn.Module, spec: ModelSpec, cfg: DictConfig, info: DistInfo, mesh: Mesh, strategy: Strategy):
    """Steps 1 to 6 of the order on a mesh: this rank's stages (stage ids, stage count: None without
    a pipeline), each tensor-parallel, checkpointed, compiled and sharded like a model of its own;
    and the copies of tied parameters that a pipeline put on other ranks (framework/parallel/ties.py)."""
    from framework.parallel.expert import apply_ep
    from framework.parallel.fsdp import apply_fsdp1, apply_fsdp2
    from framework.parallel.pipeline import build_stages, holder_ranks
    from framework.parallel.tensor import apply_tp

    dims, parallel_cfg = mesh.dims, cfg.parallel
    # 1. pipeline split: this rank's stages, each parallelized below like a model of its own
    stage_ids = n_stages = None
    if dims.pp > 1:
        split = trace_split(model, spec, cfg.data.seq_len)
        stages, stage_ids, n_stages = build_stages(model, split, parallel_cfg, mesh.pp_rank, dims.pp)
    else:
        stages = [model]
    for stage in stages:  # 2. tensor parallel, and expert parallel (framework/parallel/expert.py)
        if dims.tp > 1:
            apply_tp(stage, spec, mesh.device_mesh["tp"], *_tp_knobs(parallel_cfg))
        if dims.ep > 1:
            apply_ep(stage, spec.blocks, *mesh.expert_meshes)
    split = retie(stages, spec.ties)  # one parameter again where tp made two; copies where pp split them
    ties = SplitTies()
    if spec.ties and dims.pp > 1:
        ties = split_ties(split, mesh.device_mesh, holder_ranks(parallel_cfg, dims.pp))
    if dims.dp > 1:  # BatchNorm over the data-parallel ranks together
        stages = [_global_batchnorm(stage, cfg, mesh.dp_group, info) for stage in stages]
    for stage in stages:
        # 3. context parallel (it shards the batch and swaps attention: nothing to wrap)
        # 4. activation checkpointing, 5. compile
        _checkpoint_and_compile(stage, spec, cfg)
    # 6. FSDP over the data-parallel axes (HSDP when dp_replicate > 1; dp_shard x cp with context parallel)
    if strategy.shards(dims) and strategy.fsdp1:
        stages = [apply_fsdp1(p, blocks_of(p, spec), mesh.dp_mesh, cfg, info.device) for p in stages]
    elif strategy.shards(dims):
        for stage in stages:
            apply_fsdp2(stage, blocks_of(stage, spec), mesh.dp_mesh, cfg)
    return stages, stage_ids, n_stages, ties


def _global_batchnorm(model: nn.Module, cfg: DictConfig, group, info: DistInfo) -> nn.Module:
    """parallel.sync_batchnorm: the model's BatchNorms over `group`'s micro-batches together
    (framework/parallel/batchnorm.py); models without BatchNorm are returned as they are."""
    from framework.parallel.batchnorm import has_batchnorm, sync_batchnorm

    if not cfg.parallel.get("sync_batchnorm", True) or not has_batchnorm(model):
        return model
    return sync_batchnorm(model, group, info.device)


def _sync_and_clip(par: Parallelized, root: nn.Module, parallel_cfg: DictConfig, strategy: Strategy) -> None:
    """The gradient-sync switch for accumulation (a pipeline's schedule syncs itself) and gradient
    clipping that knows how the gradients are sharded."""
    from framework.parallel.fsdp import fsdp2_grad_sync

    dims = par.mesh.dims
    sharded_fsdp1 = strategy.shards(dims) and strategy.fsdp1
    if par.pipeline is None and strategy.shards(dims) and not strategy.fsdp1:
        par.grad_sync = lambda enabled: fsdp2_grad_sync(root, enabled, parallel_cfg)
    elif par.pipeline is None and sharded_fsdp1:
        par.grad_sync = lambda enabled: (
            nullcontext() if enabled or parallel_cfg.get("sync_every_microbatch", False) else root.no_sync()
        )
    if sharded_fsdp1:
        par.clip_grad_norm = root.clip_grad_norm_
    else:
        par.clip_grad_norm = lambda max_norm: clip_sharded_grad_norm(par.module, max_norm, dims, par.ties)


def _tp_knobs(parallel_cfg: DictConfig) -> tuple[bool, bool]:
    """(sequence_parallel, loss_parallel): tp's knobs, their defaults where another choice widens tp.
    sequence_parallel is a bool here: validation resolved its auto (framework/config/model.py)."""
    return bool(parallel_cfg.get("sequence_parallel", None)), parallel_cfg.get("loss_parallel", False)


def _stacked(*contexts: Callable[[], AbstractContextManager]) -> Callable[[], AbstractContextManager]:
    def enter_all() -> ExitStack:
        stack = ExitStack()
        for context in contexts:
            stack.enter_context(context())
        return stack

    return enter_all


def _replicas(t: torch.Tensor, dims: ParallelDims) -> int:
    """How many ranks hold each element of (gradient) tensor `t`: ranks of its pipeline stage
    outside its mesh, times its mesh's replicated axes."""
    holders = dims.world_size // dims.pp
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return holders
    replicated = math.prod(mesh.size(i) for i, pl in enumerate(t.placements) if pl.is_replicate())
    return replicated * holders // mesh.size()


@torch.no_grad()
def clip_sharded_grad_norm(
    module: nn.Module, max_norm: float, dims: ParallelDims, ties: SplitTies | None = None
) -> torch.Tensor:
    """Global gradient norm over parameters sharded or replicated in any way (FSDP, TP, PP), with
    one all-reduce: each rank sums the squares of its local gradient shards, each divided by how
    many ranks hold that shard, so the world-wide sum counts every element once. Then the
    gradients are scaled in place (`max_norm` inf: not at all). No host sync. The copies of a
    parameter tied across pipeline ranks (`ties`) first sum their gradients, and count once."""
    copies = {}
    if ties is not None and ties.holders:
        ties.sync()
        copies = {id(p): ties.copies for p in ties.params()}
    grads = []
    for p in module.parameters():
        if p.grad is None:
            continue
        if any(pl.is_partial() for pl in getattr(p.grad, "placements", ())):
            # e.g. a sequence-parallel norm's weight: each tp rank holds a partial sum of its
            # gradient until someone asks; reduce it now, into the parameter's own layout.
            p.grad = p.grad.redistribute(p.grad.device_mesh, p.placements)
        holders = _replicas(p.grad, dims) * copies.get(id(p), 1)
        grads.append((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad, holders))
    total = local_squared_norm(grads, next(module.parameters()).device)
    dist.all_reduce(total)
    norm = total.sqrt()
    scale_grads_(grads, norm, max_norm)
    return norm


def local_squared_norm(grads: list[tuple[torch.Tensor, int]], device: torch.device) -> torch.Tensor:
    """Sum over (local gradient, holders) of its squared norm / holders, in fp32: one fused
    `_foreach_norm` per (holders, device, dtype) group instead of a few kernels per tensor."""
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g, replicas in grads:
        groups[(replicas, g.device, g.dtype)].append(g)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (replicas, _, _), tensors in groups.items():
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
        total += torch.stack(norms).to(device).pow(2).sum() / replicas
    return total


def scale_grads_(grads: list[tuple[torch.Tensor, int]], norm: torch.Tensor, max_norm: float) -> None:
    """Clip the gradients to `max_norm` given their global `norm` (a device tensor: no sync):
    multiplied by min(1, max_norm / norm) in fused `_foreach_mul_` per (device, dtype); with
    `max_norm` inf (no clipping configured) no multiply at all."""
    if math.isinf(max_norm):
        return
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g, _ in grads:
        groups[(g.device, g.dtype)].append(g)
    for (device, dtype), tensors in groups.items():
        torch._foreach_mul_(tensors, coef.to(device=device, dtype=dtype))
