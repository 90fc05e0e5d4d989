"""Expert parallelism (parallel.ep): a mixture of experts' routed experts split over the ep ranks,
tokens sent to their experts' ranks and back with all-to-all (GShard, torchtitan, Megatron's
all-to-all token dispatcher).

Layout. The ep ranks are borrowed from dp_shard (framework/parallel/dims.py lays dp_shard out as
dp_shard_mod_ep x ep): each of them reads its own batch as before, and holds experts / ep of each
layer's experts: the grouped weights (experts x ...) are DTensors sharded on dim 0 over the ep
mesh. FSDP then shards them further over the data-parallel ranks left (dp_shard_mod_ep, and
dp_replicate as HSDP), as a unit of their own; every other parameter keeps its FSDP sharding over
all of dp. Checkpoints (DCP) hold the whole experts, and load under any other layout.

A routed layer's forward on each rank: route its own tokens (models/moe.py), sort them by expert,
then
1. all-to-all the counts: how many tokens each rank sends each of the receiver's experts;
2. all-to-all the tokens (rank p receives its experts' tokens from every rank, grouped by sender);
3. regroup them by local expert, run the local experts (grouped SwiGLU), and undo the regrouping;
4. all-to-all the outputs back to their tokens' ranks, in the order they were sent.
The all-to-alls are autograd functions: the backward sends the gradients the reverse way.

Gradients. A local expert's gradient sums the contributions of the tokens of every ep rank; each
rank's loss is its own batch's mean, which FSDP averages over all dp ranks for the other
parameters. The expert units average over dp / ep ranks only, so the experts' gradient is scaled
by 1 / ep on its way into the weights: every parameter ends with the gradient of the mean loss of
the global batch, as one process computes it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from framework.measure.memory import mark_weight
from models.moe import grouped_swiglu


class GradScale(torch.autograd.Function):
    """Identity forward; the gradient times `scale` backward."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class AllToAll(torch.autograd.Function):
    """Rows of x to the group's ranks (`sent[p]` rows to rank p, in order), `got[q]` rows from each
    rank q into a new tensor; backward sends the gradients the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, sent: list[int], got: list[int], group) -> torch.Tensor:
        ctx.sent, ctx.got, ctx.group = sent, got, group
        out = x.new_empty((sum(got), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), got, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return AllToAll.apply(grad, ctx.got, ctx.sent, ctx.group), None, None, None


class ExpertDispatch:
    """GroupedExperts.dispatcher under expert parallel: (experts module, tokens sorted by expert,
    each global expert's count) -> the experts' outputs in the same order, computed where the
    experts live."""

    def __init__(self, ep_mesh, fsdp_mesh):
        self.group, self.size = ep_mesh.get_group(), ep_mesh.size()
        self.fsdp_mesh = fsdp_mesh  # the data-parallel ranks left, that FSDP shards these experts over

    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # this rank's experts (model state: framework.measure.memory does not count them as saved activations)
        local = [mark_weight(w.to_local()) for w in (experts.w1, experts.w2, experts.w3)]
        weights = [GradScale.apply(w, 1.0 / self.size) for w in local]
        if x.is_meta:  # shapes only (the framework traces on the meta device): no routing to follow
            return torch.zeros_like(x)
        local = len(counts) // self.size
        sent = [sum(counts[p * local : (p + 1) * local]) for p in range(self.size)]  # to rank p: its experts'
        recv = torch.empty(self.size, local, dtype=torch.long, device=x.device)
        dist.all_to_all_single(recv, torch.tensor(counts, device=x.device).view(self.size, local), group=self.group)
        got = recv.tolist()  # got[q][j]: rank q's tokens for my expert j (the one host sync)
        from_rank = [sum(row) for row in got]
        received = AllToAll.apply(x, sent, from_rank, self.group)
        # grouped by sender, then expert: regroup by expert (stable: each sender's tokens in order)
        expert_of = torch.arange(local, device=x.device).repeat(self.size).repeat_interleave(recv.flatten())
        order = torch.argsort(expert_of, stable=True)
        out = grouped_swiglu(received[order], [sum(row[j] for row in got) for j in range(local)], *weights)
        back = torch.empty_like(out).index_copy(0, order, out)  # the senders' order again
        return AllToAll.apply(back, from_rank, sent, self.group)


def apply_ep(module: nn.Module, blocks: str, ep_mesh, fsdp_mesh) -> None:
    """Split every routed layer's experts in `module` (a model or a pipeline stage) over `ep_mesh`:
    their weights become DTensors sharded on the expert dim, their forward an ExpertDispatch (and
    FSDP makes each a unit of its own over `fsdp_mesh`: framework/parallel/fsdp.py)."""
    from torch.distributed.tensor import Shard

    from framework.moe import routed_layers
    from framework.parallel.tensor import distribute_parameter

    for _, layer in routed_layers(module, blocks):
        for name in ("w1", "w2", "w3"):
            distribute_parameter(layer.experts, name, ep_mesh, Shard(0))
        layer.experts.dispatcher = ExpertDispatch(ep_mesh, fsdp_mesh)
