"""What an optimizer costs the planner: the state bytes a rank holds for `elements` trainable
elements in `tensors` tensors, a group of the blocks' matrices apart (`matrix`); and, for an
optimizer that gathers its matrices (Muon), the bytes it gathers and the FLOPs it runs per step.

A class prices itself with a classmethod `planner_price(kwargs, elements, tensors, matrix) -> bytes`
(and, if it gathers, `planner_step(kwargs, shape) -> (gathered elements, FLOPs)` per matrix);
torch's own are priced here, by the class they are or derive from. Anything else is planned as if
its state were empty, and `unpriced` says so for the forecast to print.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Price = Callable[[int, int, bool], int]  # (elements, tensors, matrix) -> state bytes


def _adam(kwargs: dict, elements: int, tensors: int, matrix: bool) -> int:
    extra = 4 * elements if kwargs.get("amsgrad") else 0  # the running max of the second moment
    return 8 * elements + extra + 4 * tensors  # two moments (fp32), a 0-d step per tensor


def _sgd(kwargs: dict, elements: int, tensors: int, matrix: bool) -> int:
    return 4 * elements if kwargs.get("momentum", 0) else 0  # the momentum buffer, or none


def _rmsprop(kwargs: dict, elements: int, tensors: int, matrix: bool) -> int:
    copies = 1 + bool(kwargs.get("momentum", 0)) + bool(kwargs.get("centered"))
    return 4 * copies * elements + 4 * tensors


def _one_moment(kwargs: dict, elements: int, tensors: int, matrix: bool) -> int:
    return 4 * elements + 4 * tensors


TORCH_PRICES: list[tuple[type, Callable]] = [
    (torch.optim.Adam, _adam),  # AdamW derives from Adam in torch 2.x
    (torch.optim.AdamW, _adam),
    (torch.optim.NAdam, _adam),
    (torch.optim.RAdam, _adam),
    (torch.optim.Adamax, _adam),
    (torch.optim.SGD, _sgd),
    (torch.optim.RMSprop, _rmsprop),
    (torch.optim.Adagrad, _one_moment),
    (torch.optim.Muon, _one_moment),
]


def state_price(cls: Any, kwargs: dict) -> Price | None:
    """The class's state price under its `kwargs`, or None where nothing prices it."""
    own = getattr(cls, "planner_price", None)
    if own is not None:
        return lambda elements, tensors, matrix: own(kwargs, elements, tensors, matrix)
    for base, price in TORCH_PRICES:
        if isinstance(cls, type) and issubclass(cls, base):
            return lambda elements, tensors, matrix, price=price: price(kwargs, elements, tensors, matrix)
    return None


def step_price(cls: Any, kwargs: dict) -> Callable[[tuple[int, ...]], tuple[int, float]] | None:
    """Per matrix of the blocks (its whole shape): (elements gathered, FLOPs) the optimizer's step
    adds, for a class that declares them (Muon); None for the others (their step is elementwise)."""
    own = getattr(cls, "planner_step", None)
    return None if own is None else (lambda shape: own(kwargs, shape))


def unpriced(cls: Any) -> str:
    """The forecast's line for an optimizer nothing prices."""
    name = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else str(cls)
    return (f"optim: {name} declares no planner_price; its state is planned as empty "
            "(framework/optimizers/prices.py says how to declare one)")  # fmt: skip
