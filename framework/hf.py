"""Hugging Face models through the model contract: ``model=hf model.config=<folder>``.

``from_config`` builds ``AutoModelForCausalLM.from_config`` from a local config.json (nothing is
downloaded) and declares what the contract asks: the task, the decoder layers as blocks (found
automatically), and the tensor-parallel plan of the config's ``base_model_tp_plan``.
``load_pretrained`` fills a model that was built on the meta device and parallelized with the
weights of a folder of safetensors: rank 0 reads one tensor at a time and broadcasts it, and each
rank keeps its own shard of it, so no rank holds more than one full-size tensor beyond its shards.
A mixture of experts (Qwen3-MoE, DeepSeek-V3, Mixtral, ...) keeps its experts as one 3-D weight,
its files one tensor per expert: ``grouped_experts_rename`` reads transformers' own conversion
mapping to stack them (a grouped weight's slices are held until its last is read).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from framework.contract import canonical_name

Rename = Callable[[str], tuple[str, Callable[[torch.Tensor], torch.Tensor]]]


def check_config_folder(folder: str | None, key: str = "model.config") -> str | None:
    """Why `folder`, given as `key`, cannot configure a model (None: it can)."""
    if folder is None:
        return "not set: model.pretrained=<folder> (config.json and *.safetensors) or model.config=<folder with config.json>"
    if not os.path.isdir(folder):
        weights = " and its *.safetensors" if key == "model.pretrained" else ""
        return f"no folder at {folder!r}; give a folder with a Hugging Face config.json{weights}"
    if not os.path.isfile(os.path.join(folder, "config.json")):
        return f"{folder!r} has no config.json"
    return None


def check_pretrained_folder(folder: str) -> str | None:
    if not os.path.isdir(folder):
        return f"no folder at {folder!r}"
    if not any(f.endswith(".safetensors") for f in os.listdir(folder)):
        return f"{folder!r} has no *.safetensors file"
    return None


def from_config(config: str, trust_remote_code: bool = False, attn_implementation: str = "sdpa") -> nn.Module:
    """A causal LM from `config` (a folder with config.json), with random (or no, on meta) weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(config, trust_remote_code=trust_remote_code, local_files_only=True)
    # training keeps no key/value cache: a checkpointed layer's recompute would append to it again
    # (the keys then longer than the queries, and selective recompute's saved ops out of step)
    hf_config.use_cache = False
    model = AutoModelForCausalLM.from_config(
        hf_config, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation
    )
    model.register_forward_pre_hook(_cache_on_meta, with_kwargs=True)
    model.task = "lm"
    if (rename := grouped_experts_rename(model)) is not None:
        model.from_hf_name = rename  # a mixture of experts: its files hold one tensor per expert
    model.n_heads = getattr(hf_config, "num_attention_heads", None)
    # `model.tp_plan` is transformers' own: the config's base_model_tp_plan under the base model's
    # prefix, and the head's; the contract reads it, with its style names mapped to ours
    return model


def _cache_on_meta(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A forward on the meta device (the FLOP count, the planner's trace) opens a cache: without
    one transformers looks for packed sequences in the positions, a data-dependent check that
    meta tensors cannot answer. The same operators run."""
    tokens = args[0] if args else kwargs.get("input_ids")
    if isinstance(tokens, torch.Tensor) and tokens.is_meta and "use_cache" not in kwargs:
        return args, {**kwargs, "use_cache": True}
    return None


class ExpertPart(NamedTuple):
    """Slice `index` of `count` along dim 0 of the module's tensor `name` (load_pretrained stacks
    them once all are read): one expert's weight, or, with `joined` > 1, one of the `joined`
    tensors an expert's slice joins along its dim 0 (gate and up in gate_up_proj: index =
    expert * joined + which)."""

    name: str
    index: int
    count: int
    joined: int = 1


def grouped_experts_rename(model: nn.Module) -> Rename | None:
    """transformers' own conversion mapping for the model's family, as load_pretrained's rename
    (None: the folder's names are the model's). A mixture of experts keeps its experts as one
    3-D weight (``mlp.experts.gate_up_proj``), its files one tensor per expert
    (``mlp.experts.3.gate_proj.weight``): a converter that stacks them (MergeModulelist(dim=0)),
    then joins its sources along dim 1 (Concatenate(dim=1)), gives ExpertParts; its renamings
    apply as they are. A converter with other operations places nothing: model.pretrained then
    names the parameters it would have filled."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_converters, apply_renamings

    transforms = get_model_conversion_mapping(model, add_legacy=False)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    if not converters:
        return None
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    shapes = {canonical_name(n): tuple(p.shape) for n, p in model.named_parameters()}

    def rename(name: str) -> tuple[str | ExpertPart, Callable[[torch.Tensor], torch.Tensor]]:
        renamed = apply_renamings(name, renamings)
        ours, pattern = apply_converters(renamed, converters)
        if pattern is None:
            return ours, _same
        converter = next(c for c in converters if pattern in c.source_patterns)
        expert = re.search(re.escape(pattern).replace(r"\*", r"(\d+)"), renamed)
        if not _stacks_experts(converter) or expert is None or ours not in shapes:
            raise KeyError(name)  # left unplaced: named among the parameters the folder did not fill
        joined = len(converter.source_patterns)
        index = int(expert.group(1)) * joined + converter.source_patterns.index(pattern)
        return ExpertPart(ours, index, shapes[ours][0] * joined, joined), _same

    return rename


def _stacks_experts(converter: Any) -> bool:
    """Whether a converter's operations are the ones ExpertParts apply: the experts stacked along a
    new dim 0, then (several sources) joined along dim 1."""
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in converter.operations]
    joins = (
        [("MergeModulelist", 0), ("Concatenate", 1)] if len(converter.source_patterns) > 1 else [("MergeModulelist", 0)]
    )
    return ops == joins and len(converter.target_patterns) == 1


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def ties_embeddings(config: str, trust_remote_code: bool = False) -> bool:
    """Whether the model of `config` (a folder with config.json) ties its head to the embedding,
    as transformers reads it: a config.json that does not say takes its model type's default
    (LlamaConfig: untied; GPT2Config: tied), never one default for all."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(config, trust_remote_code=trust_remote_code, local_files_only=True)
    return bool(getattr(hf_config, "tie_word_embeddings", False))


# ----------------------------------------------------------------------------- weights in


def safetensors_files(folder: str) -> list[str]:
    """The folder's weight files: those its index names (sharded), else every *.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    return [os.path.join(folder, n) for n in names]


def iter_tensors(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight in the folder, read one at a time (memory-mapped)."""
    from safetensors import safe_open

    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                yield name, f.get_tensor(name)


def tensor_index(folder: str) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(name, shape, dtype) of every weight, without reading the data."""
    from safetensors import safe_open

    out = []
    for path in safetensors_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118
                sl = f.get_slice(name)
                out.append((name, tuple(sl.get_shape()), _DTYPES[sl.get_dtype()]))
    return out


_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8, "BOOL": torch.bool}  # fmt: skip


@torch.no_grad()
def load_pretrained(
    module: nn.Module,
    folder: str,
    device: torch.device,
    rename: Rename | None = None,
    ties: dict[str, str] | None = None,
) -> list[str]:
    """Copy the folder's weights into `module`'s parameters, each rank into its own shards
    (DTensors) or whole tensors. Every rank takes part (a collective per tensor when a process
    group is up). `rename`: checkpoint name -> (the module's name, a layout change), for a model
    whose state dict differs from the checkpoint's (models/llama_hf.py; a checkpoint tensor may be
    a slice of one of the module's, (name, index, count): one expert of a grouped weight, stacked
    with the others before it is copied). Returns the module's
    parameter names the folder did not have; a shape that differs is a ValueError naming it.
    `ties` (alias -> source): a copy of a tied parameter (a pipeline's last stage holds the head
    tied to the embedding, which the checkpoint has once) is loaded from its source's tensor."""
    params = {canonical_name(n): p for n, p in module.named_parameters()}
    # a persistent buffer is in the files too (DeepSeek-V3's router bias): loaded, never required
    targets = {canonical_name(n): b for n, b in module.named_buffers()} | params
    distributed = dist.is_available() and dist.is_initialized()
    main = not distributed or dist.get_rank() == 0
    names: list = [tensor_index(folder) if main else None]
    if distributed:
        dist.broadcast_object_list(names, src=0)
    reader = iter_tensors(folder) if main else None
    loaded, parts = set(), {}
    for name, shape, dtype in names[0]:
        full = next(reader)[1].to(device) if main else torch.empty(shape, dtype=dtype, device=device)
        if distributed:
            dist.broadcast(full, src=0)
        ours, full = rename_tensor(rename, name, full)
        if isinstance(ours, tuple):  # a Part (name, index, count) of one of ours: stacked once all are read
            slices = parts.setdefault(ours.name, [None] * ours.count)
            slices[ours.index] = full
            if any(t is None for t in slices):
                continue
            ours, full = ours.name, stacked(ours, parts.pop(ours.name))
        for target_name in [ours, *(a for a, s in (ties or {}).items() if s == ours)]:
            target = targets.get(target_name)
            if target is None:
                continue
            if tuple(target.shape) != tuple(full.shape):
                raise ValueError(f"model.pretrained: {name} is {list(full.shape)} in {folder}, "
                                 f"{target_name} is {list(target.shape)} in the model")  # fmt: skip
            _copy_into(target, full)
            loaded.add(target_name)
        del full  # one full-size tensor at a time
    return sorted(set(params) - loaded)


def stacked(part: tuple, slices: list[torch.Tensor]) -> torch.Tensor:
    """A Part's slices stacked along a new dim 0; an ExpertPart's `joined` slices of each expert
    in one along their dim 0 (transformers' MergeModulelist(dim=0), then Concatenate(dim=1))."""
    full, joined = torch.stack(slices), getattr(part, "joined", 1)
    return full if joined == 1 else full.reshape(part.count // joined, joined * full.shape[1], *full.shape[2:])


def rename_tensor(rename: Rename | None, name: str, full: torch.Tensor) -> tuple[str, torch.Tensor]:
    if rename is None:
        return name, full
    try:
        ours, transform = rename(name)
    except KeyError:  # a tensor the model has no place for: left out (and named by the missing check)
        return name, full
    return ours, transform(full)


def _copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    if hasattr(param, "device_mesh"):  # a DTensor: keep this rank's part only
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(full.to(param.dtype), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full.to(param.dtype))


@torch.no_grad()
def restore_buffers(module: nn.Module, device: torch.device) -> None:
    """Recompute the non-persistent buffers a meta-device build left empty (rotary frequencies):
    each module holding them is built again alone, from its config, and its buffers copied."""
    for sub in module.modules():
        if hasattr(sub, "inv_freq") and hasattr(sub, "config"):
            fresh = type(sub)(sub.config).to(device)
            for name, buf in fresh.named_buffers(recurse=False):
                getattr(sub, name).copy_(buf)
