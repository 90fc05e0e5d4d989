"""The memory choices' checks: where FSDP CPU offload applies, and the levers' own settings
(checkpointing every k-th block, selective checkpointing's operators, activation offload, the
compiler's activation budget)."""

from __future__ import annotations

from omegaconf import DictConfig

from framework.components import locate
from framework.config.errors import ConfigError
from framework.config.resolve import resolve_device
from framework.optimizers import setting


def check_memory(cfg: DictConfig) -> None:
    """What each `memory` choice needs; ConfigError naming the key otherwise."""
    memory = cfg.memory
    if memory.name == "offload":
        if cfg.parallel.name not in ("fsdp", "hybrid", "cp"):
            raise ConfigError("memory", f"CPU offload is an FSDP feature; got parallel={cfg.parallel.name}. "
                              "Use parallel=fsdp")  # fmt: skip
        if resolve_device(cfg) != "cuda":
            raise ConfigError("memory", "FSDP CPU offload moves shards between GPU and CPU memory and needs CUDA; "
                              "none here. Use memory=none, checkpoint, selective or offload_activations")  # fmt: skip
    if memory.name in ("checkpoint", "selective") and memory.checkpoint_every < 1:
        raise ConfigError("memory.checkpoint_every", f"got {memory.checkpoint_every}; must be an integer >= 1")
    if memory.name == "selective":
        _check_save_ops(memory.save_ops)
        if memory.matmul_every < 1:
            raise ConfigError("memory.matmul_every", f"got {memory.matmul_every}; must be an integer >= 1")
        _check_selective_layout(cfg)
    if setting(cfg.optim, "in_backward"):
        _check_in_backward(cfg)
    if memory.name == "budget":
        _check_budget(cfg)
    if memory.name == "offload_activations" and cfg.compile:
        raise ConfigError("memory", "offload_activations moves saved tensors in hooks around each block, which "
                          "compile=true does not trace; use memory=selective or checkpoint with compile")  # fmt: skip


def _check_save_ops(names) -> None:
    from framework.levers.selective import saved_ops  # torch: once a config is checked

    if not names:
        raise ConfigError("memory.save_ops", "got []; name what to keep (matmul, attention), or use memory=checkpoint")
    try:
        saved_ops(names)
    except ValueError as err:
        raise ConfigError("memory.save_ops", str(err)) from None


def _check_in_backward(cfg: DictConfig) -> None:
    why = in_backward_refusal(cfg, cfg.parallel, cfg.accumulation_steps)
    if why:
        raise ConfigError("optim.in_backward", why)


def in_backward_refusal(cfg: DictConfig, parallel: DictConfig, accumulation: int) -> str | None:
    """Why optim.in_backward cannot be exact for `cfg` under `parallel` with `accumulation`
    micro-batches (the hook's gradient must be the step's whole one: framework/optimizers/in_backward.py),
    or None. parallel=auto's search asks it of each layout it tries (with `in_backward_frees`)."""
    if setting(cfg.optim, "grad_clip") > 0:
        clip = setting(cfg.optim, "grad_clip")
        return f"clipping needs the global gradient norm before any update; set optim.grad_clip=0 (got {clip})"
    if accumulation > 1:
        return (
            f"with accumulation_steps={accumulation} the update would run on the first micro-batch's gradients; "
            "set accumulation_steps=1 (a larger data.batch_size keeps the global batch) or optim.in_backward=false"
        )
    if parallel.name != "ddp" and parallel.get("version", 2) == 1:
        return "FSDP1 flattens the parameters, so their hooks never see a gradient; use parallel.version=2"
    if cfg.precision.name == "amp":
        return "amp's loss scaler unscales and checks the whole gradient first; use precision=bf16 or fp32"
    if cfg.get("nonfinite") == "skip":
        return "nonfinite=skip decides after the whole backward, when the update has run; use nonfinite=stop"
    cls = locate(cfg.optim, "optim")
    if not getattr(cls, "steps_in_backward", True):  # the component says it cannot step one parameter alone
        return (
            f"{cfg.optim._target_} cannot step one parameter alone in its gradient's hook ({cls.steps_in_backward_why})"
        )
    return None


def in_backward_frees(parallel: DictConfig) -> bool:
    """Whether the step in backward frees each gradient as its update runs (what the planner
    counts on): not under DDP, whose buckets hold every gradient, nor a pipeline, whose gradients
    add up over the micro-batches until its schedule ends (framework/optimizers/in_backward.py)."""
    return parallel.name not in ("ddp", "pp") and parallel.get("pp", 1) == 1


def _check_selective_layout(cfg: DictConfig) -> None:
    """Where torch's selective-checkpoint cache cannot go (found by the matrix, torch 2.14)."""
    p = cfg.parallel
    if p.name == "cp" or p.get("cp", 1) > 1:
        raise ConfigError("memory", "memory=selective: context parallel's ring attention updates its outputs in "
                          "place, which the selective-checkpoint cache refuses; use memory=checkpoint with cp")  # fmt: skip
    if "ZeroBubble" in str(p.get("schedule")):
        raise ConfigError("memory", f"memory=selective: parallel.schedule={p.schedule} runs each block's backward "
                          "twice (input, then weight gradients), and the selective-checkpoint cache allows one; "
                          "use memory=checkpoint or a 1F1B/GPipe schedule")  # fmt: skip


def _check_budget(cfg: DictConfig) -> None:
    budget = cfg.memory.activation_budget
    if not 0 < budget <= 1:
        raise ConfigError("memory.activation_budget", f"got {budget}; the share of activations kept, in (0, 1] "
                          "(for none beyond each block's input use memory=checkpoint)")  # fmt: skip
    if not cfg.compile:
        raise ConfigError("memory", "memory=budget is the compiler's: its partitioner chooses what to recompute; "
                          "set compile=true, or use memory=selective or checkpoint without compile")  # fmt: skip
