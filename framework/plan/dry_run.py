"""The dry run: the real code lays out one rank of each distinct role of an N-rank world, in this
one process, on torch's fake process group (every collective returns at once, nothing is sent)
with fake tensors (shapes and dtypes, no memory): the real device mesh, the model built on the
meta device, the real pipeline split, tensor parallel, checkpointing and FSDP2 sharding
(`framework.parallel.apply.parallelize`), the real optimizer. Each rank then runs one micro-batch's
forward and backward through its stages and an optimizer step, and reports what it holds,
counted from its tensors as a real run counts them (`framework.measure.memory`):

- parameter, gradient and optimizer bytes (`model_state_bytes` on the sharded tensors);
- saved activations: the peak of one micro-batch's forward and backward of each local stage
  (`SavedActivationMeter`), times the micro-batches the schedule keeps in flight on that stage.

A role: a pipeline rank (the first holds the embedding, the last the head, and a split may give
stages unequal blocks; ranks with the same stages are one role), at the first and the last
position along dp_shard (FSDP2 pads each dim-0 chunk, so the last may hold fewer rows). Tensor-,
context- and replicate-parallel peers hold the same shapes.

    python -m framework.plan plan.dry_run=true plan.world_size=1024 model=llama model.flavor=70b ...
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn

from framework.config import ConfigError
from framework.parallel.dims import AXES  # the mesh's order, outermost first
from framework.plan.activations import in_flight, micro_batch
from framework.plan.model import Layout, stage_rank

STATE = ("param_bytes", "grad_bytes", "optim_bytes")
MB = 2**20


@dataclass
class RankReport:
    """What one rank of the fake world holds, from its tensors."""

    rank: int
    coords: dict[str, int]  # its place on the mesh: pp, dp_replicate, dp_shard, cp, tp
    stages: list[int]
    state: dict[str, int]  # param_bytes, grad_bytes, optim_bytes
    activation_bytes: int  # saved for backward at the rank's peak (its in-flight micro-batches)
    seconds: float


def role_ranks(layout: Layout, n_blocks: int) -> list[int]:
    """One rank of each distinct role (module docstring), in rank order."""
    from framework.parallel.pipeline import split_layers

    layers = split_layers(n_blocks, layout.stages) if n_blocks else [[]] * layout.stages
    seen, ranks = set(), []
    for p in range(layout.pp):
        mine = [s for s in range(layout.stages) if stage_rank(s, layout) == p]
        role = tuple((s == 0, s == layout.stages - 1, len(layers[s])) for s in mine)
        if role in seen:
            continue
        seen.add(role)
        for shard in sorted({0, layout.dp_shard - 1}):
            ranks.append(flat_rank(layout, pp=p, dp_shard=shard))
    return ranks


def flat_rank(layout: Layout, **coords: int) -> int:
    """The rank at `coords` on the mesh (axes not given: 0)."""
    rank = 0
    for axis in AXES:
        rank = rank * getattr(layout, axis) + coords.get(axis, 0)
    return rank


def coords_of(layout: Layout, rank: int) -> dict[str, int]:
    """`rank`'s place on the mesh, axis by axis."""
    out = {}
    for axis in reversed(AXES):
        rank, out[axis] = divmod(rank, getattr(layout, axis))
    return {axis: out[axis] for axis in AXES}


def dry_run(cfg: DictConfig, world: int, layout: Layout) -> list[RankReport]:
    """A report for one rank of each distinct role of `layout` at `world` ranks."""
    from framework.config.model import meta_model, model_spec
    from framework.contract import blocks_of

    n_blocks = len(blocks_of(meta_model(cfg), model_spec(cfg)))
    ranks = role_ranks(layout, n_blocks)
    # each rank in a fresh interpreter: torch keeps meshes and groups in globals keyed by their shape,
    # which a second fake world of the same shape would find stale. Spawned, not forked: a fork of a
    # process whose autograd engine has started its threads cannot run backward, and a forkserver
    # would outlive the call (its exit waits on its forks)
    context = multiprocessing.get_context("spawn")
    with context.Pool(min(len(ranks), os.cpu_count() or 1), maxtasksperchild=1) as pool:
        return pool.starmap(_one_rank, [(cfg, world, layout, rank) for rank in ranks], chunksize=1)


def _one_rank(cfg: DictConfig, world: int, layout: Layout, rank: int) -> RankReport:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from framework.contract import build_model, spec_of
    from framework.converters import converted_model
    from framework.dist import DistInfo
    from framework.measure.memory import model_state_bytes
    from framework.optimizers.build import build_optimizer
    from framework.parallel.apply import parallelize

    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        info = DistInfo(rank, world, 0, 1, torch.device("cpu"), "fake")
        meta = build_model(cfg.model, "meta")
        spec = spec_of(meta, cfg.model)
        model, _ = converted_model(meta, spec, cfg, info)
        par = parallelize(model, spec, cfg, info, materialise=_fake_materialiser(fake))
        optimizer = build_optimizer(par.module, cfg.optim, par.decay, matrices=par.matrices)
        stages = list(par.pipeline.stages.items()) if par.pipeline is not None else [(0, par.module)]
        with fake:
            saved = sum(_stage_activations(cfg, layout, par, s, m) for s, m in stages)
            optimizer.step()
        state = model_state_bytes(par.module, optimizer)
    finally:
        dist.destroy_process_group()
    ids = [s for s, _ in stages]
    return RankReport(rank, coords_of(layout, rank), ids, {k: state[k] for k in STATE}, saved,
                      time.perf_counter() - start)  # fmt: skip


def _fake_materialiser(fake):
    """parallelize's materialise step with fake tensors: this rank's part allocated as shapes only
    (the values do not matter to what is held), its buffers made as a real run makes them."""
    from framework.modules import restore_buffers, to_empty

    def materialise(module: nn.Module, spec, cfg: DictConfig, device: torch.device) -> None:
        with fake:
            to_empty(module, device)
            restore_buffers(module, device)
            for sub in module.modules():
                if hasattr(sub, "init_buffers"):
                    sub.init_buffers()

    return materialise


def _stage_activations(cfg: DictConfig, layout: Layout, par, stage: int, module: nn.Module) -> int:
    """One micro-batch through `module` (a pipeline stage, or the whole model) forward and
    backward, under the saved-activation meter; times the schedule's micro-batches in flight."""
    from framework.contract import logits_of
    from framework.loss import cross_entropy
    from framework.measure.memory import SavedActivationMeter

    b, seq = micro_batch(cfg, layout), cfg.data.seq_len
    tokens = torch.zeros(b, seq, dtype=torch.long)
    (x,), kwargs, target = par.split_batch((tokens,), tokens)  # context parallel: this rank's part
    if stage > 0:  # what the previous stage sends: the residual stream (its local sequence part)
        split = layout.tp if layout.sequence_parallel else 1
        shape = (b, target.shape[1] // split, _hidden_width(module))
        x = torch.zeros(shape, dtype=_hidden_dtype(cfg, layout), requires_grad=True)
    meter = SavedActivationMeter(module, fake=True)
    with meter.measure(), par.loss_context():
        out = module(x, **kwargs)
        if stage == layout.stages - 1:
            cross_entropy(logits_of(out), target).backward()
        else:
            out.backward(torch.ones_like(out))
    return meter.peak * in_flight(stage, layout)


def _hidden_width(module: nn.Module) -> int:
    """The residual stream's width: the first linear's input features in the stage's first block."""
    split = module.pipeline_role[0]
    first = next(iter(module.get_submodule(split.blocks).values()))
    return next(m for m in first.modules() if isinstance(m, nn.Linear)).in_features


def _hidden_dtype(cfg: DictConfig, layout: Layout) -> torch.dtype:
    """What one stage sends the next: the blocks' compute dtype (FSDP's param_dtype), else fp32."""
    from framework.parallel.fsdp import mixed_precision_dtypes

    param_dtype, _ = mixed_precision_dtypes(cfg.precision.name, "fp32")
    return param_dtype if layout.fsdp and param_dtype is not None else torch.float32


# ----------------------------------------------------------------------------- the report


def role_config(cfg: DictConfig, world: int) -> DictConfig:
    """What every role runs: `cfg` validated as train.py validates a run of `world` ranks, so a bad
    setting is its one-line ConfigError before any role starts; on this CPU, where the roles run
    (no GPU count caps the fake world). Then resolved, as launch resolves a worker's: a spawned
    role has none of the front door's resolvers (`${data_vocab:}`)."""
    from framework.config import validate

    run = copy.deepcopy(cfg)
    with open_dict(run):
        run.device, run.launch.nproc_per_node = "cpu", world
    validate(run)
    return OmegaConf.create(OmegaConf.to_container(run, resolve=True))


def compare(cfg: DictConfig, world: int) -> tuple[list[RankReport], dict]:
    """The dry run's ranks, and the planner's forecast of the same layout at `world` ranks."""
    from framework.config.model import model_dims_of
    from framework.plan.model import layout_of
    from framework.plan.predict import predict

    cfg = role_config(cfg, world)
    layout = layout_of(cfg.parallel, world, *model_dims_of(cfg))
    if layout.name not in ("tp", "pp", "hybrid", "fsdp") or layout.fsdp == 1:
        got = "parallel.version=1" if layout.fsdp == 1 else f"parallel={layout.name}"
        raise ConfigError("plan.dry_run", f"lays out the mesh strategies with FSDP2 (fsdp, tp, pp, hybrid); got {got}")
    return dry_run(cfg, world, layout), predict(cfg, world)["memory"]


def report(cfg: DictConfig, world: int) -> str:
    """The table `python -m framework.plan plan.dry_run=true` prints: each role's bytes from its
    tensors, the most over the roles, and the planner's forecast (the rank holding most)."""
    ranks, predicted = compare(cfg, world)
    head = ["rank", "pp,dp_rep,dp_shard,cp,tp", "stages", "param MB", "grad MB", "optim MB", "activ. MB", "s"]
    rows = [[str(r.rank), ",".join(str(v) for v in r.coords.values()), ",".join(map(str, r.stages)),
             *(f"{r.state[k] / MB:.2f}" for k in STATE), f"{r.activation_bytes / MB:.2f}", f"{r.seconds:.1f}"]
            for r in ranks]  # fmt: skip
    most = {k: max(r.state[k] for r in ranks) for k in STATE} | {
        "activation_bytes": max(r.activation_bytes for r in ranks)
    }
    keys = (*STATE, "activation_bytes")
    rows.append(["most", "", "", *(f"{most[k] / MB:.2f}" for k in keys), ""])
    rows.append(
        ["planner", "", "", *(f"{predicted[k] / MB:.2f}" if predicted[k] is not None else "-" for k in keys), ""]
    )
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in [head, *rows]]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    exact = all(most[k] == predicted[k] for k in STATE)
    return (f"dry run of {cfg.model._target_} at {world} ranks on a fake process group: {len(ranks)} roles\n"
            + "\n".join(lines) + f"\nstate bytes {'equal' if exact else 'DIFFER FROM'} the planner's")  # fmt: skip
