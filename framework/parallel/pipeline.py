"""Pipeline parallelism with torch.distributed.pipelining, for any model whose blocks split cleanly.

The blocks are split into stages (12 layers over 2 ranks: 6 and 6, the article's example); each
rank runs its stage(s) and passes activations forward and gradients back to its neighbours.
A step's local batch is cut into ``n_microbatches`` that flow through the stages in the order of
the schedule: GPipe (all forwards, then all backwards), 1F1B (one forward, one backward: fewer
activations alive), Interleaved1F1B (several smaller stages per rank: a smaller bubble), and the
zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble: weight gradients computed apart from
input gradients to fill the bubble).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from omegaconf import DictConfig
from torch import nn

from framework.contract import WRAPPER_PREFIXES, ContractError, ModelSpec, blocks_of, logits_of
from framework.loss import ScaledLoss
from framework.measure.flops import GroupedOnMeta

WRAPPED = tuple(prefix.rstrip(".") for prefix in WRAPPER_PREFIXES)  # the wrapped module's attribute
SINGLE_STAGE = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B"}
MULTI_STAGE = {
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
}


def least_microbatches(schedule: str, stages: int) -> int:
    """The fewest micro-batches `schedule` runs over `stages` stages: GPipe any number; 1F1B
    (torch checks it) and the multi-stage schedules one per stage at least."""
    return 1 if schedule == "GPipe" else stages


SCHEDULES = (*SINGLE_STAGE, *MULTI_STAGE)  # the names `parallel.schedule` accepts


def stages_per_rank(cfg: DictConfig) -> int:
    """Virtual stages per rank: 1 for single-stage schedules; for multi-stage ones the configured
    number, at least 2 (0 means auto: 2). `cfg`: any mesh choice's group (pp's knobs default
    where another choice widens pp)."""
    if cfg.get("schedule", "1F1B") in SINGLE_STAGE:
        return 1
    return max(2, cfg.get("stages_per_rank", 0))


@dataclass(frozen=True)
class Split:
    """Where a model divides around its blocks: the modules beside them called before the first
    block and after the last (traced), and the model's own ``embed``/``head`` when it has them
    (else the before and after modules run as a chain). Blocks kept deeper than the top level
    (Hugging Face's ``model.layers``) run inside the model's own forward (`own_forward`): the
    first stage takes the tokens, the others the hidden states as ``inputs_embeds``, and the
    modules after the blocks pass them through on every stage but the last."""

    blocks: str
    before: tuple[str, ...]
    after: tuple[str, ...]
    embed: Callable | None = None
    head: Callable | None = None
    own_forward: bool = False


class StageBlocks(nn.ModuleDict):
    """A stage's blocks under the full model's indices (``layers.7``), in order; a slice (as
    Hugging Face's forward takes ``self.layers[:n]``) gives the blocks themselves."""

    def __getitem__(self, key):
        return list(self.values())[key] if isinstance(key, slice) else super().__getitem__(key)


def _beside(model: nn.Module, blocks: str) -> list[tuple[str, nn.Module]]:
    """The modules beside the blocks, by dotted name: the top-level children, and for blocks kept
    deeper the children of each module on the way down."""
    found, prefix, module = [], "", model
    for part in blocks.split("."):
        found += [(prefix + n, m) for n, m in module.named_children() if n != part]
        module, prefix = getattr(module, part), f"{prefix}{part}."
    return found


def trace_split(model: nn.Module, spec: ModelSpec, seq_len: int) -> Split:
    """Run the model once on a (1, seq_len) batch of token 0, recording which top-level modules run
    before and after the blocks, and whether each feeds the next (a chain)."""
    nested = spec.blocks is not None and "." in spec.blocks
    if nested and "inputs_embeds" not in inspect.signature(model.forward).parameters:
        raise ContractError("model.blocks", f"{spec.blocks!r}: a pipeline splits blocks kept below the top level "
                            "inside the model's own forward, which then takes `inputs_embeds` (as Hugging Face's)")  # fmt: skip
    calls: list[tuple[str, int, int]] = []  # (name, id(input), id(output)) in call order

    def record(name):
        return lambda mod, args, out: calls.append((name, id(args[0]) if args else 0, id(out)))

    hooks = [m.register_forward_hook(record(n)) for n, m in _beside(model, spec.blocks)]
    hooks += [b.register_forward_hook(record(spec.blocks)) for b in blocks_of(model, spec)]
    device = next(model.parameters()).device
    tokens = torch.zeros(1, seq_len, dtype=torch.long, device=device)
    try:
        with torch.no_grad(), GroupedOnMeta():  # on meta, routed experts' grouped matmul runs as a plain one
            out = logits_of(model(tokens))
    finally:
        for h in hooks:
            h.remove()
    names = [c[0] for c in calls]
    first, last = names.index(spec.blocks), len(names) - 1 - names[::-1].index(spec.blocks)
    if spec.blocks in names[first : last + 1] and set(names[first : last + 1]) != {spec.blocks}:
        raise ContractError("parallel", f"pp: {type(model).__name__} runs other modules between its blocks")
    before, after = tuple(dict.fromkeys(names[:first])), tuple(dict.fromkeys(names[last + 1 :]))
    if nested:
        return Split(spec.blocks, before, after, own_forward=True)
    if spec.embed is None or spec.head is None:
        chain = [(id(tokens), None)] + [(c[1], c[2]) for c in calls] + [(id(out), None)]
        if any(nxt[0] != prev[1] for prev, nxt in zip(chain[1:-1], chain[2:], strict=False)) or chain[1][0] != id(
            tokens
        ):
            raise ContractError(
                "parallel", f"pp: {type(model).__name__}'s forward is not a plain chain around its blocks; "
                "declare embed(tokens) -> hidden and head(hidden) -> logits"
            )  # fmt: skip
    return Split(spec.blocks, before, after, spec.embed, spec.head)


def make_stage(model: nn.Module, split: Split, layers: list[int], first: bool, last: bool) -> nn.Module:
    """The model with only `layers` of its blocks (and the modules before them on the first
    stage, after them on the last). Submodules keep the full model's names (``blocks.7.attn.q``),
    so the state dicts of all stages together are the full model's; nothing is copied."""
    stage = _shallow(model)
    blocks = model.get_submodule(split.blocks)
    _set(stage, split.blocks, StageBlocks({str(i): blocks[i] for i in layers}))
    for name in split.before if not first else ():
        if any(True for _ in stage.get_submodule(name).parameters()):  # rotary tables stay on every stage
            _set(stage, name, None)
    for name in split.after if not last else ():
        _set(stage, name, nn.Identity() if split.own_forward else None)
    stage.pipeline_role = (split, first, last)
    stage.positions = None  # context parallel's, set each step (Pipeline.step)
    stage.forward = types.MethodType(_stage_forward, stage)
    return stage


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of `module` whose children, parameters and buffers are the same objects, in
    dictionaries of its own (so replacing one leaves `module` whole), with hooks of its own."""
    copy = type(module).__new__(type(module))
    nn.Module.__init__(copy)
    internals = set(copy.__dict__)
    copy.__dict__.update({k: v for k, v in module.__dict__.items() if k not in internals})
    copy._parameters, copy._buffers = dict(module._parameters), dict(module._buffers)
    copy._modules = dict(module._modules)
    return copy


def _set(stage: nn.Module, name: str, child: nn.Module | None) -> None:
    """Put `child` at the dotted `name` of a stage, its parents on the way copied (_shallow)."""
    *parents, leaf = name.split(".")
    for part in parents:
        stage._modules[part] = _shallow(stage._modules[part])
        stage = stage._modules[part]
    stage._modules[leaf] = child


def _stage_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    split, first, last = self.pipeline_role
    if split.own_forward:  # a view out (Hugging Face slices the positions it keeps) gets a storage of its own:
        # the zero-bubble schedules detach a stage's output in place
        out = logits_of(type(self).forward(self, x) if first else type(self).forward(self, inputs_embeds=x))
        return out if out._base is None else out.clone()
    where = {} if self.positions is None else {"positions": self.positions}
    if first:  # token ids in
        x = split.embed(self, x, **_taken(split.embed, where)) if split.embed else _chain(self, split.before, x)
    for block in self.get_submodule(split.blocks).values():
        x = block(x, **_taken(_unwrapped(block).forward, where))
    if last:  # logits out
        x = split.head(self, x) if split.head else _chain(self, split.after, x)
    return x


def _taken(fn: Callable, kwargs: dict) -> dict:
    """The `kwargs` that `fn` takes (a gpt block takes no positions; its embedding does)."""
    if not kwargs:
        return kwargs
    names = _parameter_names(getattr(fn, "__func__", fn))  # a bound method: its function, read once
    return {k: v for k, v in kwargs.items() if k in names}


@functools.cache
def _parameter_names(fn: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


def _unwrapped(block: nn.Module) -> nn.Module:
    """The block inside checkpointing's, compile's and FSDP1's wrappers (which take any arguments)."""
    while (inner := next((getattr(block, a) for a in WRAPPED if hasattr(block, a)), None)) is not None:
        block = inner
    return block


def _chain(module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> torch.Tensor:
    for name in names:
        x = getattr(module, name)(x)
    return x


def stage_ids(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """Which of the pp*per_rank stages this rank runs: looped (r, r+pp, ...) or, for the V
    schedules, r and 2pp-1-r (so the first and last stage share rank 0)."""
    if per_rank == 1:
        return [pp_rank]
    if schedule.startswith("ZBV"):
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def holder_ranks(cfg: DictConfig, pp: int) -> list[int]:
    """The pipeline ranks that run the first or the last stage (one rank under the V schedules)."""
    per_rank, schedule = stages_per_rank(cfg), cfg.get("schedule", "1F1B")
    ends = {0, pp * per_rank - 1}
    return [r for r in range(pp) if ends & set(stage_ids(r, pp, per_rank, schedule))]


def split_layers(n_layer: int, n_stages: int) -> list[list[int]]:
    """Layers per stage, as even as possible (earlier stages take the remainder)."""
    base, extra = divmod(n_layer, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


@dataclass
class Pipeline:
    """Runs one optimizer step's forward and backward through the schedule."""

    schedule: object
    has_first: bool
    has_last: bool
    n_microbatches: int
    stages: dict[int, nn.Module] = field(default_factory=dict)  # this rank's stage modules by stage id
    loss: ScaledLoss = field(default_factory=ScaledLoss)  # the schedule's loss_fn
    rebuild: Callable[[], object] | None = None  # the schedule built anew over the same stage modules
    shape: tuple[int, ...] | None = None  # the local batch's shape the schedule last stepped on

    def step(self, inputs: torch.Tensor, target: torch.Tensor, positions: torch.Tensor | None = None,
             weight: torch.Tensor | float = 1.0) -> torch.Tensor:  # fmt: skip
        """Forward+backward of the local batch; returns the mean of the micro-batches' weighted
        losses on ranks holding the last stage (zero elsewhere: the loss lives there). `positions`
        (context parallel: the places of this rank's share of each sequence) go to every stage's
        embedding and blocks; `weight` multiplies each micro-batch's summed loss (ScaledLoss)."""
        self.place(positions)
        self.fit(tuple(inputs.shape))
        self.loss.weight = weight
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        if self.has_last and "return_outputs" in inspect.signature(self.schedule.step).parameters:
            kwargs["return_outputs"] = False  # the losses are read, never the logits: not one kept per micro-batch
        self.schedule.step(*args, **kwargs)
        if not self.has_last:
            return torch.zeros((), device=target.device)
        return torch.stack([loss.detach() for loss in losses]).mean()

    def fit(self, shape: tuple[int, ...]) -> None:
        """A step of another batch or sequence length (data.batch_schedule, data.seq_len_schedule)
        than the last: torch's stages infer their micro-batch shapes (and size their receive
        buffers) in their first step, so the schedule is built anew, with as many micro-batches,
        each of the new shape. Every rank of a pipeline steps on the same shape, and rebuilds alike."""
        if self.shape is not None and shape != self.shape and self.rebuild is not None:
            self.schedule = self.rebuild()
        self.shape = shape

    def place(self, positions: torch.Tensor | None) -> None:
        """Context parallel: the places of this rank's share of each sequence, for every stage."""
        for stage in self.stages.values():
            stage.positions = positions


def build_stages(
    model: nn.Module, split: Split, cfg: DictConfig, pp_rank: int, pp: int
) -> tuple[list[nn.Module], list[int], int]:
    per_rank = stages_per_rank(cfg)
    n_stages = pp * per_rank
    layers = split_layers(len(model.get_submodule(split.blocks)), n_stages)
    ids = stage_ids(pp_rank, pp, per_rank, cfg.get("schedule", "1F1B"))
    stages = [make_stage(model, split, layers[s], first=s == 0, last=s == n_stages - 1) for s in ids]
    return stages, ids, n_stages


class LocalStages(nn.Module):
    """All the stages this rank runs, as one module whose parameter names are the full model's
    (for the optimizer, clipping, memory accounting and checkpoints)."""

    def __init__(self, stages: list[nn.Module], blocks: str):
        super().__init__()
        merged = StageBlocks()
        for stage in stages:
            merged.update(stage.get_submodule(blocks))
            _graft(self, stage, blocks.split("."))
        _set(self, blocks, merged)


def _graft(into: nn.Module, stage: nn.Module, path: list[str]) -> None:
    """A stage's modules into `into` under their names, but the blocks (at `path`); a module that
    holds parameters wins over a stand-in without (a norm over the Identity of another stage)."""
    for name, child in stage.named_children():
        if name == path[0] and len(path) > 1:
            if name not in into._modules:
                into.add_module(name, nn.Module())
            _graft(into._modules[name], child, path[1:])
        elif name != path[0] and (name not in into._modules or not _holds(into._modules[name])):
            into.add_module(name, child)


def _holds(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())
