"""The planner's analytical model: what one rank of a layout holds, saves for backward and sends
per optimizer step, from the model's parameter shapes and the config alone (nothing runs).

- State: every parameter's local shape under the layout (its pipeline stage; tensor parallel's
  column/row split; expert parallel's experts / ep, then FSDP's chunk of them over the dp_shard
  ranks ep leaves; FSDP's dim-0 chunk, padded as FSDP2 pads, or FSDP1's flat shard), times 4
  bytes (parameters, gradients and optimizer states stay fp32; autocast casts on the fly).
- Saved activations: `framework.plan.activations`; the peak: `framework.plan.peak`.
- Collectives: payloads by op and group (DDP's bucketed all-reduce, FSDP's all-gathers and
  reduce-scatters per unit, tensor parallel's per-block gathers and scatters, a pipeline's
  sends), counted like `framework.measure.comm` counts measured ones, with its ring factors for wire bytes.

What it ignores: padding under variable-length data (it takes the configured micro-batch as
full). The shapes of a layout are walked once per model (`predict.shapes_of` caches them).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from omegaconf import DictConfig
from torch import nn


@dataclass(frozen=True)
class Layout:
    """What the formulas need of a strategy (any `parallel` group, resolved at a world size)."""

    name: str
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    fsdp: int = 0  # 0: not sharded; 1 or 2: FSDP version
    reshard: bool = True  # FSDP: gather again for backward (FULL_SHARD / reshard_after_forward)
    sequence_parallel: bool = False
    loss_parallel: bool = False
    schedule: str = "1F1B"
    n_microbatches: int = 1
    stages_per_rank: int = 1
    comm_hook: str = "none"
    sync_every_microbatch: bool = False
    bucket_cap_mb: float = 25.0
    cp: int = 1  # context parallel: each sequence split over cp ranks
    cp_impl: str = "ring"
    ep: int = 1  # expert parallel: routed experts split over ep of the dp_shard ranks

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def shard(self) -> int:
        """Ranks FSDP shards the model state over: dp_shard x cp (cp ranks share state, as torchtitan)."""
        return self.dp_shard * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def expert_shard(self) -> int:
        """Ranks FSDP shards each ep rank's experts over: the dp_shard (x cp) ranks ep leaves."""
        return self.dp_shard * self.cp // self.ep

    @property
    def stages(self) -> int:
        return self.pp * self.stages_per_rank


def layout_of(parallel: DictConfig, world: int, n_layer: int | None = None, n_head: int | None = None) -> Layout:
    """The Layout a `parallel` config group runs at `world` ranks."""
    from framework.parallel.dims import ParallelDims
    from framework.parallel.pipeline import stages_per_rank

    p = parallel
    if p.name in ("none", "dp"):
        return Layout(p.name)
    if p.name == "ddp":
        return Layout("ddp", dp_replicate=world, comm_hook=p.comm_hook, bucket_cap_mb=p.bucket_cap_mb)
    dims = ParallelDims.from_config(p, world, n_layer, n_head)
    # a knob the choice lacks (another strategy's, on a widened axis) takes its schema default
    fsdp = p.get("version", 2) if (dims.dp * dims.cp > 1 or p.name == "fsdp") else 0
    reshard = p.get("reshard_after_forward", True)
    if fsdp == 1:
        reshard = p.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD")
        if p.sharding_strategy == "NO_SHARD":
            return Layout("ddp", dp_replicate=world, bucket_cap_mb=p.get("bucket_cap_mb", 25.0))
    return Layout(
        p.name, dims.dp_replicate, dims.dp_shard, dims.tp, dims.pp, fsdp, reshard,
        sequence_parallel=dims.tp > 1 and bool(p.get("sequence_parallel", None)),  # resolved in validation
        loss_parallel=dims.tp > 1 and p.get("loss_parallel", False),
        schedule=p.get("schedule", "1F1B"), n_microbatches=p.get("n_microbatches", 4) if dims.pp > 1 else 1,
        stages_per_rank=stages_per_rank(p) if dims.pp > 1 else 1,
        sync_every_microbatch=p.get("sync_every_microbatch", False), cp=dims.cp, cp_impl=p.get("cp_impl", "ring"),
        ep=dims.ep,
    )  # fmt: skip


# ----------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    stage: int  # pipeline stage that holds it (0 without a pipeline)
    unit: str  # FSDP unit: "blocks.<i>" or "root"
    tp_dim: int | None  # the dim tensor parallel splits (None: replicated)
    style: str | None = None  # its module's entry in the tensor-parallel plan
    trainable: bool = True  # False: frozen (peft=lora's base), no gradient or optimizer state
    expert: bool = False  # a routed layer's grouped expert weight (experts x ...): split over ep
    matrix: bool = False  # one of the blocks' weight matrices (contract.block_matrices: Muon's)
    gather_bytes: float | None = None  # bytes an element FSDP gathers it in, where a converter says (float8's 1)


@dataclass(frozen=True)
class TPShape:
    """What tensor parallel's traffic depends on, read from the model's declared plan."""

    hidden: int  # the residual stream's width (the first linear's input features in a block)
    vocab: int  # the output head's rows (0: no head in the plan)
    per_block: dict[str, int]  # style -> modules of a block
    top: dict[str, int]  # style -> top-level modules
    block_norm_params: list[int]  # elements of each sequence-parallel norm parameter of a block
    top_norm_params: list[int]


@dataclass(frozen=True)
class MoEShape:
    """What expert parallel's all-to-alls depend on (models/moe.py)."""

    experts: int
    top_k: int
    dim: int  # a token's width (the rows sent)
    blocks: frozenset[int]  # the blocks with a routed layer


@dataclass(frozen=True)
class Shapes:
    """The model as the planner sees it: its parameters, and what its plan and blocks declare."""

    params: list[Param]
    gpt: dict[str, int] | None  # the model's planner_shape (a gpt-like block): n_layer, n_head, n_embd, vocab_size
    flops_per_token: float | None  # model FLOPs (matmuls), forward + backward
    hardware_flops_per_token: float | None  # with checkpointing's recomputation
    stage_layers: list[list[int]] = field(default_factory=list)
    buffers: dict[str, int] = field(default_factory=dict)  # bytes of the model's buffers, by dtype
    hidden: int | None = None  # the residual stream's width (what a pipeline stage sends)
    tp: TPShape | None = None
    batchnorm: list[int] = field(default_factory=list)  # channels of each BatchNorm layer
    moe: MoEShape | None = None  # routed experts


def model_shapes(cfg: DictConfig, layout: Layout) -> Shapes:
    """Parameter shapes from the model built on the meta device (no memory) and its contract."""
    from framework.config.model import meta_model, model_spec
    from framework.contract import block_index, block_matrices, blocks_of, expand_plan
    from framework.measure.metrics import model_flops, recomputed_blocks
    from framework.parallel.pipeline import split_layers
    from framework.plan.convert import converter_prices, gather_bytes

    model, spec = meta_model(cfg), model_spec(cfg)
    gathered = gather_bytes(converter_prices(cfg, model, spec))
    n_blocks = len(blocks_of(model, spec))
    layers = split_layers(n_blocks, layout.stages) if n_blocks else [[]]
    stage_of = {i: s for s, ids in enumerate(layers) for i in ids}
    first_stage = _first_stage(model, spec) if layout.pp > 1 else set()
    plan = expand_plan(model, spec) if layout.tp > 1 else {}
    moe, experts = routed_shape(model, spec)
    params, matrices = [], block_matrices(model, spec)
    for name, p in model.named_parameters():
        layer = block_index(name, spec)
        if layer is not None:
            stage = stage_of[layer]
        else:
            first = any(name.startswith(f"{module}.") for module in first_stage)
            stage = 0 if first or layout.pp == 1 else layout.stages - 1
        unit = f"{spec.blocks}.{layer}" if layer is not None else "root"
        style = plan.get(name.rpartition(".")[0])
        tp_dim, expert = _tp_dim(name, plan, layout), name.rpartition(".")[0] in experts
        params.append(Param(name, tuple(p.shape), stage, unit, tp_dim, style, p.requires_grad, expert,
                            name in matrices, gathered.get(name)))  # fmt: skip
    counted = model_flops(model, spec, cfg.data.get("seq_len"), recomputed_blocks(cfg, n_blocks))
    buffers: dict[str, int] = defaultdict(int)
    for b in model.buffers():
        buffers[str(b.dtype)] += b.numel() * b.element_size()
    hidden = residual_width(model, spec)
    tp = tp_shape(model, spec, plan, hidden) if plan else None
    norms = [m.num_features for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    return Shapes(params, spec.planner_shape, *(counted or (None, None)), layers, dict(buffers), hidden, tp, norms, moe)


def routed_shape(model: nn.Module, spec) -> tuple[MoEShape | None, set[str]]:
    """The routed layers' shape, and the paths of their grouped experts (none: (None, set()))."""
    from framework.moe import routed_layers

    layers = routed_layers(model, spec.blocks or "")
    if not layers:
        return None, set()
    experts = {id(layer.experts) for _, layer in layers}
    paths = {name for name, m in model.named_modules() if id(m) in experts}
    args, dim = layers[0][1].args, layers[0][1].experts.w1.shape[-1]
    return MoEShape(args.experts, args.top_k, dim, frozenset(i for i, _ in layers)), paths


_TRACED: dict[int, tuple[nn.Module, set[str]]] = {}  # held: an id is only unique while its object lives


def _first_stage(model: nn.Module, spec) -> set[str]:
    """The top-level modules a pipeline's first stage holds: one trace per model (tracing a 96-block
    model on meta takes seconds, and a plan compares dozens of pipeline layouts of it)."""
    from framework.parallel.pipeline import trace_split

    if id(model) not in _TRACED:
        _TRACED.clear()
        _TRACED[id(model)] = model, set(trace_split(model, spec, 2).before)
    return _TRACED[id(model)][1]


def residual_width(model: nn.Module, spec) -> int | None:
    """The input features of the first linear of the first block: the residual stream's width."""
    from framework.contract import blocks_of

    blocks = blocks_of(model, spec)
    linear = next((m for m in blocks[0].modules() if isinstance(m, nn.Linear)), None) if blocks else None
    return linear.in_features if linear is not None else None


def tp_shape(model: nn.Module, spec, plan: dict[str, str], hidden: int | None) -> TPShape:
    first = f"{spec.blocks}.0."
    per_block: dict[str, int] = defaultdict(int)
    top: dict[str, int] = defaultdict(int)
    block_norms, top_norms, vocab = [], [], 0
    for path, style in plan.items():
        in_block = path.startswith(first)
        if spec.blocks and path.startswith(spec.blocks + ".") and not in_block:
            continue  # other blocks: the same as the first
        (per_block if in_block else top)[style] += 1
        if style == "sequence_parallel":
            sizes = [p.numel() for p in model.get_submodule(path).parameters()]
            (block_norms if in_block else top_norms).extend(sizes)
        if style == "output":
            vocab = model.get_submodule(path).weight.shape[0]
    return TPShape(hidden or 0, vocab, dict(per_block), dict(top), block_norms, top_norms)


def _tp_dim(name: str, plan: dict[str, str], layout: Layout) -> int | None:
    """The dim tensor parallel splits parameter `name` along (None: replicated)."""
    module, _, kind = name.rpartition(".")
    style = plan.get(module)
    if style in ("colwise", "output"):
        return 0
    if style == "rowwise":
        return 1 if kind == "weight" else None
    if style == "vocab_embedding" or (style in ("embedding", "position_embedding") and layout.sequence_parallel):
        return 0
    return None


def stage_rank(stage: int, layout: Layout) -> int:
    """The pipeline rank that runs `stage` (looped, or V-shaped for the ZBV schedule)."""
    if layout.stages_per_rank == 1:
        return stage
    if layout.schedule.startswith("ZBV"):
        return stage if stage < layout.pp else 2 * layout.pp - 1 - stage
    return stage % layout.pp


def _tp_local(p: Param, tp: int) -> tuple[int, ...]:
    if p.tp_dim is None:
        return p.shape
    shape = list(p.shape)
    shape[p.tp_dim] = -(-shape[p.tp_dim] // tp)
    return tuple(shape)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def fsdp_rows(rows: int, n: int) -> tuple[int, int]:
    """(rank 0's rows, padded rows gathered) of a dim-0 chunk over n ranks (FSDP2)."""
    chunk = -(-rows // n)
    return chunk, chunk * n


# ----------------------------------------------------------------------------- state
