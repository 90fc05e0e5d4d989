"""The model and optimizer state as checkpoints hold them: torch's distributed state dicts with the
optimizer's flattened, every entry keyed by its parameter's name (`state.<name>.exp_avg`,
`param_groups.<name>.lr`), as torchtitan saves them. Keyed by name, not by group index, each
pipeline stage's entries are its own: unflattened, the stages' `param_groups.0.params` lists
collided and one stage's won (a pipeline could not resume its own checkpoint).

A parameter a converter holds as a wrapper tensor subclass (torchao's float8 weights, whose
all-gather casts them) is saved as the plain tensor it wraps, its storage shared (a load writes
through it): a checkpoint holds plain tensors, which a run without that converter, or torch's
weights-only unpickler, reads.

A tied parameter held twice (a pipeline holds the embedding and the head on two stages) may be
missing from a checkpoint that held it once (one process): the copy borrows its source's entries."""

from __future__ import annotations

import torch
from torch import nn


def options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model's, optimizer's flattened) distributed state dicts."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=options())
    return plain_tensors(model_sd), plain_tensors(optim_sd)


def plain_tensors(state: dict) -> dict:
    """`state` with each wrapper subclass holding one tensor of its own shape (its local shard, in
    a DTensor) replaced by that tensor, the same storage; every other value as it is."""
    return {k: _plain(v) for k, v in state.items()}


def _plain(value):
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if isinstance(value, DTensor):
        inner = _plain(value._local_tensor)
        if inner is value._local_tensor:
            return value
        return DTensor.from_local(inner, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())  # fmt: skip
    if isinstance(value, torch.Tensor) and is_traceable_wrapper_subclass(value):
        names, _ = value.__tensor_flatten__()
        inner = [getattr(value, n) for n in names]
        if len(inner) == 1 and inner[0].shape == value.shape and type(inner[0]) is torch.Tensor:
            return inner[0]
    return value


def load_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, model_sd: dict, optim_sd: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options())


def _entries(flat: dict, name: str) -> list[str]:
    return [k for k in flat if k.startswith((f"state.{name}.", f"param_groups.{name}."))]


def _renamed(key: str, old: str, new: str) -> str:
    kind, rest = key.split(".", 1)
    return f"{kind}.{new}{rest[len(old) :]}"


def borrow_tied_state(flat: dict, ties: dict[str, str], saved: dict) -> list[tuple[str, str, bool]]:
    """Point each tied copy's optimizer entries the checkpoint lacks at its source's (renamed, or,
    where the source is here too, dropped and copied after the load): (alias, source, copied).
    `saved`: the checkpoint's keys."""
    borrowed = []
    for alias, source in ties.items():
        mine = _entries(flat, alias)
        if not mine or any(k.startswith(f"optim.state.{alias}.") for k in saved):
            continue
        if not any(k.startswith(f"optim.state.{source}.") for k in saved):
            continue
        copied = bool(_entries(flat, source))
        for key in mine:
            entry = flat.pop(key)
            if not copied:
                flat[_renamed(key, alias, source)] = entry
        borrowed.append((alias, source, copied))
    return borrowed


def return_tied_state(flat: dict, borrowed: list[tuple[str, str, bool]]) -> None:
    for alias, source, copied in borrowed:
        for key in _entries(flat, source):
            value = flat[key] if copied else flat.pop(key)
            flat[_renamed(key, source, alias)] = value.clone() if copied and isinstance(value, torch.Tensor) else value
