"""Start from a Hugging Face checkpoint: `model=llama model.pretrained=<folder>`.

The folder's tensors are read one at a time (models/llama_hf.py streams them with safe_open),
converted to our names and layout, and copied into this rank's part of each parameter: its
shard of a DTensor (FSDP2, tensor parallel), the whole of a plain one, nothing for parameters a
pipeline stage does not hold. Names and shapes are checked against the files' headers before a
single tensor is read, and every mismatch is named.
"""

from __future__ import annotations

from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.data import vocab_size_of
from framework.modules import canonical_name
from models.llama_args import LlamaArgs
from models.llama_hf import from_hf_name, hf_names, hf_tensor_shapes, iter_hf_tensors, to_hf_name


class PretrainedMismatch(ValueError):
    pass


def model_arguments(cfg: DictConfig) -> dict[str, Any]:
    """The model's constructor arguments: the `model` group's keys; a null vocab_size follows the
    data's tokenizer (a pretrained model's is its config.json's)."""
    kwargs = {k: v for k, v in OmegaConf.to_container(cfg.model).items() if k != "name"}
    if "vocab_size" in kwargs and kwargs["vocab_size"] is None and not cfg.model.get("pretrained"):
        kwargs["vocab_size"] = vocab_size_of(cfg.data)
    return kwargs


def load_pretrained(module: nn.Module, cfg: DictConfig, model: nn.Module) -> None:
    """model.pretrained: overwrite the initial values of `module` (the model, or this rank's part
    of it) with a Hugging Face checkpoint's; `model` is the plain model (its shape)."""
    if cfg.model.get("pretrained"):
        load_hf_weights(module, cfg.model.pretrained, model.args)


def check_names_and_shapes(folder: str, params: dict[str, torch.Size], args: LlamaArgs) -> None:
    """Raise PretrainedMismatch naming what the checkpoint lacks, what it has in excess, and
    which shapes differ (for the parameters in `params`: this rank's, under their full shapes)."""
    found = hf_tensor_shapes(folder)
    expected = {to_hf_name(name, args)[0]: name for name in hf_names(args)}
    extra_ok = {"lm_head.weight"} if args.tie_embeddings else set()  # some tied checkpoints keep a copy
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected) - extra_ok)
    if missing:
        problems.append(f"missing {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected[:8])}{' ...' if len(unexpected) > 8 else ''}")
    for hf, ours in expected.items():
        if hf in found and ours in params and tuple(params[ours]) != found[hf]:
            problems.append(f"{hf}: {list(found[hf])} in the checkpoint, {list(params[ours])} in the model")
    if problems:
        raise PretrainedMismatch(f"model.pretrained: {folder} does not match the model: " + "; ".join(problems))


@torch.no_grad()
def load_hf_weights(module: nn.Module, folder: str, args: LlamaArgs) -> int:
    """Copy the checkpoint in `folder` into `module`'s parameters (this rank's part of each).
    Returns the number of parameters filled. Holds one full tensor at a time."""
    params = {canonical_name(n): p for n, p in module.named_parameters()}
    check_names_and_shapes(folder, {n: p.shape for n, p in params.items()}, args)
    wanted = {to_hf_name(n, args)[0] for n in params if n in set(hf_names(args))}
    filled = 0
    for hf_name, tensor in iter_hf_tensors(folder, wanted):
        ours, transform = from_hf_name(hf_name, args)
        copy_into(params[ours], transform(tensor))
        filled += 1
    return filled


def copy_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the slice of `full` that this rank holds into `param` (a DTensor's local shard, or
    the whole plain tensor)."""
    if hasattr(param, "device_mesh"):  # a DTensor: its block of the global tensor
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        index = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
        param.to_local().copy_(full[index])
    else:
        param.copy_(full)
