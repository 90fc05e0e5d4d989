"""A routed mixture-of-experts feed-forward, in plain single-device code (no torch.distributed).

- A router scores every token against every expert: softmax (Switch; Mixtral and Qwen3-MoE with
  `norm_topk`: the chosen weights renormalised to sum 1), or sigmoid with the chosen weights
  normalised over the top-k (DeepSeek-V3). Each token goes to its top_k experts.
- The experts are SwiGLU MLPs held as one grouped weight per projection (w1 and w3: experts x
  hidden x dim, w2: experts x dim x hidden; each expert's slice in nn.Linear's layout), run over
  the tokens sorted by expert.
- Token-choice routing is dropless by default: every token reaches its experts, however many
  choose one. With a capacity factor each expert takes at most ceil(factor x tokens x top_k /
  experts) of its tokens, in token order; the rest of that expert's share is dropped (the
  residual carries the token on).
- An optional shared expert (DeepSeek, Qwen-MoE) that every token goes through.
- Balancing: `aux_loss` (Switch/Mixtral: experts x sum_e f_e x P_e, f_e the share of the
  assignments expert e got and P_e its mean router probability, times `aux_loss_coef`), added to
  the training loss through the backward pass (its gradient joins the activations', so it works
  under any strategy, pipelines included); `bias` (DeepSeek-V3's auxiliary-loss-free balancing:
  a per-expert bias added to the scores for choosing only, moved by `bias_rate` towards the less
  loaded experts after each step, from the loads of the whole step on every rank); or `none`.
- The balance's scope (`balance_scope`). `global` (the default): f_e is expert e's share of the
  assignments of the whole global batch, every micro-batch of every rank (Qwen's global-batch
  balance, "Demons in the Detail", 2025). A micro-batch's backward cannot wait for the batches
  after it (accumulation, a pipeline's schedule), so f is the last step's, known on every rank
  when the step starts; P is this step's, each token's probability weighing 1/(the step's
  tokens). The gradient is then the same however the batch is split: data parallel, expert
  parallel and pipelines equal one process. `micro`: f and P are each micro-batch's own on
  each rank (Switch, Mixtral, most data-parallel trainers), so a split run trains another loss.

The layer speaks the framework's step protocol (framework/contract.py, `step_modules`): it counts
what it routed on the device (`step_counts`, `read_counts`: tokens each expert got, their summed
probabilities, assignments dropped); the framework sums the counts over every rank in the step's
one all-reduce and hands the layer its block's totals (`after_step`: f for the next step, the
bias balancing, on the device, no host read); `derive` turns every block's totals into the logged
figures (`figures`: moe_load_imbalance, moe_aux_loss, moe_dropped_tokens, moe_tokens_per_expert).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.swiglu import FeedForward


@dataclass(frozen=True)
class MoEArgs:
    experts: int = 0  # routed experts; 0: a dense model
    top_k: int = 2
    shared_experts: int = 0  # 0 or 1: an expert every token goes through
    hidden: int | None = None  # each expert's hidden width (None: the model's ffn_hidden)
    score: str = "softmax"  # softmax | sigmoid
    norm_topk: bool = False  # softmax: the chosen experts' weights renormalised to sum 1 (Mixtral, Qwen3-MoE)
    balance: str = "aux_loss"  # aux_loss | bias | none
    balance_scope: str = "global"  # global: f over the whole global batch (the last step's) | micro: each micro-batch's
    aux_loss_coef: float = 0.01
    bias_rate: float = 1e-3
    capacity_factor: float | None = None  # None: dropless


def recomputing() -> bool:
    """Whether this forward runs inside a backward pass: activation checkpointing recomputing a
    block, whose routing was counted when it first ran (torch keeps no public flag for it)."""
    return torch._C._current_graph_task_id() != -1


class AuxLoss(torch.autograd.Function):
    """Identity on the activations; in backward, the auxiliary loss's gradient (x `scale`: the
    framework's share of one micro-batch in the step, and amp's loss scale) joins theirs."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(scale)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (scale,) = ctx.saved_tensors
        return grad, scale.to(grad.dtype), None


def grouped_swiglu(x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor):
    """SwiGLU experts over x, tokens sorted by expert (counts[e] of them expert e's)."""
    out, start = [], 0
    for e, n in enumerate(counts):
        h = x[start : start + n]
        out.append((F.silu(h @ w1[e].t()) * (h @ w3[e].t())) @ w2[e].t())
        start += n
    return torch.cat(out) if out else x[:0]


class GroupedExperts(nn.Module):
    def __init__(self, experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        # Expert parallelism (set by the framework, framework/parallel/expert.py): a callable
        # (this module, x, counts) -> the same output, computed by the ranks that hold the experts
        self.dispatcher = None

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x: tokens sorted by expert, counts[e] of them expert e's."""
        if self.dispatcher is not None:
            return self.dispatcher(self, x, counts)
        return grouped_swiglu(x, counts, self.w1, self.w2, self.w3)


class MoE(nn.Module):
    # The logged figures `derive` gives (framework/figures.py's fields, as plain data)
    figures = (
        {"name": "moe_load_imbalance", "reduce": None, "group": "moe", "key": "load_imbalance",
         "summary": ("mean", "first", "last"), "report": "expert load"},
        {"name": "moe_aux_loss", "reduce": None, "group": "moe", "key": "aux_loss"},
        {"name": "moe_dropped_tokens", "reduce": None, "group": "moe", "key": "dropped_tokens", "summary": ("sum",)},
        {"name": "moe_tokens_per_expert", "reduce": None, "group": "moe", "key": "tokens_per_expert",
         "summary": ("sum",)},
    )  # fmt: skip

    def __init__(self, dim: int, hidden: int, args: MoEArgs):
        super().__init__()
        self.args = args
        self.gate = nn.Linear(dim, args.experts, bias=False)
        self.experts = GroupedExperts(args.experts, dim, args.hidden or hidden)
        self.shared = None
        if args.shared_experts:
            self.shared = FeedForward(dim, (args.hidden or hidden) * args.shared_experts)
        self.register_buffer("expert_bias", torch.zeros(args.experts))  # balance=bias (checkpointed)
        # balance_scope=global: each expert's share of the last step's assignments (checkpointed)
        self.register_buffer("balance_share", torch.full((args.experts,), 1.0 / args.experts))
        self.aux_scale = torch.ones((), device="cpu")  # set by the framework each step (set_aux_scale)
        self.counts: dict[str, torch.Tensor] = {}

    def init_buffers(self) -> None:  # after a meta-device build (framework.modules.materialize_model)
        self.expert_bias.zero_()
        self.balance_share.fill_(1.0 / self.args.experts)

    # ------------------------------------------------------------------ the framework's step protocol
    def step_counts(self) -> dict[str, int]:
        """The counters a step sums over every rank, and their widths."""
        return {"tokens": self.args.experts, "probs": self.args.experts, "dropped": 1}

    def read_counts(self) -> dict[str, torch.Tensor]:
        """What this layer routed since the last read (device tensors); starts counting afresh."""
        counts, self.counts = self.counts, {}
        return counts

    def set_aux_scale(self, scale: torch.Tensor) -> None:
        """The factor of the auxiliary loss's gradient: the framework's, as it scales the training
        loss (a micro-batch's share of the step, amp's loss scale)."""
        self.aux_scale = scale

    @torch.no_grad()
    def after_step(self, totals: dict[str, torch.Tensor]) -> None:
        """This block's counts of the whole step over every rank (on the device): f for the next
        step's global balance; balance=bias moves each expert's bias by bias_rate towards the less
        loaded (sign(mean load - load), DeepSeek-V3), identically on every rank."""
        load = totals["tokens"].to(self.balance_share)
        total = load.sum()
        self.balance_share.copy_(torch.where(total > 0, load / total.clamp_min(1.0), self.balance_share))
        if self.args.balance == "bias":
            self.expert_bias.add_(self.args.bias_rate * torch.sign(load.mean() - load).to(self.expert_bias))

    def derive(self, blocks: dict[str, list[list[float]]]) -> dict[str, float | int | list[float]]:
        """The logged figures from every block's totals (a block without experts: zeros): load
        imbalance (the most loaded expert's tokens over the mean, averaged over the blocks), the
        global batch's balancing loss (coef x experts x sum_e f_e P_e, averaged over the blocks),
        assignments dropped, tokens each expert got over the blocks."""
        used = [k for k, row in enumerate(blocks["tokens"]) if sum(row) > 0]
        imbalance, aux = [], []
        for k in used:
            load, probs = blocks["tokens"][k], blocks["probs"][k]
            total, tokens = sum(load), sum(load) / self.args.top_k
            imbalance.append(max(load) / (total / len(load)))
            aux.append(
                self.args.aux_loss_coef
                * len(load)
                * sum(c / total * p / tokens for c, p in zip(load, probs, strict=True))
            )
        n = max(len(used), 1)
        return {"moe_load_imbalance": sum(imbalance) / n, "moe_aux_loss": sum(aux) / n,
                "moe_dropped_tokens": round(sum(r[0] for r in blocks["dropped"])),
                "moe_tokens_per_expert": [sum(col) for col in zip(*blocks["tokens"], strict=True)]}  # fmt: skip

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen experts (N, k), their weights (N, k), every score (N, E)) of tokens x (N, D)."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.args.score == "softmax" else logits.sigmoid()
        biased = scores + self.expert_bias if self.args.balance == "bias" else scores
        chosen = biased.topk(self.args.top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if self.args.score == "sigmoid" or self.args.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return chosen, weights, scores

    def kept(self, chosen: torch.Tensor) -> torch.Tensor:
        """Which of the (N x k) assignments an expert takes: all (dropless), or the first
        `capacity` of each expert's in token order."""
        flat = chosen.flatten()
        if self.args.capacity_factor is None:
            return torch.ones_like(flat, dtype=torch.bool)
        capacity = math.ceil(self.args.capacity_factor * chosen.shape[0] * self.args.top_k / self.args.experts)
        one_hot = F.one_hot(flat, self.args.experts)
        rank_in_expert = (one_hot.cumsum(0) * one_hot).sum(-1) - 1  # its place in its expert's queue
        return rank_in_expert < capacity

    def dispatch(self, chosen: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The kept assignments' order sorted by expert, and each expert's count. On the meta
        device (the framework traces shapes there) the routing is unknown: an even split."""
        flat, n = chosen.flatten(), int(chosen.numel())
        if chosen.is_meta:
            even = [n // self.args.experts + (e < n % self.args.experts) for e in range(self.args.experts)]
            return torch.arange(n, device=chosen.device), even
        order = torch.argsort(torch.where(keep, flat, self.args.experts), stable=True)[: int(keep.sum())]
        return order, torch.bincount(flat[keep], minlength=self.args.experts).tolist()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape, x = x.shape, x.reshape(-1, x.shape[-1])
        chosen, weights, scores = self.route(x)
        keep = self.kept(chosen)
        order, counts = self.dispatch(chosen, keep)
        tokens = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.args.top_k)[order]
        routed = self.experts(x[tokens], counts) * weights.flatten()[order, None].to(x.dtype)
        out = torch.zeros_like(x).index_add_(0, tokens, routed)
        if self.shared is not None:
            out = out + self.shared(x)
        probs = scores / scores.sum(-1, keepdim=True)
        assigned = self.assigned(chosen.flatten())
        if self.training and not x.is_meta and not recomputing():
            self.count(assigned, probs, keep)
        if self.args.balance == "aux_loss" and self.training and torch.is_grad_enabled():
            out = AuxLoss.apply(out, self.aux_loss(assigned, probs), self.aux_scale.to(x.device))
        return out.reshape(shape)

    def assigned(self, flat: torch.Tensor) -> torch.Tensor:
        """Assignments each expert got (scatter_add, not bincount: it runs on meta too)."""
        ones = torch.ones(flat.shape, device=flat.device)
        return torch.zeros(self.args.experts, device=flat.device).scatter_add_(0, flat, ones)

    def aux_loss(self, assigned: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """coef x experts x sum_e f_e P_e: P_e this forward's mean probability of expert e; f_e its
        share of the assignments, this forward's (micro) or the last global batch's (global)."""
        f = assigned / assigned.sum() if self.args.balance_scope == "micro" else self.balance_share.to(probs)
        return self.args.aux_loss_coef * self.args.experts * (f.detach() * probs.mean(0)).sum()

    def count(self, assigned: torch.Tensor, probs: torch.Tensor, keep: torch.Tensor) -> None:
        """Add one forward's routing to the step's counters, on the device (no host read)."""
        new = {"tokens": assigned, "probs": probs.detach().sum(0), "dropped": (~keep).sum().float().reshape(1)}
        self.counts = {k: self.counts[k] + v if k in self.counts else v for k, v in new.items()}
