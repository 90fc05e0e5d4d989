"""Pipeline parallelism for `gpt` with torch.distributed.pipelining.

The blocks are split into stages (12 layers over 2 ranks: 6 and 6, the article's example); each
rank runs its stage(s) and passes activations forward and gradients back to its neighbours.
A step's local batch is cut into ``n_microbatches`` that flow through the stages in the order of
the schedule: GPipe (all forwards, then all backwards), 1F1B (one forward, one backward: fewer
activations alive), Interleaved1F1B (several smaller stages per rank: a smaller bubble), and the
zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble: weight gradients computed apart from
input gradients to fill the bubble).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import nn

from framework.loss import cross_entropy

SINGLE_STAGE = {"GPipe": "ScheduleGPipe", "1F1B": "Schedule1F1B"}
MULTI_STAGE = {
    "Interleaved1F1B": "ScheduleInterleaved1F1B",
    "InterleavedZeroBubble": "ScheduleInterleavedZeroBubble",
    "ZBVZeroBubble": "ScheduleZBVZeroBubble",
}
SCHEDULES = (*SINGLE_STAGE, *MULTI_STAGE)  # the names `parallel.schedule` accepts


def stages_per_rank(cfg: DictConfig) -> int:
    """Virtual stages per rank: 1 for single-stage schedules; for multi-stage ones the configured
    number, at least 2 (0 means auto: 2)."""
    if cfg.schedule in SINGLE_STAGE:
        return 1
    return max(2, cfg.stages_per_rank)


class GPTStage(nn.Module):
    """A contiguous range of a GPT's layers (plus the embeddings on the first stage and the final
    norm and head on the last). Submodules keep the full model's names (``blocks.7.attn.q``), so
    state dicts of all stages together are the full model's."""

    def __init__(self, model: nn.Module, layers: list[int], first: bool, last: bool):
        super().__init__()
        self.tok_emb = model.tok_emb if first else None
        self.pos_emb = model.pos_emb if first else None
        self.drop = model.drop if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        self.ln_f = model.ln_f if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:  # token ids in
            pos = torch.arange(x.size(1), device=x.device)
            x = self.drop(self.tok_emb(x) + self.pos_emb(pos))
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is not None:  # logits out
            x = self.lm_head(self.ln_f(x))
        return x


def stage_ids(pp_rank: int, pp: int, per_rank: int, schedule: str) -> list[int]:
    """Which of the pp*per_rank stages this rank runs: looped (r, r+pp, ...) or, for the V
    schedules, r and 2pp-1-r (so the first and last stage share rank 0)."""
    if per_rank == 1:
        return [pp_rank]
    if schedule.startswith("ZBV"):
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(per_rank)]


def split_layers(n_layer: int, n_stages: int) -> list[list[int]]:
    """Layers per stage, as even as possible (earlier stages take the remainder)."""
    base, extra = divmod(n_layer, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


@dataclass
class Pipeline:
    """Runs one optimizer step's forward and backward through the schedule."""

    schedule: object
    has_first: bool
    has_last: bool
    n_microbatches: int

    def step(self, inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Forward+backward of the local batch; returns the mean loss on ranks holding the last
        stage (zero elsewhere: the loss lives there)."""
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": target, "losses": losses} if self.has_last else {}
        self.schedule.step(*args, **kwargs)
        if not self.has_last:
            return torch.zeros((), device=target.device)
        return torch.stack([loss.detach() for loss in losses]).mean()


def build_stages(model: nn.Module, cfg: DictConfig, pp_rank: int, pp: int) -> tuple[list[GPTStage], list[int], int]:
    per_rank = stages_per_rank(cfg)
    n_stages = pp * per_rank
    layers = split_layers(len(model.blocks), n_stages)
    ids = stage_ids(pp_rank, pp, per_rank, cfg.schedule)
    stages = [GPTStage(model, layers[s], first=s == 0, last=s == n_stages - 1) for s in ids]
    return stages, ids, n_stages


def build_pipeline(
    stage_modules: list[nn.Module], ids: list[int], n_stages: int, cfg: DictConfig, pp_group, device
) -> Pipeline:
    import torch.distributed.pipelining as pipelining

    stages = [
        pipelining.PipelineStage(m, s, n_stages, device, group=pp_group)
        for m, s in zip(stage_modules, ids, strict=True)
    ]
    if cfg.schedule in SINGLE_STAGE:
        schedule = getattr(pipelining, SINGLE_STAGE[cfg.schedule])(stages[0], cfg.n_microbatches, loss_fn=cross_entropy)
    else:
        schedule = getattr(pipelining, MULTI_STAGE[cfg.schedule])(stages, cfg.n_microbatches, loss_fn=cross_entropy)
    return Pipeline(schedule, 0 in ids, n_stages - 1 in ids, cfg.n_microbatches)


class LocalStages(nn.Module):
    """All the stages this rank runs, as one module whose parameter names are the full model's
    (for the optimizer, clipping, memory accounting and checkpoints)."""

    def __init__(self, stages: list[GPTStage]):
        super().__init__()
        first = next((s for s in stages if s.tok_emb is not None), None)
        last = next((s for s in stages if s.lm_head is not None), None)
        self.tok_emb = first.tok_emb if first else None
        self.pos_emb = first.pos_emb if first else None
        self.blocks = nn.ModuleDict({k: b for s in stages for k, b in s.blocks.items()})
        self.ln_f = last.ln_f if last else None
        self.lm_head = last.lm_head if last else None
