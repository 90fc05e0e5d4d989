"""Which combinations of `parallel=auto`'s search the config check accepts: each combination (a
layout and its memory knobs) goes through the checks of `framework/config` that read what the
search varies before it is priced, so the planner never proposes what `train.py` refuses.

The search varies the `parallel` group (degrees, schedule, micro-batches), the `memory` group, the
micro-batch against accumulation and `optim.in_backward`; the rest of the config is the user's,
checked once before the search (train.py's `validate`, the plan door's `check_settings`). Of the
checks `validate` runs, these read what varies, and are asked here in validate's order:
- the degrees against the run (`ParallelDims.check_run`: micro-batches against the local batch and
  the schedule, sequence parallel's split, context parallel's);
- tensor parallel's plan (`check_tensor_parallel`) and the pipeline's split (`check_pipeline`):
  they read the model, not the degrees, so each is asked once per search;
- the memory choice against the layout (`check_memory`: the selective-checkpoint cache under cp
  and the zero-bubble schedules, the step in backward);
- the curriculum against the degrees and accumulation (`check_curriculum`).
The whole `validate` costs about 0.1 s a combination (a pipeline's traced split, the config's
walks), a search prices hundreds in seconds, and it reads the world of this machine, not the
planned one; tests/test_plan.py puts the search's whole list through `validate` itself, so a check
added there that this list misses shows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from omegaconf import DictConfig

from framework.config import ConfigError
from framework.config.data_checks import check_curriculum
from framework.config.memory_checks import check_memory
from framework.config.model import check_pipeline, check_tensor_parallel
from framework.parallel.dims import DimsError, ParallelDims

STRATEGIES = ("fsdp", "tp", "pp", "hybrid", "cp")  # the choices validate checks the degrees of (not ddp)


@dataclass
class Admission:
    """The config check over one search's combinations: each refusal counted once, under its overrides."""

    world: int
    dims_of: tuple[int | None, int | None]  # the model's (blocks, attention heads)
    refusals: dict[tuple[str, ...], str] = field(default_factory=dict)  # overrides -> the check's words
    _seen: set[tuple[str, ...]] = field(default_factory=set)
    _model: dict[tuple, str | None] = field(default_factory=dict)  # the model's checks, once per search

    def refusal(self, trial: DictConfig, overrides: tuple[str, ...]) -> str | None:
        """Why the config check refuses `trial` (a combination's config, `overrides` selecting
        it), or None; a refusal is recorded under its overrides."""
        self._seen.add(overrides)
        try:
            self._check(trial)
        except (ConfigError, DimsError) as err:
            self.refusals[overrides] = str(err)
            return str(err)
        return None

    def record(self) -> dict:
        """How many combinations the config check saw and refused, and one refusal in full."""
        example = next(iter(self.refusals.items()), None)
        return {
            "checked": len(self._seen),
            "refused": len(self.refusals),
            "refused_example": f"{' '.join(example[0])}: {example[1]}" if example else None,
        }

    def _check(self, trial: DictConfig) -> None:
        p = trial.parallel
        dims = ParallelDims.from_config(p, self.world, *self.dims_of)
        if p.name in STRATEGIES:
            dims.check_run(trial)
            if dims.tp > 1:
                self._once(("tp", bool(p.get("sequence_parallel"))), check_tensor_parallel, trial)
            if dims.pp > 1:
                self._once(("pp",), check_pipeline, trial)
        check_memory(trial)
        check_curriculum(trial, dims.dp, dims.tp, dims.pp, dims.cp)

    def _once(self, key: tuple, check: Callable[[DictConfig], None], trial: DictConfig) -> None:
        """A check of the model's (its plan, its split): its answer kept for the rest of the search."""
        if key not in self._model:
            try:
                check(trial)
                self._model[key] = None
            except ConfigError as err:
                self._model[key] = str(err)
        if self._model[key] is not None:
            key_at_fault, message = self._model[key].split(": ", 1)
            raise ConfigError(key_at_fault, message)
