"""BatchNorm over the global batch: under data parallel each rank sees 1/dp of a batch, and plain
BatchNorm would normalise by that rank's statistics alone (a different model from one process on
the same global batch). `parallel.sync_batchnorm=true` (the default) normalises by the statistics
of every data-parallel rank's micro-batch together: torch's SyncBatchNorm on accelerators, and on
CPU (where torch's raises) `GlobalBatchNorm` below, the same arithmetic over one all-reduce of the
per-channel sums forward and one of their gradients backward. `false` keeps per-rank statistics
(torch's default behaviour, one all-reduce fewer per BatchNorm layer and direction).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in model.modules())


class GlobalBatchNorm(_BatchNorm):
    """A BatchNorm of any dimension whose training statistics are those of the whole data-parallel
    micro-batch: per channel, the count, sum and sum of squares all-reduced over `group` (autograd
    all-reduces their gradients back), then the usual normalisation and running averages (the
    running variance unbiased by the global count, as one process's)."""

    def __init__(self, source: _BatchNorm, group) -> None:
        super().__init__(
            source.num_features, source.eps, source.momentum, source.affine, source.track_running_stats, device="meta"
        )
        self.group = group
        self._input_dims = type(source)._check_input_dim  # BatchNorm1d/2d/3d's own check
        for name, tensor in [*source.named_parameters(recurse=False), *source.named_buffers(recurse=False)]:
            setattr(self, name, tensor)  # the source's own tensors (and its device, meta included)
        self.train(source.training)

    def _check_input_dim(self, input: torch.Tensor) -> None:
        self._input_dims(self, input)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if not self.training and self.track_running_stats:
            return super().forward(x)
        dims = [d for d in range(x.dim()) if d != 1]
        count = torch.full((1,), x.numel() / x.shape[1], dtype=torch.float32, device=x.device)
        local = torch.cat([count, x.float().sum(dims), x.float().square().sum(dims)])
        total = dist_fn.all_reduce(local, group=self.group)
        n, c = total[0], self.num_features
        mean = total[1 : 1 + c] / n
        var = (total[1 + c :] / n - mean.square()).clamp_min(0)
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked.add_(1)
                momentum = 1 / self.num_batches_tracked.item() if self.momentum is None else self.momentum
                self.running_mean.lerp_(mean.detach().to(self.running_mean.dtype), momentum)
                unbiased = var.detach() * n / (n - 1).clamp_min(1)
                self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)
        shape = [1, c] + [1] * (x.dim() - 2)
        y = (x.float() - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(x.dtype)


def sync_batchnorm(model: nn.Module, group, device: torch.device) -> nn.Module:
    """`model` with every BatchNorm normalising over `group`'s ranks together (in place where the
    model is not itself a BatchNorm): torch's SyncBatchNorm on accelerators, GlobalBatchNorm on CPU."""
    if dist.get_world_size(group) == 1:
        return model
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model, group)
    if isinstance(model, _BatchNorm):
        return GlobalBatchNorm(model, group)
    for name, child in model.named_children():
        setattr(model, name, sync_batchnorm(child, group, device))
    return model
