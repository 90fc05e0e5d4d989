"""The learning-rate schedule, a component (framework/components.py): `conf/schedule/<name>.yaml`
names its class by `_target_` with its kwargs; the framework passes the optimizer, and
`total_steps` where the class takes it (the span: `schedule.steps`, else the run's `steps`). The
framework's own (framework/schedules/shapes.py): warm-up + cosine, warm-up + constant, and
warmup-stable-decay. A torch class (`torch.optim.lr_scheduler.StepLR`, `OneCycleLR`) or a user's
works as it is: it is stepped once per optimizer step and saved in every checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from framework.components import build_component

if TYPE_CHECKING:  # the config checks import this package before torch (train.py starts the forkserver first)
    import torch

OWN = ("steps",)  # schedule.steps: the span (null: the run's steps; a resumed run keeps its own)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: DictConfig, run_steps: int) -> Any:
    """The schedule group's class over `optimizer`, spanning `schedule.steps`, else `run_steps`."""
    return build_component(cfg, OWN, optimizer, total_steps=cfg.get("steps") or run_steps)


def load_schedule(scheduler: Any, state: dict) -> None:
    """A checkpoint's schedule into `scheduler`. Its per-group lists (`base_lrs`, `_last_lr`) are
    the saving rank's groups, and a rank of another layout may hold fewer (a pipeline stage without
    the embedding or the head has no group for them): where the saved groups shared one value,
    each of this rank's groups takes it; else the resume is refused in one line."""
    groups, state = len(scheduler.optimizer.param_groups), dict(state)
    for key in ("base_lrs", "_last_lr"):
        values = state.get(key)
        if isinstance(values, list) and len(values) != groups:
            if len({float(v) for v in values}) != 1:
                raise ValueError(f"checkpoint.resume: the LR schedule's {key} differ by parameter group ({values}), "
                                 f"and this rank has {groups} groups; resume on the layout it was saved with")  # fmt: skip
            state[key] = [values[0]] * groups
    scheduler.load_state_dict(state)


def resumed_schedule(scheduler: Any, cfg: DictConfig, steps: int) -> str | None:
    """After loading a checkpoint's schedule: `schedule.steps` re-plans it; otherwise it keeps
    the length it was saved with. Returns the one line to print when that length is not this run's
    `steps`, else None. A schedule without a span of its own (a torch class) is left as loaded."""
    if not hasattr(scheduler, "schedule_steps"):
        return None
    saved = scheduler.schedule_steps or steps
    wanted = cfg.get("steps") or saved
    scheduler.schedule_steps = wanted
    if wanted == steps:
        return None
    how = "set by schedule.steps" if cfg.get("steps") else "as saved; schedule.steps=N re-plans it"
    return f"steps={steps}: the LR schedule spans {wanted} steps ({how})"
