"""What watches or changes a step, beside the loop rather than in it: the hooks a callback may
define, the run it sees (`Run`), and the one small API through which it asks the loop for
something (`Control`). docs/callbacks.md is the user's page; this is the contract.

A callback is any class with at least one of `HOOKS` (subclassing `Callback` is optional; it only
supplies no-op hooks). The framework's own (evaluation, the non-finite check, the progress bar,
the profiler, the loggers, the model's step figures) and a user's (`+callbacks.mine._target_=
pkg.Mine`) are called alike, in that order, on every rank.

Ranks. Every rank calls every hook. A request a callback makes before the step's all-reduce
(up to `on_step_end`) rides it, so any one rank's request is every rank's. A request made after
it (`on_settled`, `on_evaluate`) is acted on where it is made: decide it from the step's
figures, which every rank holds alike, and every rank decides the same.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from framework.figures import Registry

# The hooks, in the order a run calls them (arguments after self):
HOOKS = (
    "on_build",  # (run: Run) the parts are built, before resume: declare figures here
    "on_start",  # (step) resumed (or fresh) and about to train from optimizer step `step` (0-based)
    "on_step_start",  # (step) before the step's batches are read
    "on_before_backward",  # (step, micro) each micro-batch's backward (a pipeline: once, before its schedule)
    "on_before_optimizer_step",  # (step) gradients reduced and unscaled, before clipping and the update
    "on_before_update",  # (step, figures) clipped: the step's global loss and gradient norm on the device
    "on_step_end",  # (step) -> {figure: value} after the update, on the device: the values ride the all-reduce
    "on_step_reduced",  # (step, totals) the step's reduced figures, still on the device (post-step updates)
    "on_settled",  # (step, figures) after the ledger's host sync, each settled step: -> {derived figure: value}
    "on_log",  # (step, record) a metrics.jsonl line (step 0: an evaluation before training, not in the file)
    "on_evaluate",  # (step, result) an evaluation after step `step`
    "on_save",  # (step, path) a checkpoint after step `step` was written (async: staged)
    "on_rollback",  # (step) the run went back to its checkpoint of step `step`: the steps after it are abandoned
    "rollback_reach",  # () -> the oldest step a rollback this callback may still ask for goes back to (None: it asks none)
    "state_dict",  # () -> a JSON-able dict saved in every checkpoint (trainer.json)
    "load_state_dict",  # (state) what state_dict returned, when a run resumes from that checkpoint
    "on_exception",  # (error) the run is failing (then on_end is not called)
    "on_end",  # (summary) the run's summary.json figures (rank 0's are written after this)
)


class Callback:
    """Optional base: every hook a no-op. Override the ones you need."""

    def on_build(self, run: Run) -> None: ...
    def on_start(self, step: int) -> None: ...
    def on_step_start(self, step: int) -> None: ...
    def on_before_backward(self, step: int, micro: int) -> None: ...
    def on_before_optimizer_step(self, step: int) -> None: ...
    def on_before_update(self, step: int, figures: Mapping[str, Any]) -> None: ...
    def on_step_end(self, step: int) -> Mapping[str, Any] | None: ...
    def on_step_reduced(self, step: int, totals: Mapping[str, Any]) -> None: ...
    def on_settled(self, step: int, figures: Mapping[str, Any]) -> Mapping[str, Any] | None: ...
    def on_log(self, step: int, record: Mapping[str, Any]) -> None: ...
    def on_evaluate(self, step: int, result: Mapping[str, Any]) -> None: ...
    def on_save(self, step: int, path: str | None) -> None: ...
    def on_rollback(self, step: int) -> None: ...
    def rollback_reach(self) -> int | None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def on_exception(self, error: BaseException) -> None: ...
    def on_end(self, summary: dict[str, Any]) -> None: ...


def defined_hooks(cls: type) -> list[str]:
    """The hooks `cls` defines itself (the base class's no-ops are not)."""
    return [h for h in HOOKS if callable(getattr(cls, h, None)) and getattr(cls, h) is not getattr(Callback, h, None)]


class CallbackFailure(RuntimeError):
    """A callback ends the run: its message says it all, in one line (no traceback), and the run's
    checkpoints stay as they are."""


@dataclass
class Control:
    """What a callback may ask of the loop. Each request holds for the step it is made in."""

    stop_reason: str | None = None
    save_requested: bool = False
    skip_requested: bool = False
    skip_when: Any = None  # a device bool: skip this step's update where it holds (no host sync)
    log_requested: bool = False
    sync_requested: bool = False
    rollback_to: Rollback | None = None

    def stop(self, reason: str = "a callback") -> None:
        """End the run after this step (a checkpoint is saved where checkpoint.every asks)."""
        self.stop_reason = reason

    def save(self) -> None:
        """Save a checkpoint after this step."""
        self.save_requested = True

    def skip_update(self, when: Any = None) -> None:
        """In on_before_optimizer_step or on_before_update: this step's update is not applied
        (counted as skipped). `when`: a bool tensor on the device, decided there: the update is
        skipped where it holds, and the host never reads it (no sync, but for optimizer state kept
        in host memory beside device parameters: FSDP's CPU offload). Give every rank the same."""
        if when is None:
            self.skip_requested = True
        else:
            self.skip_when = when if self.skip_when is None else self.skip_when | when

    def rollback(self, path: str | None = None, skip_samples: int = 0, *, at_most: int | None = None,
                 data_at: tuple[int, int] | None = None) -> None:  # fmt: skip
        """After this step, go back to checkpoint `path` (None: the newest complete one, of step
        `at_most` or earlier when given, chosen on rank 0 once pending saves are done) and move the
        data `skip_samples` samples past where that checkpoint left it, or to `data_at` (epoch,
        samples of its order) when given. This step is not saved (its state is what is left)."""
        self.rollback_to = Rollback(path, skip_samples, at_most, data_at)

    def log_step(self) -> None:
        """Write this step's metrics.jsonl line even when metrics.log_every would not (asked before
        the step settles, it settles it: ask it alike on every rank)."""
        self.log_requested = self.sync_requested = True

    def sync(self) -> None:
        """Before on_settled: settle this step's figures at its end (its on_settled follows at
        once, not at the next logged step). Ask it alike on every rank (a step-count rule): the
        callbacks that run collectives in on_settled need every rank there."""
        self.sync_requested = True

    def clear(self) -> None:
        self.stop_reason, self.save_requested, self.skip_requested, self.skip_when = None, False, False, None
        self.log_requested, self.sync_requested, self.rollback_to = False, False, None


@dataclass(frozen=True)
class Rollback:
    """A callback's request to go back (Control.rollback)."""

    path: str | None = None
    skip_samples: int = 0
    at_most: int | None = None  # the newest checkpoint of this step or earlier (path None)
    data_at: tuple[int, int] | None = None  # (epoch, samples): where the data goes on from


class Timings:
    """Seconds the run has spent so far, by what it was doing: the loop's own (`data`: waiting for
    batches, `checkpoint_save`, `checkpoint_load`, `rollback`) and a callback's (`evaluation`).
    Read as deltas between hooks (framework/callbacks/health/goodput.py)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def timed(self, what: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(what, time.perf_counter() - t0)

    def add(self, what: str, seconds: float) -> None:
        self.seconds[what] = self.seconds.get(what, 0.0) + seconds


@dataclass
class Run:
    """The run a callback sees (on_build): its config, rank and mesh, what it trains, its figures
    and its control, and where it writes."""

    cfg: Any  # the resolved config (read, never written)
    info: Any  # framework.dist.DistInfo: rank, world_size, device
    parts: Any  # framework.run.step.Parts: the model (parts.par.module), optimizer, data, precision
    figures: Registry
    control: Control
    run_dir: str
    checkpoint_root: str
    started: float | None = None  # when the job started (time.time(); restarts keep the first's), None: unknown
    timings: Timings = field(default_factory=Timings)
    log: Callable[[dict[str, Any], int, bool], None] = field(repr=False, default=lambda record, step, to_file: None)
    save: Callable[[Any, int], str | None] = field(repr=False, default=lambda checkpointer, done: None)
    call: Callable[..., None] = field(repr=False, default=lambda hook, *args: None)  # every callback's `hook`
    reach: Callable[[], int | None] = field(repr=False, default=lambda: None)  # Callbacks.reach

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def mesh(self) -> Any:
        """framework.parallel.dims's mesh (its `dims` the degrees), None off a device mesh."""
        return self.parts.par.mesh


class Callbacks:
    """The run's callbacks by name, in call order, and the figures they declare (`figures`); each
    hook calls only the callbacks that define it."""

    def __init__(self, named: list[tuple[str, Any]], world: int = 1, own: tuple[str, ...] = ()):
        self.named = named
        self.figures = Registry(world)
        for name, callback in named:
            for spec in declared_figures(callback):
                self.figures.declare(spec, name, own=name in own)
        self.hooks = {h: [(n, getattr(cb, h)) for n, cb in named if h in defined_hooks(type(cb))] for h in HOOKS}

    def call(self, hook: str, *args: Any) -> None:
        for _, method in self.hooks[hook]:
            method(*args)

    def gather(self, hook: str, *args: Any) -> dict[str, Any]:
        """Call a hook that returns figures; their values, merged (a name is declared once)."""
        out: dict[str, Any] = {}
        for _, method in self.hooks[hook]:
            out |= method(*args) or {}
        return out

    def state_dict(self) -> dict[str, Any]:
        return {name: method() for name, method in self.hooks["state_dict"]}

    def reach(self) -> int | None:
        """The oldest step a rollback may still go back to, over the callbacks that may ask for one
        (None: none may): the steps up to it are final (framework/callbacks/loggers.py)."""
        return min((r for _, method in self.hooks["rollback_reach"] if (r := method()) is not None), default=None)

    def load_state_dict(self, states: Mapping[str, Any]) -> None:
        for name, method in self.hooks["load_state_dict"]:
            if name in states:
                method(states[name])


def declared_figures(callback: Any) -> list[Any]:
    """What a callback declares up front (`figures`: a class attribute of Figures or dicts): the
    config check reads it before any worker starts; a worker registers it before on_build."""
    return list(getattr(type(callback) if not isinstance(callback, type) else callback, "figures", ()) or ())
