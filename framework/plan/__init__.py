"""The planner: predicts each layout's memory (by kind, and the peak), communication and step time
before launch, picks the fastest layout and memory knobs that fit (`parallel=auto`), and every
run checks its prediction against what it measured (`summary.json` `plan`).

    python -m framework.plan [overrides] plan.world_size=N     # the ranked table, no training

A pure function of the config, the model's shapes (built on the meta device) and the machine
profile. The formulas: `model` (state), `activations` (saved for backward, FSDP's gathered
units), `peak` (the peak), `traffic` (collectives), `timing` (step time); the machine figures in
`profile`; the search in `search`. A prediction has the measured figures' names and units, per
rank (the rank holding most, as the summary reports the max over ranks), per optimizer step.
"""

from framework.plan.predict import FIGURES, check, layout_name, measured_peak, predict
from framework.plan.search import (
    AutoChoice,
    Candidate,
    Knobs,
    Ranked,
    candidates,
    choose,
    memory_budget_bytes,
    plan_auto,
    rank,
)
from framework.plan.timing import bubble, step_time

__all__ = [
    "FIGURES", "AutoChoice", "Candidate", "Knobs", "Ranked", "bubble", "candidates", "check", "choose", "layout_name",
    "measured_peak", "memory_budget_bytes", "plan_auto", "predict", "rank", "step_time",
]  # fmt: skip
