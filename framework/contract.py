"""The model contract: what a model may declare, and what the framework does when it declares nothing.

Any ``nn.Module`` trains under every strategy. Each declaration below is optional; a model in
``models/`` (or a user's own file) declares it as a plain attribute or method, with no import of
torch.distributed or of this framework:

=================  =========================================  =========================================
declaration        meaning                                    without it
=================  =========================================  =========================================
``task``           ``"lm"``: tokens (B, T) -> logits          config ``model.task``, else ``"lm"``
                   (B, T, V); ``"classify"``: inputs ->
                   logits (B, C)
``blocks_path``    attribute path of the repeated layers      config ``model.blocks``, else the longest
                   (``"layers"``, ``"model.layers"``)         ModuleList of modules of one class
``tp_plan``        {submodule path: style}, ``*`` for a       config ``model.tp_plan``; none: no
                   block's index (Hugging Face's              ``parallel=tp``
                   ``base_model_tp_plan`` form); styles in
                   ``TP_STYLES``
``init_rule``      ``(name, dim) -> ("normal", std) |          built on the device, then parallelized
                   ("ones", 0) | ("zeros", 0)``: row-seeded   (each rank holds the whole model for a
                   (models/init.py), so it is built on meta   moment)
                   and each rank fills its own shard
``flops_per_token`` ``(seq_len, recomputed_blocks=0)``        counted once with FlopCounterMode on the
                                                              meta device
``embed``/``head`` what runs before the first block and      traced: the top-level modules called
                   after the last (pipeline stages)           before and after the blocks, as a chain
``trains_on``      data choices it trains on                  by task: lm on sequence data, classify
                                                              on any
(ties)             a parameter held twice (``self.output.     found, never declared: every strategy
                   weight = self.tok_embeddings.weight``)     keeps it one in value (parallel/ties.py)
``from_hf_name``   ``(hf name) -> (ours, layout change)``:    ``model.pretrained`` loads names that
                   a Hugging Face checkpoint's tensors in     match as they are
                   (``model.pretrained``)
``hf_entries``     ``() -> [(hf name, ours, expert index |    no Hugging Face export (``model.pt``);
``to_hf_name``     None, layout change)]``, ``(ours) ->       framework/checkpoint/export.py asks these, and
``hf_config``      (hf name, change)``, ``(dtype) -> dict``:  imports no model
                   the model out as transformers' files
=================  =========================================  =========================================

A model's output may be a tensor, a tuple whose first item is the logits, or an object with
``.logits`` (Hugging Face). ``ModelSpec`` is the framework's normalised view of one model.

The step protocol: what a module (any submodule; models/moe.py's routed layer is one) adds to a
training step, found one way (``step_modules``: a module with ``read_counts``):

=====================  ==================================================================
``step_counts()``      {counter: width}: what it counts each step, summed over every rank
                       in the step's one all-reduce (tensor-parallel peers, which compute
                       the same, are counted once)
``read_counts()``      {counter: device tensor}: its counts since the last read; resets
``after_step(totals)`` its block's totals over every rank, on the device (a post-step
                       update with no host read, e.g. bias balancing)
``figures``            the figures ``derive`` logs (framework/figures.py's fields, as dicts)
``derive(blocks)``     {counter: [a row per block]} of every block's totals, on the host ->
                       those figures
``set_aux_scale(s)``   (optional) it adds an auxiliary loss through backward: the framework
                       sets the factor of its gradient each step, as it scales the training
                       loss (a micro-batch's share, amp's loss scale)
=====================  ==================================================================
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

TASKS = ("lm", "classify")
# colwise/rowwise: a linear split by output/input features; output: the LM head (colwise over the
# vocabulary, gathered unless loss parallel); sequence_parallel: a norm run on sequence shards;
# gather_input: gather the sequence before this module (an attention or MLP container);
# embedding / position_embedding: split over their rows, output split along the sequence
# (sequence parallel only; replicated otherwise); vocab_embedding: a token embedding split over its
# rows in every setting (its output all-reduced, or reduce-scattered under sequence parallel);
# head_norm: a norm over each head's features (B, T, heads, head_dim) of the heads a colwise
# projection left this rank (its weight replicated, its gradient summed over the ranks: Qwen3's q/k norm)
TP_STYLES = ("colwise", "rowwise", "output", "sequence_parallel", "gather_input", "embedding", "position_embedding",
             "vocab_embedding", "head_norm")  # fmt: skip
# Hugging Face's plan strings, in ours
HF_STYLES = {"colwise_rep": "output", "colwise_gather_output": "output", "embedding_rowwise": "vocab_embedding"}
# keys of the `model` group that configure the framework, not the model's factory
RESERVED_KEYS = ("name", "task", "blocks", "tp_plan", "pretrained")
LM_DATA = ("text", "varlen", "tokens", "chat", "hf")


class ContractError(ValueError):
    """A model that does not give a strategy what it needs. ``key`` is the config key to fix."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


@dataclass
class ModelSpec:
    task: str
    blocks: str | None  # attribute path of the blocks (None: the model has none)
    tp_plan: dict[str, str] = field(default_factory=dict)  # as declared: patterns -> styles
    init_rule: Callable[[str, int], tuple[str, float]] | None = None
    flops_per_token: Callable[..., float] | None = None
    trains_on: tuple[str, ...] | None = None
    embed: Callable | None = None  # unbound: embed(module, tokens) -> hidden
    head: Callable | None = None  # unbound: head(module, hidden) -> logits
    heads: int | None = None  # attention heads, where the model says (tensor parallel splits whole heads)
    planner_shape: dict[str, int] | None = None  # gpt-like dims for the planner's activation formula
    # checkpoint name -> (our name, layout change): a state-dict adapter for model.pretrained (models/llama.py)
    from_hf_name: Callable | None = None
    # {a parameter held a second time: its first holder}, e.g. {"output.weight": "tok_embeddings.weight"}:
    # every strategy keeps them one parameter in value (framework/parallel/ties.py)
    ties: dict[str, str] = field(default_factory=dict)

    @property
    def on_meta(self) -> bool:
        """Built on the meta device and initialised shard by shard."""
        return self.init_rule is not None


# ----------------------------------------------------------------------------- building


def factory_kwargs(model_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The factory's keyword arguments: the group's keys less the framework's own."""
    return {k: v for k, v in model_cfg.items() if k not in RESERVED_KEYS}


class _SkipNormalOnMeta(TorchFunctionMode):
    """On the meta device an initialiser computes nothing, but torch's meta `normal_` runs through
    its Python reference, whose first call imports torch._dynamo: seconds of start-up in every
    process that builds on meta (the launcher's validation, each worker). Skipped; the weights are
    initialised when the model is materialised."""

    INITS = (torch.Tensor.normal_, nn.init.normal_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")
        if func in self.INITS and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **kwargs)


def build_model(model_cfg: Any, device: torch.device | str = "meta") -> nn.Module:
    """Instantiate ``model._target_`` with its keyword arguments (Hydra's instantiate: nested
    ``_target_`` and ``_partial_`` work) under ``device``."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    node = OmegaConf.to_container(model_cfg, resolve=True) if OmegaConf.is_config(model_cfg) else dict(model_cfg)
    skip = _SkipNormalOnMeta() if torch.device(device).type == "meta" else nullcontext()
    with torch.device(device), skip:
        return instantiate(factory_kwargs(node), _convert_="all")


def locate_target(model_cfg: Any) -> Any:
    """The class or function ``model._target_`` names; ContractError when it cannot be imported,
    with its real cause (no such module, a module without that name, or the module's own error)."""
    from framework.components import ComponentError, locate

    try:
        return locate(model_cfg, "model")
    except ComponentError as err:
        raise ContractError(err.key, str(err).split(": ", 1)[1]) from None


# ----------------------------------------------------------------------------- the spec


def spec_of(model: nn.Module, model_cfg: Mapping[str, Any]) -> ModelSpec:
    """What `model` declares, overridden by the config's ``task``, ``blocks`` and ``tp_plan``."""
    task = model_cfg.get("task") or getattr(model, "task", None) or "lm"
    if task not in TASKS:
        raise ContractError("model.task", f"got {task!r}; allowed: {', '.join(TASKS)}")
    blocks = model_cfg.get("blocks") or getattr(model, "blocks_path", None) or find_blocks(model)
    if blocks is not None:
        container = get_path(model, blocks, "model.blocks")
        if not isinstance(container, nn.ModuleList | nn.ModuleDict):
            raise ContractError("model.blocks", f"{blocks!r} is a {type(container).__name__}, not a ModuleList")
    plan = dict(model_cfg.get("tp_plan") or getattr(model, "tp_plan", None) or {})
    return ModelSpec(
        task=task,
        blocks=blocks,
        tp_plan={k: HF_STYLES.get(v, v) for k, v in plan.items()},
        init_rule=getattr(model, "init_rule", None),
        flops_per_token=getattr(model, "flops_per_token", None),
        trains_on=getattr(model, "trains_on", None),
        embed=getattr(type(model), "embed", None),
        head=getattr(type(model), "head", None),
        heads=getattr(model, "n_heads", None) or getattr(model, "n_head", None),
        planner_shape=model.planner_shape() if hasattr(model, "planner_shape") else None,
        from_hf_name=getattr(model, "from_hf_name", None),
        ties=tied_names(model),
    )


def tied_names(model: nn.Module) -> dict[str, str]:
    """{the name of each parameter held a second time: the name of its first holder}."""
    first: dict[int, str] = {}
    ties = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            ties[canonical_name(name)] = first[id(p)]
        else:
            first[id(p)] = canonical_name(name)
    return ties


def find_blocks(model: nn.Module) -> str | None:
    """The path of the longest ModuleList (or Sequential) whose modules share one class."""
    best, best_len = None, 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList | nn.Sequential) and len(module) > best_len:
            if len({type(m) for m in module}) == 1:
                best, best_len = name, len(module)
    return best


def get_path(model: nn.Module, path: str, key: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ContractError(key, f"{type(model).__name__} has no submodule {path!r}") from None


def blocks_of(model: nn.Module, spec: ModelSpec) -> list[nn.Module]:
    """The model's blocks in order (a pipeline stage: its own), none for a model without them."""
    if spec.blocks is None:
        return []
    try:
        container = model.get_submodule(spec.blocks)
    except AttributeError:
        return []
    return list(container.values()) if isinstance(container, nn.ModuleDict) else list(container)


def block_matrices(model: nn.Module, spec: ModelSpec) -> set[str]:
    """The plain model's weight matrices of its blocks (2-D and up), by name; for a model without
    blocks, every one but the embeddings' tables (what Muon orthogonalises, as Moonlight does)."""
    tables = {f"{m}.weight" if m else "weight" for m, mod in model.named_modules() if isinstance(mod, nn.Embedding)}
    if blocks_of(model, spec):
        return {n for n, p in model.named_parameters() if p.dim() >= 2 and n.startswith(f"{spec.blocks}.")}
    return {n for n, p in model.named_parameters() if p.dim() >= 2 and n not in tables}


def block_index(name: str, spec: ModelSpec) -> int | None:
    """The block a parameter name belongs to (``layers.3.attention.wq.weight`` -> 3), else None."""
    if spec.blocks is None or not name.startswith(spec.blocks + "."):
        return None
    return int(name[len(spec.blocks) + 1 :].split(".", 1)[0])


def step_modules(model: nn.Module, spec: ModelSpec) -> list[tuple[int | None, nn.Module]]:
    """(block index or None, module) of every module speaking the step protocol (above), in the
    model's order, through any wrapper (DDP, FSDP, checkpointing, compile, a pipeline's stage)."""
    found = []
    for name, module in model.named_modules():
        if callable(getattr(module, "read_counts", None)):
            plain = canonical_name(name).removeprefix("module.")
            found.append((block_index(plain + ".", spec), module))
    return found


def step_buffers(model: nn.Module) -> list[str]:
    """The buffers of the step protocol's modules, by name: each rank updates its own from the
    step's reduced totals (after_step), identically, so no strategy needs to sync them."""
    return [f"{name}.{b}" if name else b for name, module in model.named_modules()
            if callable(getattr(module, "read_counts", None)) for b, _ in module.named_buffers(recurse=False)]  # fmt: skip


def forget_counts(model: nn.Module) -> None:
    """Drop what the step protocol's modules counted so far (a forward that is not a step's: a
    pipeline's shape inference)."""
    for module in model.modules():
        if callable(getattr(module, "read_counts", None)):
            module.read_counts()


def expand_plan(model: nn.Module, spec: ModelSpec) -> dict[str, str]:
    """The tensor-parallel plan on this model's (or stage's) submodules: each pattern matched
    against every submodule path (``*`` matches one name). A pattern that matches nothing in the
    full model is an error; in a pipeline stage, other stages' blocks are simply absent, and so
    are the stand-ins for its other modules (nn.Identity)."""
    names = [n for n, m in model.named_modules() if n and not isinstance(m, nn.Identity)]
    out: dict[str, str] = {}
    for pattern, style in spec.tp_plan.items():
        if style not in TP_STYLES:
            raise ContractError("model.tp_plan", f"{pattern}: style {style!r}; allowed: {', '.join(TP_STYLES)}")
        for name in names:
            if name.count(".") == pattern.count(".") and fnmatch.fnmatchcase(name, pattern):
                out[name] = style
    return out


def check_plan(model: nn.Module, spec: ModelSpec) -> None:
    """Every pattern of the plan names a submodule that exists."""
    names = [n for n, _ in model.named_modules() if n]
    for pattern in spec.tp_plan:
        if not any(n.count(".") == pattern.count(".") and fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ContractError("model.tp_plan", f"{pattern!r} names no submodule of {type(model).__name__}")
    expand_plan(model, spec)  # the styles


WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter's name in the plain model (wrappers' prefixes removed)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, a tuple's first item, or ``.logits``."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    return output[0]
