"""Hugging Face models through the model contract: ``model=hf model.config=<folder>``.

``from_config`` builds ``AutoModelForCausalLM.from_config`` from a local config.json (nothing is
downloaded) and declares what the contract asks: the task, the decoder layers as blocks (found
automatically), and the tensor-parallel plan of the config's ``base_model_tp_plan``.
``load_pretrained`` fills a model that was built on the meta device and parallelized with the
weights of a folder of safetensors: rank 0 reads one tensor at a time and broadcasts it, and each
rank keeps its own shard of it, so no rank holds more than one full-size tensor beyond its shards.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from framework.contract import canonical_name

Rename = Callable[[str], tuple[str, Callable[[torch.Tensor], torch.Tensor]]]


def check_config_folder(folder: str | None, key: str = "model.config") -> str | None:
    """Why `folder` cannot configure a model (None: it can)."""
    if folder is None:
        return "not set: model.pretrained=<folder> (config.json and *.safetensors) or model.config=<folder with config.json>"
    if not os.path.isdir(folder):
        return f"no folder at {folder!r}; give a folder with a Hugging Face config.json"
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
            ours, full = ours.name, torch.stack(parts.pop(ours.name))
        for target_name in [ours, *(a for a, s in (ties or {}).items() if s == ours)]:
            target = params.get(target_name)
            if target is None:
                continue
            if tuple(target.shape) != tuple(full.shape):
                raise ValueError(f"model.pretrained: {name} is {list(full.shape)} in {folder}, "
                                 f"{target_name} is {list(target.shape)} in the model")  # fmt: skip
            _copy_into(target, full)
            loaded.add(target_name)
        del full  # one full-size tensor at a time
    return sorted(set(params) - loaded)


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
