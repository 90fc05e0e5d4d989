"""A model's training FLOPs per token, counted once on the meta device (framework.measure.metrics).

torch's FlopCounterMode counts the matmuls it has a formula for. It has none for the grouped
matmul that routed experts run (``torch._grouped_mm``: transformers' ``grouped_mm`` experts,
its default), so their work would count 0; and torch's meta kernel for it takes bf16/fp16 only
(its CPU and CUDA kernels take fp32 too), so a float32 mixture of experts ended the count in
``RuntimeError: Expected mat_a to be BFloat16 ...``. Here, on meta, a grouped matmul is passed on
as the plain matmul of its FLOPs and output shape, which the counter counts. Where the meta
forward still cannot run (an operator with no meta kernel, or one whose output shape depends on
the data, such as an eager loop over the experts a token chose), the count is an estimate from
the weights and the config, and ``how`` says so.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from framework.contract import logits_of

GROUPED_MM = torch.ops.aten._grouped_mm
COUNTED_ON_META = "counted on meta"  # FlopCounterMode over a forward and backward of the model on meta
DECLARED = "declared by the model"  # its flops_per_token


def as_plain_matmul(a: torch.Tensor, b: torch.Tensor, groups: int) -> torch.Tensor:
    """The plain matmul of ``torch._grouped_mm(a, b, offs)``'s FLOPs (2·M·K·N) and output shape,
    in each of its forms (`groups`: offs' length). How the rows fall into groups is data, which
    meta tensors do not hold; it does not change the total."""
    if a.dim() == 2 and b.dim() == 3:  # tokens sorted by expert x one weight per expert: (M, N)
        return torch.mm(a, b[0])
    if a.dim() == 3 and b.dim() == 2:  # (M, N)
        return torch.mm(a[0], b)
    if a.dim() == 3:  # a batch: (G, M, N)
        return torch.bmm(a, b)
    return torch.mm(a, b).expand(groups, -1, -1)  # grouped along K (a weight's gradient): (G, M, N)


class GroupedOnMeta(TorchDispatchMode):
    """A grouped matmul of meta tensors passed on as its plain matmul (as_plain_matmul): torch's
    meta kernel refuses the grouped one in float32 (and widths not 16-byte aligned), and inside a
    FlopCounterMode the counter below counts the plain one (it has no formula for the grouped).
    Any other operator, or a tensor with data, passes unchanged. (The pipeline's trace on meta,
    framework.parallel.pipeline.trace_split, runs under it too.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._overloadpacket is not GROUPED_MM or not args[0].is_meta:
            return func(*args, **kwargs)
        named = dict(zip(("mat_a", "mat_b", "offs", "bias", "out_dtype"), args, strict=False)) | kwargs
        offs, dtype = named.get("offs"), named.get("out_dtype")
        out = as_plain_matmul(named["mat_a"], named["mat_b"], offs.shape[0] if offs is not None else 0)
        return out if dtype is None else out.to(dtype)


def counted(model: nn.Module, spec: Any, seq_len: int, recomputed: int) -> tuple[float, float]:
    """(model, hardware) FLOPs per token counted with FlopCounterMode on a (1, seq_len) batch of
    `model` (built on meta): a forward, then a backward; a recomputed block adds its forward."""
    from torch.utils.flop_counter import FlopCounterMode

    tokens = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    try:
        with FlopCounterMode(display=False) as forward, GroupedOnMeta():
            logits = logits_of(model(tokens))
        with FlopCounterMode(display=False) as backward, GroupedOnMeta():
            logits.float().sum().backward()
    finally:
        for p in model.parameters():
            p.grad = None
    # FlopCounterMode names a module by its path under the root's class name
    first_block = f"{type(model).__name__}.{spec.blocks}.0" if spec.blocks else None
    block = sum(forward.get_flop_counts().get(first_block, {}).values()) if first_block else 0
    total = forward.get_total_flops() + backward.get_total_flops()
    return total / seq_len, (total + recomputed * block) / seq_len


def routed_share(model: nn.Module) -> Callable[[torch.Tensor], float]:
    """The share of a weight each token multiplies: 1, and for a routed experts' weight (3-D, one
    matrix per expert) the config's experts per token over the experts."""
    per_token = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    return lambda p: per_token / p.shape[0] if per_token and p.dim() == 3 else 1.0


def estimated(model: nn.Module, spec: Any, recomputed: int) -> tuple[float, float]:
    """(model, hardware) FLOPs per token without running the model: 6 per weight a token
    multiplies (every matrix outside the embeddings, the head's included, tied or not; a routed
    expert's by routed_share); attention's scores and weighted sum (12·L·H·Q·T) are not counted.
    A recomputed block adds 2 per weight of the first block."""
    share, seen, total, block = routed_share(model), set(), 0.0, 0.0
    first_block = f"{spec.blocks}.0." if spec.blocks else None
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            continue
        for p in module.parameters(recurse=False):
            if p.dim() < 2 or id(p) in seen:
                continue
            seen.add(id(p))
            total += p.numel() * share(p)
            block += p.numel() * share(p) if first_block and f"{name}.".startswith(first_block) else 0.0
    return 6 * total, 6 * total + 2 * recomputed * block


def training_flops(model: nn.Module, spec: Any, seq_len: int, recomputed: int = 0) -> tuple[float, float, str]:
    """(model, hardware) FLOPs per token and how they were had: declared by the model, counted
    on meta, or (where the meta forward cannot run) estimated, the reason named."""
    if spec.flops_per_token is not None:
        return model.flops_per_token(seq_len), model.flops_per_token(seq_len, recomputed), DECLARED
    try:
        return (*counted(model, spec, seq_len, recomputed), COUNTED_ON_META)
    except (RuntimeError, NotImplementedError) as err:  # an operator the meta device cannot run
        reason = re.split(r"(?<=\.)\s", str(err).strip(), maxsplit=1)[0] or type(err).__name__  # its first sentence
        how = f"estimated: 6 per weight a token multiplies, attention's scores not counted (the meta count: {reason})"
        return (*estimated(model, spec, recomputed), how)
