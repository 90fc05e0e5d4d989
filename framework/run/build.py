"""One rank's parts, built in the one fixed order, and the state a resumed run goes on from.

The build order. Process group (already up) -> model on the meta device, from the same seed on
every rank so replicas start identical -> parallelize (pipeline split, tensor parallel, context
parallel, activation checkpointing, compile, FSDP/DDP: that order, written once in
framework.parallel.apply.parallelize, which also materialises this rank's part) -> optimizer (over the
final, possibly sharded parameters) -> data (split over the data-parallel ranks the strategy
defines) -> precision -> resume."""

from __future__ import annotations

import copy
import random
import time
from dataclasses import replace

import torch
from omegaconf import DictConfig

from framework.checkpoint import store as checkpoint
from framework.checkpoint.resume import choose as choose_resume
from framework.contract import blocks_of, build_model, spec_of
from framework.converters import converted_model, hook_converters
from framework.data import build_data
from framework.data.datasets import truncation_line
from framework.dist import DistInfo, restart_count
from framework.measure.memory import SavedActivationMeter
from framework.measure.metrics import ForwardTimer, count_flops, peak_flops
from framework.measure.peak import PeakProbe
from framework.optimizers.build import build_optimizer
from framework.parallel.apply import Parallelized, parallelize
from framework.parallel.dims import Strategy
from framework.precision import build_precision
from framework.run.measurements import Measurements
from framework.run.run_files import checkpoint_root
from framework.run.step import Parts, Resumed
from framework.schedules import build_scheduler, load_schedule, resumed_schedule


def meta_twin(model: torch.nn.Module) -> torch.nn.Module:
    """`model` on the meta device, where FLOPs are counted (a model built on the device: a copy)."""
    if all(p.is_meta for p in model.parameters()):
        return model
    return copy.deepcopy(model).to("meta")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def build(cfg: DictConfig, info: DistInfo, train_data: bool = True) -> Parts:
    """This rank's parts (before `resume` loads a checkpoint into them); `train_data=False`: no
    training data (a front door that reads a split of its own: the training one may be smaller than a batch)."""
    seed_everything(cfg.seed)
    meta = build_model(cfg.model, "meta")  # free: the contract is read from it
    spec = spec_of(meta, cfg.model)
    model, converters = converted_model(meta, spec, cfg, info)  # the one converter point (framework/converters)
    flops = count_flops(meta_twin(model), spec, cfg, Strategy.of(cfg.parallel).devices(info.world_size))
    n_blocks = len(blocks_of(model, spec))
    par = parallelize(model, spec, cfg, info)
    del meta, model  # the plain model objects keep nothing alive beyond what `par` holds
    optimizer = build_optimizer(par.module, cfg.optim, par.decay, par, par.matrices)
    hook_converters(converters, optimizer, par.module)  # their post-optimizer hooks, after each step
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.steps)
    precision = build_precision(cfg.precision, info.device, sharded=Strategy.of(cfg.parallel).on_mesh)
    if not train_data:
        return Parts(flops, par, optimizer, scheduler, None, precision, spec, n_blocks, converters)
    data = build_data(cfg.data, (par.dp_rank, par.dp_size), info.device, cfg.seed, spec.task, cfg.accumulation_steps)
    if info.is_main:  # one line when data.max_bytes cuts the text corpus short (a preset may)
        print(truncation_line(cfg.data), end="", flush=True)  # '' when nothing is cut
        if note := getattr(data.dataset, "note", None):  # e.g. data=hf's rows left out
            print(note, flush=True)
    return Parts(flops, par, optimizer, scheduler, data, precision, spec, n_blocks, converters)


def resume(cfg: DictConfig, info: DistInfo, parts: Parts, run_dir: str) -> Resumed:
    """Where this run goes on from: checkpoint.resume, or the newest checkpoint after an elastic
    restart, verified first (framework/checkpoint/resume.py) and loaded into `parts`; else the start."""
    path, verify_s = choose_resume(cfg, checkpoint_root(cfg, run_dir), info)
    if restart_count() > 0 and info.is_main:
        print(f"restart {restart_count()} of launch.max_restarts={cfg.launch.max_restarts} after a worker failed: "
              f"continuing from {path or 'the start (no checkpoint yet)'}", flush=True)  # fmt: skip
    if not path:
        return Resumed(verify_s=verify_s)
    t0 = time.perf_counter()
    resumed = resume_from(path, parts, info)
    resumed = replace(resumed, verify_s=verify_s, load_s=verify_s + time.perf_counter() - t0)
    horizon = resumed_schedule(parts.scheduler, cfg.schedule, cfg.steps)  # kept unless schedule.steps
    if info.is_main:  # a resumed run says so, and from where
        print(f"resumed from step {resumed.step} (checkpoint {path})", flush=True)
        if horizon:
            print(horizon, flush=True)
    return resumed


def generators(parts: Parts) -> dict[str, torch.Generator]:
    """Random generators of this rank beyond the global ones, saved with its RNG state."""
    augment = parts.data.device_transform
    return {"augment": augment.generator} if augment is not None else {}


def layout(cfg: DictConfig, info: DistInfo, par: Parallelized) -> dict:
    return {"parallel": cfg.parallel.name, "world_size": info.world_size, "dp_size": par.dp_size}


def resume_from(path: str, parts: Parts, info: DistInfo) -> Resumed:
    """Continue from checkpoint `path`: model and optimizer (resharded to this layout), the LR
    schedule, the loss scaler, the data position and, on the same layout, every rank's RNG."""
    state, rng = checkpoint.load(path, parts.par.module, parts.optimizer, info.rank, parts.par.tie_names)
    for converter in parts.converters.values():  # the weights changed as a step changes them (float8's scales)
        if callable(getattr(converter, "post_optimizer_hook", None)):
            converter.post_optimizer_hook(parts.par.module)
    data_position(state.data, parts.data, path)
    load_schedule(parts.scheduler, state.scheduler)  # its per-group lists onto this rank's groups
    if state.scaler and parts.precision.scaler.is_enabled():
        parts.precision.scaler.load_state_dict(state.scaler)
    same_ranks = (state.layout["world_size"], state.layout["dp_size"]) == (info.world_size, parts.par.dp_size)
    if rng is not None and same_ranks:
        checkpoint.set_rng_state(rng, generators(parts))
    else:  # another layout: per-rank random streams cannot map; start fresh ones, deterministically
        seed_everything(hash((state.step, info.rank)) % 2**31)
    return Resumed(
        step=state.step,
        data_position=(state.data["epoch"], state.data["samples"]),
        skipped_steps=state.counters.get("nonfinite_skipped", 0),
        callbacks=state.counters.get("callbacks", {}),  # each callback's state_dict, by name
    )


def data_position(saved: dict, data, path: str) -> None:
    """Refuse, in one line, a resume whose data position cannot map: the position counts samples
    of an epoch's order, which depends on the data (its size) and the seed alone."""
    if "samples" not in saved:
        raise ValueError(f"checkpoint.resume: {path} counts its data position in batches (saved by an earlier "
                         "version); resume it with the global batch it was saved with, in that version")  # fmt: skip
    size = data.position()["size"]  # None for a stream (its size is unknown)
    if saved.get("size") != size:
        raise ValueError(f"checkpoint.resume: {path} was saved reading {saved.get('size')} samples an epoch; this "
                         f"run's data has {size}, so its position (sample {saved['samples']} of epoch "
                         f"{saved['epoch']}) does not map. Resume on the same data")  # fmt: skip


def build_measurements(cfg: DictConfig, info: DistInfo, parts: Parts, run_dir: str) -> Measurements:
    module = parts.par.module
    meter = SavedActivationMeter(module)
    precision = parts.precision
    peak = (
        peak_flops(info.device, cfg.metrics.peak_tflops, precision.dtype, precision.tf32) if parts.flops.model else None
    )
    return Measurements(
        meter=meter,
        probe=PeakProbe(module, parts.optimizer, meter, info.device),
        forward_timer=ForwardTimer(info.device),
        peak_flops=peak,
    )
