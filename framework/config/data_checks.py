"""Checks of the data's curriculum (`data.batch_schedule`, `data.seq_len_schedule`) and its
validation split: what a schema cannot tell, before any worker starts (framework/config/validate.py
calls them)."""

from __future__ import annotations

import math
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.config.errors import ConfigError

# data whose samples are token windows of data.seq_len (a length schedule cuts them shorter)
TOKEN_WINDOWS = ("text", "tokens", "chat", "hf")


# data that validates on a file of its own (data.val_path), read as data.path is (a stream's map-style)
VAL_PATH_DATA = ("text", "hf")


def check_val_split(d: DictConfig, evaluating: bool) -> None:
    """data.val_fraction and data.val_path make a split the data can hold out, and one exists where
    evaluation reads it. A stream holds nothing out: it validates on data.val_path."""
    if not 0 <= d.val_fraction < 1:
        raise ConfigError("data.val_fraction", f"got {d.val_fraction}; must be >= 0 and < 1")
    stream = d.name == "hf" and d.get("streaming")
    if stream and d.val_fraction > 0:
        raise ConfigError("data.val_fraction", "a stream (data.streaming=true) holds nothing out; validate on "
                          "data.val_path=FILE (read map-style)")  # fmt: skip
    if d.get("val_path") is not None:
        if d.name not in VAL_PATH_DATA:
            raise ConfigError("data.val_path", f"a file or folder to validate on, for data=text or data=hf; got "
                              f"data={d.name} (hold out data.val_fraction instead)")  # fmt: skip
        if not os.path.exists(d.val_path):
            raise ConfigError("data.val_path", f"no file or folder at {d.val_path!r}")
        if d.name == "hf":
            from framework.data.tokens import hf_problem

            if problem := hf_problem(OmegaConf.merge(d, {"path": d.val_path})):  # its rows read as data.path's
                key, message = problem
                raise ConfigError("data.val_path" if key == "data.path" else key, message)
    if evaluating and not (d.val_fraction > 0 or d.get("val_path")):
        how = "data.val_path=FILE" if stream else "data.val_fraction (0 < f < 1) or data.val_path=FILE (text, hf)"
        raise ConfigError("eval", f"needs a validation split: set {how}")


def schedule_pairs(key: str, schedule: Any) -> list[tuple[int, int]]:
    """[[step, value], ...] as pairs, checked: integers, from step 0, steps rising, values >= 1."""
    try:
        pairs = [(int(step), int(value)) for step, value in schedule]
    except (TypeError, ValueError):
        raise ConfigError(key, f"got {schedule!r}; a list of [step, value] pairs, e.g. [[0,8],[100,16]]") from None
    steps = [step for step, _ in pairs]
    if not pairs or steps[0] != 0 or steps != sorted(set(steps)) or min(v for _, v in pairs) < 1:
        raise ConfigError(key, f"got {schedule!r}; the steps rise from 0 (the first pair is [0, value]) and "
                               "every value is >= 1")  # fmt: skip
    return pairs


def check_data_plan(cfg: DictConfig) -> None:
    """A mixture's entries, and the data's curriculum against the strategy's degrees."""
    if cfg.data.get("sources"):
        check_sources(cfg.data)
    stream = cfg.data.name == "hf" and cfg.data.get("streaming")
    if not (stream or cfg.data.get("batch_schedule") or cfg.data.get("seq_len_schedule")):
        return
    from framework.config.model import model_dims_of
    from framework.config.resolve import world_size_of
    from framework.parallel.dims import ParallelDims

    dims = ParallelDims.from_config(cfg.parallel, world_size_of(cfg), *model_dims_of(cfg))
    check_curriculum(cfg, dims.dp, dims.tp, dims.pp, dims.cp)


def check_curriculum(cfg: DictConfig, dp: int, tp: int, pp: int, cp: int) -> None:
    """The batch and length schedules apply to this data and strategy (dp, tp, pp, cp: the degrees)."""
    d = cfg.data
    if d.get("batch_schedule"):
        key = "data.batch_schedule"
        pairs = schedule_pairs(key, d.batch_schedule)
        if d.sampler == "token_budget" or d.rank_batch_sizes:
            raise ConfigError(key, "token_budget and rank_batch_sizes make their own batches; ramp data.batch_size")
        unit, parts = cfg.accumulation_steps * dp, "accumulation_steps x data-parallel ranks"
        if pp > 1:  # each rank's batch is also cut into the pipeline's micro-batches (Pipeline.fit)
            unit = math.lcm(unit, dp * cfg.parallel.get("n_microbatches", 4))
            parts += " and parallel.n_microbatches"
        if bad := [v for _, v in pairs if v % unit]:
            raise ConfigError(key, f"{bad[0]} samples do not split into {parts} equal micro-batches; use multiples "
                                   f"of {unit}")  # fmt: skip
    if d.get("seq_len_schedule"):
        key = "data.seq_len_schedule"
        pairs = schedule_pairs(key, d.seq_len_schedule)
        if d.name not in TOKEN_WINDOWS or d.get("pack"):
            raise ConfigError(key, f"for token windows of data.seq_len ({', '.join(TOKEN_WINDOWS)}), not data={d.name}"
                                   + (" with packing" if d.get("pack") else ""))  # fmt: skip
        # zigzag cuts a sequence into 2 x cp chunks, and sequence parallel a rank's T / cp over tp
        unit = math.lcm(tp * cp, 2 * cp if cp > 1 else 1)
        if bad := [v for _, v in pairs if v > d.seq_len or v % unit]:
            parts = " and ".join(([f"tp={tp}"] if tp > 1 else []) + ([f"2 x cp={2 * cp}"] if cp > 1 else []))
            raise ConfigError(key, f"{bad[0]} tokens: each length is at most data.seq_len={d.seq_len}"
                                   + (f" and a multiple of {unit} ({parts})" if unit > 1 else ""))  # fmt: skip


def check_sources(d: DictConfig) -> None:
    """data.sources: entries of a weight > 0 and dataset settings of this group (not the loader's:
    one loader reads the mixture), map-style data dealt by the distributed sampler."""
    from dataclasses import fields

    from omegaconf.errors import OmegaConfBaseException

    from framework.config.data_schema import LoaderFields
    from framework.data.mixture import source_configs

    loader_keys = {f.name for f in fields(LoaderFields)} - {"seq_len"}
    for k, entry in enumerate(d.sources):
        key = f"data.sources[{k}]"
        if not OmegaConf.is_dict(entry) or not float(entry.get("weight", 1.0)) > 0:
            raise ConfigError(key, f"got {entry!r}; each source is a mapping of data settings and a weight > 0")
        if bad := sorted(set(entry) & loader_keys):
            raise ConfigError(f"{key}.{bad[0]}", "the loader's settings are the mixture's: set it as data." + bad[0])
        if entry.get("streaming") or d.get("streaming"):
            raise ConfigError(f"{key}.streaming", "a mixture reads map-style sources; streaming=false")
    if d.sampler != "distributed" or d.rank_batch_sizes:
        raise ConfigError("data.sources", "a mixture deals its own order round-robin: sampler=distributed, "
                                          "no rank_batch_sizes")  # fmt: skip
    try:
        sources = source_configs(d)
    except OmegaConfBaseException as err:
        raise ConfigError("data.sources", f"an entry's key is not a data={d.name} setting: {err.msg}") from None
    for k, (_, _, source) in enumerate(sources):  # each source's files, as a single source's are checked
        _check_source_files(source, f"data.sources[{k}]")


def _check_source_files(source: DictConfig, key: str) -> None:
    from pathlib import Path

    from framework.data.tokens import hf_problem

    path = source.get("path")
    if path is not None and not Path(str(path)).exists():
        raise ConfigError(f"{key}.path", f"no file or folder at {str(path)!r}")
    problem = hf_problem(source) if source.name == "hf" else None
    if problem is not None:
        raise ConfigError(f"{key}.{problem[0].removeprefix('data.')}", problem[1])
