"""Muon (Jordan et al. 2024; "Muon is Scalable for LLM Training", Moonshot AI 2025): momentum
whose update is orthogonalised by a Newton-Schulz iteration, for the blocks' weight matrices, and
AdamW for the rest (embeddings, the output head, norms, biases), as Moonlight and Kimi K2 train.

    B <- mu B + g;  U <- g + mu B (Nesterov);  O <- NS5(U);  W <- (1 - lr wd) W - lr s O

`s = 0.2 sqrt(max(rows, cols))` (Moonlight's): the update's RMS matches AdamW's, so AdamW's
learning rate and weight decay carry over. The matrices
are those the framework's parameter groups mark (`"matrix": True`, framework/optimizers): the
blocks' parameters of 2 dims and more. A 3-D one (the routed experts' stacked weights) is a batch of
matrices, one per expert; one of 4 dims or more (a convolution's filters) is seen as
rows x (the rest).

Distributed: each matrix is orthogonalised whole. A DTensor's momentum (FSDP2's row shard, tensor
parallel's column or row shard, both in hybrid layouts) is gathered (`full_tensor`), every rank of
its mesh runs the same iteration on the same whole matrix, and keeps its own shard of the result
(`distribute_tensor` from local data: no second collective). So the update equals one process's
at every layout, for an all-gather of each matrix per step (the planner prices it:
framework/optimizers/prices.py). DDP and a pipeline hold whole matrices already. The iteration runs
in bfloat16 on a GPU (Keller Jordan's), in float32 on a CPU.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # the quintic's, chosen for its slope at zero (Keller Jordan)
EPS = 1e-8  # AdamW's, for the parameters outside the blocks' matrices


class Muon(torch.optim.Optimizer):
    """Muon on the groups marked `matrix`, AdamW on the others; one optimizer, one state dict."""

    steps_in_backward = False  # optim.in_backward: refused (config/memory_checks.py asks)
    steps_in_backward_why = "each matrix is gathered whole in the step, in the same order on every rank"

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 ns_steps: int = 5, betas: tuple[float, float] = (0.9, 0.95)):  # fmt: skip
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, ns_steps=ns_steps, betas=tuple(betas))
        super().__init__(params, defaults)

    @classmethod
    def check(cls, cfg) -> None:
        """Refusals before any worker starts (framework/components.py asks)."""
        o = cfg.optim
        if not 0 <= o.get("momentum", 0.95) < 1:
            raise ValueError(f"optim.momentum: got {o.momentum}; must be in [0, 1)")
        if o.get("ns_steps", 5) < 1:
            raise ValueError(f"optim.ns_steps: got {o.ns_steps}; must be >= 1 (Newton-Schulz iterations)")
        if cfg.parallel.get("version", 2) == 1 and cfg.parallel.name in ("fsdp", "hybrid"):
            raise ValueError("parallel.version: FSDP1 (version 1) flattens the parameters, and optim=muon orthogonalises "
                             "whole matrices: use parallel.version=2")  # fmt: skip

    @classmethod
    def planner_price(cls, kwargs: dict, elements: int, tensors: int, matrix: bool) -> int:
        """State bytes: a momentum buffer for a matrix; AdamW's two moments and its step otherwise."""
        return 4 * elements if matrix else 8 * elements + 4 * tensors

    @classmethod
    def planner_step(cls, kwargs: dict, shape: tuple[int, ...]) -> tuple[int, float]:
        """Per matrix of the blocks: the elements gathered whole, and the iteration's FLOPs."""
        return math.prod(shape), newton_schulz_flops(shape, kwargs.get("ns_steps", 5))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                (self._muon if group.get("matrix") else self._adamw)(p, group)
        return loss

    def _muon(self, p: torch.Tensor, group: dict) -> None:
        state, mu = self.state[p], group["momentum"]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        buf = state["momentum_buffer"].mul_(mu).add_(p.grad)
        ortho = orthogonalised(p.grad.add(buf, alpha=mu), group["ns_steps"])  # Nesterov's look-ahead
        scale = 0.2 * math.sqrt(max(_matrix_shape(p.shape)))  # the update's RMS matched to AdamW's
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(ortho, alpha=-group["lr"] * scale)

    def _adamw(self, p: torch.Tensor, group: dict) -> None:
        state, (beta1, beta2), grad = self.state[p], group["betas"], p.grad
        if "step" not in state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
        state["step"] += 1
        step = state["step"].item()  # a CPU scalar: no device sync
        state["exp_avg"].lerp_(grad, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**step)).add_(EPS)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / (1 - beta1**step))


def orthogonalised(update: torch.Tensor, steps: int) -> torch.Tensor:
    """NS(update) of the whole matrix: a DTensor's gathered, iterated on every rank alike, and
    returned in its own layout (each rank's shard cut from its own copy: no second collective)."""
    if isinstance(update, DTensor):
        whole = newton_schulz(update.full_tensor(), steps)
        return distribute_tensor(whole, update.device_mesh, update.placements, src_data_rank=None)
    return newton_schulz(update, steps)


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards U V^T of g = U S V^T (its singular values end
    near 1, between about 0.7 and 1.2, which trains as well as exact orthogonalisation)."""
    a, b, c = NS_COEFFICIENTS
    shape = g.shape
    x = g.reshape(shape[0], -1) if g.dim() != 3 else g  # (rows, rest), or a batch of experts' matrices
    x = x.to(torch.bfloat16 if x.is_cuda else torch.float32)
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the wide side: the Gram matrix is the smaller one
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x.reshape(shape).to(g.dtype)


def _matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """(rows, columns) of the matrix (or each expert's) the update is scaled for."""
    if len(shape) == 3:
        return shape[1], shape[2]
    return shape[0], math.prod(shape[1:])


def newton_schulz_flops(shape: tuple[int, ...], steps: int) -> float:
    """The iteration's FLOPs on one whole matrix (or batch of experts' matrices): per step, the
    Gram matrix (2 m^2 n), its square (2 m^3) and the product with x (2 m^2 n), m the short side."""
    batch = shape[0] if len(shape) == 3 else 1
    rows, cols = _matrix_shape(torch.Size(shape))
    m, n = min(rows, cols), max(rows, cols)
    return batch * steps * (4 * m * m * n + 2 * m**3)
