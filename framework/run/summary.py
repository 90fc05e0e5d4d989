"""What a run gathers and how it ends: the per-rank figures of the loop (`RunStats`), the
run's summary.json (`summarize`: one gather, the max over ranks of per-rank figures), and rank
0's closing lines."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from omegaconf import DictConfig

from framework.config import backend_env
from framework.converters import converter_summaries
from framework.dist import DistInfo, all_gather_object
from framework.figures import Registry
from framework.measure.comm import mean_totals
from framework.measure.memory import device_peak_bytes, device_reserved_bytes, peak_rss_bytes
from framework.measure.metrics import Throughput, above_ceiling, load_balance, mfu
from framework.measure.peak import PARTS
from framework.run.measurements import Measurements
from framework.run.step import Parts


@dataclass
class RunStats:
    """What one rank gathers over the loop, for the summary."""

    losses: list[float]  # global mean loss per step, earlier attempts' steps included
    throughput: Throughput = field(default_factory=Throughput)
    work: list[int] = field(default_factory=list)  # tokens (samples for fixed-size data) per step
    forward_s: list[float] = field(default_factory=list)  # forward seconds per step
    slots: int = 0  # token positions computed, padding included
    comm: list[dict[str, Any]] = field(default_factory=list)  # collectives of each sampled step
    state_bytes: dict[str, int] = field(default_factory=dict)  # parameters, gradients, optimizer
    first_step_s: float | None = None  # the first step's time (compilation included)
    startup_s: float | None = None  # process start to the end of the first optimizer step
    checkpoint_saves: int = 0  # every checkpoint written: the periodic ones and the callbacks' own
    checkpoint_s: list[float] = field(default_factory=list)  # seconds training waited for saves
    checkpoint_io: dict[str, Any] = field(default_factory=dict)  # verify_s, load_s, failed_saves
    skipped_steps: int = 0  # updates not applied: non-finite gradients (nonfinite=skip, amp's scaler)
    rss_baseline_bytes: int | None = None  # after imports and process-group set-up, before the model
    started: float | None = None  # when the process started (time.time()), for startup_s; None: unknown
    entered: float | None = None  # when this worker began training (time.time()), for launch_s
    plan_auto: dict[str, Any] | None = None  # parallel=auto: the planner's record of its choice, for plan.auto
    figures: list[dict[str, Any]] = field(default_factory=list)  # the registry's figures of each step

    def rewind(self, step: int, kept_losses: list[float], skipped_steps: int) -> None:
        """Back to after step `step` (a callback's rollback): the losses metrics.jsonl keeps, the
        figures of the steps up to it, the updates skipped by then."""
        self.losses = list(kept_losses)
        self.figures = [f for f in self.figures if f["step"] <= step]
        self.skipped_steps = skipped_steps


class Given(NamedTuple):
    """What a rank is told for its summary beside its config (launch's Job): when the job started
    (startup_s; None: unknown) and, under parallel=auto, the planner's record of its choice and
    why (summary.plan.auto: recorded beside the config, not in it)."""

    started: float | None = None
    plan_auto: dict[str, Any] | None = None
    entered: float | None = None  # when this worker began (time.time()), for launch_s


def summarize(cfg: DictConfig, info: DistInfo, parts: Parts, stats: RunStats, measure: Measurements,
              figures: Registry) -> dict[str, Any]:  # fmt: skip
    """The figures of the run's summary.json: per-rank figures are the max over ranks (one gather,
    at the end); the registry's figures over the run's steps, in their blocks (framework/figures.py);
    callbacks add their own blocks after this (on_end). `checkpoint.saves` counts every checkpoint the run wrote,
    periodic (checkpoint.every, a preemption's, a callback's request) and a callback's own (the best checkpoint's,
    which its callback counts apart); `blocking_s` is what training waited for them all."""
    everyone = all_gather_object(rank_figures(info, stats, measure), info)
    memory = {k: max(r[k] for r in everyone) if everyone[0].get(k) is not None else None for k in MEMORY_KEYS}
    memory["breakdown"] = max((r["breakdown"] for r in everyone), key=lambda b: b["peak_bytes"] or 0)  # the top rank's
    counting = [r for r in everyone if r["work"]]  # one rank per data-parallel group
    rates = throughput = stats.throughput.rates()
    per_step = stats.throughput.per_step()
    balance = load_balance(*([r[key] for r in counting] for key in ("work", "slots", "forward")))
    if cfg.data.get("pack"):  # packed blocks hold no padding: the unused positions are document boundaries
        balance["boundary_waste"] = balance.pop("padding_waste")
    par, flops, peak = parts.par, parts.flops, measure.peak_flops
    tokens_per_s = rates["tokens_per_s"]
    achieved = flops.model * tokens_per_s / flops.devices / 1e12 if flops.model and tokens_per_s else None
    hfu = mfu(flops.hardware, tokens_per_s, peak, flops.devices)
    impossible = above_ceiling(hfu, peak, cfg.metrics.ceiling_tflops)
    summary = {
        "world_size": info.world_size,
        "parallel_dims": par.mesh.dims.layout if par.mesh else {"dp": par.dp_size},
        # NCCL_*/GLOO_* knobs as this worker's environment holds them
        "backend_env": {k: os.environ.get(k) for k in backend_env(cfg.backend)},
        "global_batch_size": per_step["samples"],  # samples per optimizer step, as they came
        "per_step": per_step,
        "steps": cfg.steps,
        "nonfinite_skipped": stats.skipped_steps,
        "checkpoint": checkpoint_figures(stats),
        "first_loss": stats.losses[0] if stats.losses else None,
        "final_loss": stats.losses[-1] if stats.losses else None,
        "throughput": throughput,
        "step_time_s": stats.throughput.median_step_time(),
        "train_time_s": stats.throughput.total_time(),
        "startup_s": max(r["startup_s"] for r in everyone if r["startup_s"] is not None),
        "launch_s": max((r["launch_s"] for r in everyone if r["launch_s"] is not None), default=None),
        "compile_s": stats.first_step_s if cfg.compile else None,
        "mfu": None if impossible else mfu(flops.model, tokens_per_s, peak, flops.devices),
        "hfu": None if impossible else hfu,
        "mfu_flag": impossible,  # why MFU and HFU are not reported
        "flops_per_token": flops.model,
        "flops_counted": flops.how,  # declared by the model, counted on meta, or estimated and why
        "peak_tflops_per_device": peak / 1e12 if peak else None,
        # fp32 matmuls on TF32 tensor cores (precision.tf32 on CUDA): the peak above is TF32's
        "tf32": info.device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32,
        "tflops_per_device": achieved,
        "memory": memory,
        # the rank that communicates most (pipeline stages differ), per optimizer step
        "comm": max((r["comm"] for r in everyone if r["comm"]), key=lambda c: c["bytes"], default=None),
        "comm_by_op": ops_over_ranks([r["comm"] for r in everyone]),
        "load_balance": balance,
        "converters": converter_summaries(parts.converters, flops.model),  # float8: recipe, FLOPs share, MFU's peak
        "data": getattr(parts.data.dataset, "figures", None),  # what the dataset counted (data=hf: rows left out)
        **figures.summarize(stats.figures),
        "figure_columns": figures.columns(),  # the sweep report's columns of declared figures
    }
    summary["plan"] = plan_check(cfg, info.world_size, summary, stats.plan_auto) if info.is_main else None  # rank 0's
    return summary


def rank_figures(info: DistInfo, stats: RunStats, measure: Measurements) -> dict[str, Any]:
    """This rank's part of the summary, to gather."""
    memory_bytes = {**stats.state_bytes, "activation_bytes": measure.meter.peak if stats.state_bytes else None}
    local = {
        **memory_bytes,
        "device_peak_bytes": device_peak_bytes(info.device),
        "device_reserved_bytes": device_reserved_bytes(info.device),
        "rss_peak_bytes": peak_rss_bytes(),
        "rss_baseline_bytes": stats.rss_baseline_bytes,
        "comm": mean_totals(stats.comm),
        "work": stats.work,
        "slots": stats.slots,
        "forward": stats.forward_s,
        "startup_s": stats.startup_s,
        # the launcher's share of it: process start to this worker's start (imports, config, checks)
        "launch_s": None if None in (stats.started, stats.entered) else stats.entered - stats.started,
    }
    local["breakdown"] = breakdown(local, measure.probe.parts)
    return local


def checkpoint_figures(stats: RunStats) -> dict[str, Any]:
    """summary.checkpoint: the saves, what training waited for (a callback's own saves among them)."""
    return {"saves": stats.checkpoint_saves, "blocking_s": sum(stats.checkpoint_s),
            **stats.checkpoint_io}  # fmt: skip


def plan_check(cfg: DictConfig, world: int, summary: dict[str, Any], auto: dict[str, Any] | None) -> dict[str, Any]:
    """The planner's prediction for this run's own layout against what the run measured (and,
    under parallel=auto, `auto`: what it chose and why). A planner fault never fails a finished
    run: it is reported in the block instead."""
    from framework.plan import check, predict
    from framework.plan.profile import machine_profile

    try:
        block = check(predict(cfg, world, machine_profile(cfg, world, "cache")), summary)
    except Exception as err:  # noqa: BLE001 - reported, not raised: the run itself succeeded
        print(f"warning: the planner could not predict this run: {type(err).__name__}: {err}", flush=True)
        block = {"error": f"{type(err).__name__}: {err}"}
    if unpriced := block.get("not_predicted", {}).get("optim_bytes"):  # a component the planner could not price
        print(f"note: {unpriced}", flush=True)
    if auto is not None:
        block["auto"] = auto
    budget = budget_check(cfg, summary, auto)
    if budget is not None:
        block["budget"] = budget
    return block


def budget_check(cfg: DictConfig, summary: dict[str, Any], auto: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run's measured peak per rank against the memory budget it was given (plan.memory_budget_mb,
    or the one parallel=auto chose for: summary.plan.auto.budget_mb); None without one. A run over
    it finished, but not within what it was asked to fit: `over`, and a closing line (`report`)."""
    from framework.plan import measured_peak

    budget_mb = cfg.plan.memory_budget_mb if cfg.plan.memory_budget_mb is not None else (auto or {}).get("budget_mb")
    peak = measured_peak(summary)
    if budget_mb is None or peak is None:
        return None
    budget = budget_mb * 2**20  # MB as the planner counts them (framework.plan.search.memory_budget_bytes)
    return {"budget_bytes": budget, "peak_bytes": peak, "over": peak > budget}


def breakdown(local: dict[str, Any], parts: dict[str, int] | None) -> dict[str, int | None]:
    """This rank's peak taken apart: on CUDA the allocator's peak (from zero), on CPU the peak RSS
    above the baseline (the process before the model). `parts` are what was live at the highest
    reading of the sampled steps (see framework.measure.peak): model state, saved activations, gathered
    parameters, buffers of the collective in flight. What they do not account for is
    `unexplained_bytes`: temporaries (the optimizer's, the backend's copies), allocator retention,
    and any part of the peak reached outside the sampled steps."""
    cuda = local["device_peak_bytes"] is not None
    peak = local["device_peak_bytes"] if cuda else local["rss_peak_bytes"]
    baseline = 0 if cuda else local["rss_baseline_bytes"]
    parts = parts or dict.fromkeys(PARTS)
    known = None if baseline is None or None in parts.values() else baseline + sum(parts.values())
    return {"peak_bytes": peak, "baseline_bytes": baseline, **parts,
            "unexplained_bytes": None if known is None else peak - known}  # fmt: skip


MEMORY_KEYS = (
    "param_bytes",
    "grad_bytes",
    "optim_bytes",
    "offloaded_bytes",  # of the three above, the bytes in host memory (FSDP CPU offload), not the device's
    "activation_bytes",
    "device_peak_bytes",
    "device_reserved_bytes",
    "rss_peak_bytes",
    "rss_baseline_bytes",
)


class Segment(NamedTuple):
    """What this process trained: a resumed run's closing line reports its own steps, not the
    whole run's (summary.json keeps the whole run's first_loss)."""

    start_step: int
    steps: int
    first_loss: float | None

    @classmethod
    def of(cls, start_step: int, losses: list[float]) -> Segment:
        return cls(start_step, len(losses), losses[0] if losses else None)

    def describe(self) -> str:
        if self.start_step == 0:
            return f"{self.steps} steps"
        if self.steps == 0:
            return f"no steps (resumed at step {self.start_step}, the run's last)"
        last = self.start_step + self.steps
        return f"steps {self.start_step + 1}-{last} ({self.steps} this run, resumed from step {self.start_step})"


def report(summary: dict[str, Any], segment: Segment, run_dir: str) -> None:
    """Rank 0's closing lines: what this process trained and where the run's files are."""
    rate = summary["throughput"]
    speed = f"{rate['tokens_per_s']:.0f} tokens/s" if rate["tokens_per_s"] else f"{rate['samples_per_s']:.1f} samples/s"
    first = segment.first_loss if segment.first_loss is not None else summary["first_loss"]
    print(
        f"done: {segment.describe()}, loss {first:.4f} -> {summary['final_loss']:.4f}, "
        f"{speed}, {summary['step_time_s'] * 1000:.1f} ms/step on {summary['world_size']} rank(s)\n"
        f"run dir: {run_dir}",
        flush=True,
    )
    if summary.get("stopped"):  # a callback ended the run before steps= (summary.json `stopped`)
        print(f"stopped after step {summary['stopped']['after_step']} of {summary['steps']}: "
              f"{summary['stopped']['by']}", flush=True)  # fmt: skip
    budget = (summary.get("plan") or {}).get("budget")
    if budget and budget["over"]:
        peak, limit = budget["peak_bytes"], budget["budget_bytes"]
        print(f"warning: the measured peak, {peak / 2**20:.0f} MB per rank, is {peak / limit - 1:.0%} over the "
              f"memory budget of {limit / 2**20:g} MB (plan.memory_budget_mb; summary.json plan.budget)", flush=True)  # fmt: skip
    if summary.get("mfu_flag"):
        print(f"warning: {summary['mfu_flag']} (summary.json mfu_flag)", flush=True)
    if (summary.get("flops_counted") or "").startswith("estimated"):
        print(f"note: FLOPs per token (MFU) {summary['flops_counted']} (summary.json flops_counted)", flush=True)


def ops_over_ranks(comm: list[dict[str, Any] | None]) -> dict[str, dict[str, float]]:
    """Each collective's bytes a step over the ranks (`comm`: each rank's, None where it measured
    none): the mean rank's (what the planner forecasts for traffic that differs by rank, as an
    all-to-all's does) and the busiest rank's over it."""
    ops = sorted({op for c in comm if c for op in c["by_op"]})
    out = {}
    for op in ops:
        sent = [c["by_op"][op]["bytes"] for c in comm if c and op in c["by_op"]]
        mean = sum(sent) / len(comm)
        out[op] = {"mean_bytes": mean, "imbalance": max(sent) / mean if mean else None}
    return out
