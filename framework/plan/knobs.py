"""The memory knobs the search behind `parallel=auto` varies on each layout: activation
checkpointing (none, every k-th or every block, each whole or selective: memory=selective keeps the
matmuls' and attention's outputs), the micro-batch against accumulation with the global batch
kept, a pipeline's micro-batch count, the compiler's activation budget under compile=true, and the
optimizer step in backward where it is exact."""

from __future__ import annotations

from dataclasses import dataclass, replace

from omegaconf import DictConfig, OmegaConf, open_dict

from framework.config.schema import group_schema
from framework.parallel.pipeline import least_microbatches, stages_per_rank

BUDGETS = (0.25, 0.5)  # memory=budget's shares the search tries (compile=true)


@dataclass(frozen=True)
class Knobs:
    checkpoint_every: int  # 0: no activation checkpointing; k: every k-th block
    batch_size: int  # micro-batch of one data-parallel rank
    accumulation_steps: int
    n_microbatches: int | None = None  # pipelines only
    selective: bool = False  # the checkpointed blocks keep their matmuls' and attention's outputs
    in_backward: bool = False  # optim.in_backward: each update in backward, its gradient freed
    offload: bool = False  # memory=offload_activations (no checkpointing): the blocks' saved tensors on the host
    budget: float | None = None  # memory=budget (compile=true): the share of activations the compiler keeps

    @property
    def memory(self) -> str:
        if self.checkpoint_every:
            return "selective" if self.selective else "checkpoint"
        if self.budget is not None:
            return "budget"
        return "offload_activations" if self.offload else "none"

    def overrides(self, base: DictConfig) -> list[str]:
        """What selects these knobs on the command line, beside the layout's."""
        out = []
        if self.checkpoint_every:
            out += [f"memory={self.memory}", f"memory.checkpoint_every={self.checkpoint_every}"]
        elif self.memory != base.memory.name:
            out.append(f"memory={self.memory}")
        if self.budget is not None and self.budget != base.memory.get("activation_budget"):
            out.append(f"memory.activation_budget={self.budget}")
        if self.batch_size != base.data.batch_size:
            out.append(f"data.batch_size={self.batch_size}")
        if self.accumulation_steps != base.accumulation_steps:
            out.append(f"accumulation_steps={self.accumulation_steps}")
        if self.n_microbatches is not None:
            out.append(f"parallel.n_microbatches={self.n_microbatches}")
        if self.in_backward != bool(base.optim.get("in_backward")):
            out.append(f"optim.in_backward={str(self.in_backward).lower()}")
        return out

    def apply(self, cfg: DictConfig) -> None:
        """Set these knobs in `cfg` (in place; a trial copy, or the run's config once chosen)."""
        schema = OmegaConf.structured(group_schema("memory", self.memory))  # each with its own schema's keys
        keep = {k: v for k, v in cfg.memory.items() if k != "name" and k in schema and k != "checkpoint_every"}
        memory = OmegaConf.merge(schema, keep)
        memory.name = self.memory  # a schema shared by several choices names none of them
        if self.checkpoint_every:
            memory.checkpoint_every = self.checkpoint_every
        if self.budget is not None:
            memory.activation_budget = self.budget
        cfg.memory = memory
        cfg.data.batch_size, cfg.accumulation_steps = self.batch_size, self.accumulation_steps
        if self.n_microbatches is not None:
            cfg.parallel.n_microbatches = self.n_microbatches
        with open_dict(cfg.optim):  # a user's optim file may leave the run's own settings out
            cfg.optim.in_backward = self.in_backward


def knob_options(base: DictConfig, trial: DictConfig, n_layer: int | None) -> list[Knobs]:
    """The knob combinations of one layout (`trial`: its config) with the global batch kept."""
    every = [base.memory.checkpoint_every if base.memory.name in ("checkpoint", "selective") else 0]
    if n_layer:
        every = sorted({0, *(k for k in (4, 2, 1) if k <= n_layer), *every})
    local = trial.data.batch_size * base.accumulation_steps  # samples per data-parallel rank per step
    out = []
    if trial.parallel.get("pp", 1) > 1 or trial.parallel.name == "pp":
        least = least_microbatches(trial.parallel.schedule, trial.parallel.pp * stages_per_rank(trial.parallel))
        ms = [m for m in range(1, local + 1) if local % m == 0 and m >= least]
        if "ZeroBubble" in trial.parallel.schedule:  # one round: what the activations model forecasts
            ms = [m for m in ms if m == least]
        ms = sorted({*ms[:2], *ms[-1:], *[m for m in ms if m == trial.parallel.n_microbatches]})
        return [Knobs(k, local, 1, m, s) for k in every for s in (False, True)[: 1 + bool(k)] for m in ms]
    sizes = [b for b in range(1, local + 1) if local % b == 0 and local // b <= 8]
    sizes = [trial.data.batch_size] if base.data.rank_batch_sizes else sizes
    for k in every:
        for b in sizes:
            accumulation = local // b if b != trial.data.batch_size else base.accumulation_steps
            out += [Knobs(k, b, accumulation, None, s) for s in (False, True)[: 1 + bool(k)]]
    bare = [k for k in out if not k.checkpoint_every]
    out += [replace(k, offload=True) for k in bare if offload_applies(base)]
    out += [replace(k, budget=b) for k in bare if base.compile and n_layer for b in BUDGETS]
    return out + [replace(k, in_backward=True) for k in out if in_backward_applies(base, trial, k)]


def offload_applies(base: DictConfig) -> bool:
    """Activation offload saves device memory where there is a host apart from the device, not
    compiled (its hooks are not traced)."""
    from framework.plan.activations import host_apart

    return not base.compile and host_apart(base)


def in_backward_applies(base: DictConfig, trial: DictConfig, knobs: Knobs) -> bool:
    """The optimizer step in backward is exact for this run, layout and accumulation (the config's
    own check says so), and frees the gradients there (not under DDP or a pipeline)."""
    from framework.config.memory_checks import in_backward_frees, in_backward_refusal

    return in_backward_refusal(base, trial.parallel, knobs.accumulation_steps) is None and in_backward_frees(
        trial.parallel
    )
