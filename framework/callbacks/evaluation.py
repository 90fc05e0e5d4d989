"""Evaluation on the validation split, under every strategy: the held-out loss (a token-weighted
mean for lm, sample-weighted for classify), perplexity or accuracy, the best evaluation and early
stopping (`eval.*`, `checkpoint.monitor`): the `Evaluation` callback during training, `evaluate`
for framework.evaluate too.

How the split is read: data-parallel rank r of w reads samples r, r+w, ... (no shuffling), padded
by repeating samples to the same number of full batches on every rank (FSDP's collectives and a
pipeline's fixed micro-batch shapes need that). The repeats' targets are IGNORE_INDEX, so they
weigh nothing: every validation sample counts exactly once. Tensor- and pipeline-parallel peers
read the same batch; one of them (the one holding the loss) adds it. An evaluation runs under
model.eval() and no_grad, draws nothing from the training's random generators, and so leaves
training bitwise unchanged.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset

from framework.checkpoint.store import Checkpointer, best_root, write_config
from framework.contract import logits_of
from framework.data import build_dataset, to_device, transforms_on_device
from framework.data.images import DeviceAugment
from framework.dist import DistInfo, all_reduce_sum
from framework.hooks import Run
from framework.loss import IGNORE_INDEX, cross_entropy

Parts = Any  # framework.run.step.Parts: the model, its data and precision (this room sits below the run's)


def eval_batches(n: int, dp_rank: int, dp_size: int, batch_size: int) -> tuple[list[list[int]], list[list[bool]]]:
    """This rank's batches of sample indices over `n` samples and which positions are repeats
    (padding): every rank gets the same number of full batches."""
    mine = list(range(dp_rank, n, dp_size))
    per_rank = -(-n // dp_size)
    total = -(-per_rank // batch_size) * batch_size
    indices = mine + [k % n for k in range(total - len(mine))]
    repeat = [False] * len(mine) + [True] * (total - len(mine))
    cut = range(0, total, batch_size)
    return [indices[i : i + batch_size] for i in cut], [repeat[i : i + batch_size] for i in cut]


@dataclass
class EvalData:
    """One rank's share of the validation split, as padded batches."""

    dataset: Dataset
    loader: DataLoader
    repeats: list[list[bool]]  # per batch: which rows are padding (no loss)
    transform: DeviceAugment | None = None  # images on the device: normalisation, no augmentation

    def batches(self, device: torch.device, limit: int):
        for k, (batch, repeat) in enumerate(zip(self.loader, self.repeats, strict=True)):
            if 0 <= limit <= k:
                return
            inputs, target = batch
            target = target.clone()
            target[torch.tensor(repeat)] = IGNORE_INDEX
            inputs, target = to_device((inputs, target), device)
            if self.transform is not None:
                inputs = (self.transform(inputs[0]), *inputs[1:])
            yield inputs, target


def build_eval_data(cfg: DictConfig, setup: Parts, device: torch.device, dataset: Dataset | None = None) -> EvalData:
    """The validation split (or `dataset`) read by this rank. A pipeline runs the whole local batch
    of a step (accumulation_steps x batch_size) through its schedule, so it evaluates in those."""
    par = setup.par
    dataset = dataset if dataset is not None else build_dataset(cfg.data, cfg.seed, setup.task, "val")
    batch_size = cfg.data.batch_size * (cfg.accumulation_steps if par.pipeline is not None else 1)
    batches, repeats = eval_batches(len(dataset), par.dp_rank, par.dp_size, batch_size)
    # its own generator: iterating a loader draws a seed, never from the global (training) one
    loader = DataLoader(dataset, batch_sampler=batches, collate_fn=dataset.collate, generator=torch.Generator())
    transform = DeviceAugment(False, 0, device) if transforms_on_device(cfg.data) else None
    return EvalData(dataset, loader, repeats, transform)


def _forward(setup: Parts, inputs: tuple, target: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(logits, their targets) of a batch (logits None on pipeline ranks without the last stage).
    A pipeline goes through its schedule's forward-only path; DDP's wrapper is skipped (no
    gradients to sync); under context parallel each rank runs its part of every sequence through
    the ring, as in training (not the whole sequence cp times over)."""
    par = setup.par
    pipeline = par.pipeline
    inputs, kwargs, target = par.split_batch(inputs, target)
    if pipeline is not None:
        pipeline.place(kwargs.get("positions"))
        args = (inputs[0],) if pipeline.has_first else ()
        kwargs = {"target": target, "losses": []} if pipeline.has_last else {}
        with _no_local_gradient_handover(pipeline.schedule), par.loss_context(), setup.precision.autocast():
            return pipeline.schedule.eval(*args, **kwargs), target
    module = par.module
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        module = module.module
    with par.loss_context(), setup.precision.autocast():
        return logits_of(module(*inputs, **kwargs)), target


@contextmanager
def _no_local_gradient_handover(schedule):
    """torch 2.14's multi-stage schedules still walk their backward actions under `eval` (as
    no-ops), but between two adjacent stages on one rank (the V schedules: ZBVZeroBubble) they hand
    the input gradient over in place, which asserts there is a backward. With no backward there
    is no gradient to hand over: the hand-over is skipped while `eval` runs."""
    stages = getattr(schedule, "_stages", [])
    for stage in stages:
        stage.get_local_bwd_output = lambda mb_index: ()
        stage.set_local_bwd_input = lambda outputs, mb_index: None
    try:
        yield
    finally:
        for stage in stages:  # the class's own methods again, for training
            del stage.get_local_bwd_output, stage.set_local_bwd_input


@torch.no_grad()
def evaluate(setup: Parts, val: EvalData, info: DistInfo, max_batches: int = -1) -> dict[str, float]:
    """The loss over this split (all ranks together), perplexity (lm) or accuracy (classify), the
    number of loss terms and the seconds it took. Collective: every rank calls it."""
    t0 = time.perf_counter()
    par, module = setup.par, setup.par.module
    was_training = module.training
    module.eval()  # dropout off
    totals = torch.zeros(3, device=info.device, dtype=torch.float64)  # loss sum, terms, correct
    try:
        for inputs, target in val.batches(info.device, max_batches):
            logits, target = _forward(setup, inputs, target)
            if logits is None:
                continue
            with par.loss_context():
                loss = cross_entropy(logits, target, reduction="sum")
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # loss parallel: a DTensor
            counted = target != IGNORE_INDEX
            correct = (logits.argmax(-1) == target)[counted].sum() if setup.task == "classify" else 0
            totals += torch.stack([loss.double(), counted.sum().double(), torch.as_tensor(correct).double()])
    finally:
        module.train(was_training)
    tp_rank = par.mesh.tp_rank if par.mesh is not None else 0
    # the ranks whose loss terms are distinct: the loss's holder off a pipeline's tp peers; else one
    # rank of each tp group (its cp peers each hold a part of every sequence)
    adds = par.holds_loss and tp_rank == 0 if par.pipeline is not None else par.counts_loss
    loss_sum, terms, correct = all_reduce_sum(totals * float(adds), info).tolist()
    loss = loss_sum / terms if terms else math.nan
    result = {"loss": loss, "terms": int(terms), "seconds": time.perf_counter() - t0}
    if setup.task == "lm":
        result["perplexity"] = math.exp(min(loss, 700.0))
    else:
        result["accuracy"] = correct / terms if terms else math.nan
    return result


class Evaluation:
    """Evaluation during training (eval.every, eval.at_start): when it is due, the best so far
    (checkpoint.monitor=val_loss: one complete checkpoint of the best under <checkpoint root>/best)
    and early stopping (eval.patience). Every rank holds the same figures (they come from an
    all-reduce), so every rank decides the same: they stop after the same step."""

    figures = (
        {
            "name": "val_loss",
            "reduce": None,
            "summary": ("last",),
            "group": "eval",
            "key": "loss",
            "report": "val loss",
        },
        {"name": "val_perplexity", "reduce": None, "summary": ()},
        {"name": "val_accuracy", "reduce": None, "summary": ()},
        {"name": "eval_s", "reduce": None, "summary": ()},
    )

    def __init__(self) -> None:
        self.run: Run | None = None
        self.val: EvalData | None = None
        self.best: Checkpointer | None = None
        self.best_loss, self.best_step, self.stale = math.inf, None, 0  # stale: evaluations since the best
        self.stopped_at: int | None = None  # eval.patience: the step the run stopped after
        self.history: list[dict[str, float]] = []
        self.seconds, self.best_saves = 0.0, 0

    def on_build(self, run: Run) -> None:
        self.run, cfg = run, run.cfg
        if cfg.eval.every > 0 or cfg.eval.at_start:
            self.val = build_eval_data(cfg, run.parts, run.info.device)
        if cfg.checkpoint.monitor:  # complete before training goes on
            if run.info.is_main and not cfg.checkpoint.every:  # the run's config beside them (the loop's otherwise)
                write_config(run.checkpoint_root, OmegaConf.to_container(cfg, resolve=True))
            options = OmegaConf.merge(cfg.checkpoint, {"keep_last": 1, "async_save": False})
            self.best = Checkpointer(best_root(run.checkpoint_root), run.info.rank, options)

    def on_start(self, step: int) -> None:
        """eval.at_start: the initial weights, logged as step 0 to W&B/TensorBoard (metrics.jsonl
        has lines of optimizer steps only) and in summary.eval.history; not a best checkpoint."""
        if self.val is not None and self.run.cfg.eval.at_start and step == 0:
            self.run.log(self.evaluate(0), 0, False)

    def on_step_end(self, step: int) -> None:
        if self.due(step + 1):  # its figures settled at once: the evaluation follows this step
            self.run.control.sync()

    def due(self, done: int) -> bool:
        """Whether an evaluation follows step `done` (every eval.every steps, and after the last)."""
        every = self.run.cfg.eval.every
        return every > 0 and (done % every == 0 or done == self.run.cfg.steps)

    def evaluate(self, done: int) -> dict[str, float]:
        """Evaluate after `done` optimizer steps; returns the metrics.jsonl fields."""
        with self.run.timings.timed("evaluation"):  # the run's account of its time (goodput)
            result = evaluate(self.run.parts, self.val, self.run.info, self.run.cfg.eval.steps)
        self.seconds += result["seconds"]
        figures = {k: v for k, v in result.items() if k in ("loss", "perplexity", "accuracy")}
        self.history.append({"step": done, **figures, "terms": result["terms"]})
        return {**{f"val_{k}": v for k, v in figures.items()}, "eval_s": result["seconds"]}

    def on_settled(self, step: int, figures: dict[str, Any]) -> dict[str, float] | None:
        """After the window's sync (not in its time): evaluate when due, keep the best, decide
        early stopping; the step's line is written whatever metrics.log_every says."""
        done, e = step + 1, self.run.cfg.eval
        if not self.due(done):
            return None
        record = self.evaluate(done)
        improved = record["val_loss"] < self.best_loss - e.min_delta
        if improved:
            self.best_loss, self.best_step = record["val_loss"], done
        self.stale = 0 if improved else self.stale + 1
        if improved and self.best is not None:
            self.run.save(self.best, done)
            self.best_saves += 1
        stop = bool(e.patience and self.stale >= e.patience and done < self.run.cfg.steps)
        if stop:
            self.stopped_at = done
            self.run.control.stop("eval.patience")
        if self.run.info.is_main:
            print(self.describe(done, record["val_loss"], stop), flush=True)
        self.run.control.log_step()
        self.run.call("on_evaluate", step, record)
        return record

    def describe(self, done: int, loss: float, stop: bool) -> str:
        """The console's line of an evaluation (and, when it stops the run, why)."""
        line = f"eval at step {done}: val_loss {loss:.4f} (best {self.best_loss:.4f} at step {self.best_step})"
        if stop:
            e = self.run.cfg.eval
            line += (f"; early stop: no improvement by more than eval.min_delta={e.min_delta:g} in "
                     f"eval.patience={e.patience} evaluations")  # fmt: skip
        return line

    def state_dict(self) -> dict[str, Any]:  # a resumed run goes on from its best, not from scratch
        if self.best_step is None and not self.stale:
            return {}
        return {"best_loss": self.best_loss, "best_step": self.best_step, "stale": self.stale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self.best_loss, self.best_step, self.stale = state["best_loss"], state["best_step"], state["stale"]

    def on_end(self, summary: dict[str, Any]) -> None:
        """summary.json's `eval` block (None when evaluation is off), `stopped_early`, and the best
        evaluation's saves among the run's checkpoints."""
        summary["stopped_early"] = self.stopped_at
        summary["checkpoint"]["best_saves"] = self.best_saves
        summary["eval"] = None
        if self.history:
            last = {k: v for k, v in self.history[-1].items() if k not in ("step", "terms")}
            best = self.best_loss if self.best_step is not None else None
            summary["eval"] = {**last, "best_loss": best, "best_step": self.best_step, "evals": len(self.history),
                               "eval_s": self.seconds, "history": self.history}  # fmt: skip
