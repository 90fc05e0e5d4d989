"""`validate(cfg)`: what a schema cannot check (value ranges, combinations, what this machine can
run), before any worker starts. Each concern is one small check; the first problem raises
`ConfigError` naming the key and what is allowed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import is_dataclass
from typing import Any, get_args, get_type_hints

from omegaconf import DictConfig

from framework.config.callback_checks import check_callbacks
from framework.config.choices import Choice
from framework.config.data_checks import check_data_plan, check_val_split
from framework.config.errors import ConfigError, check_mandatory, resolution_named
from framework.config.keys import check_declared
from framework.config.memory_checks import check_memory
from framework.config.plan_checks import check_plan
from framework.config.range_checks import check_ranges
from framework.config.resolve import cuda_device_count, resolve_device, resolve_nproc, world_size_of


def _get(cfg: DictConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


def _at_least(cfg: DictConfig, key: str, low: int) -> None:
    value = _get(cfg, key)
    _require(value >= low, key, f"got {value}; must be an integer >= {low}")


def validate(cfg: DictConfig, reads_data: bool = True) -> None:
    """Raise ConfigError for the first setting that cannot run. Called before any worker starts.
    The model is paired with its data before a strategy's check builds it (its keys may point into data).
    `reads_data=False` (export: the weights and the config only) leaves out the data's files and plan."""
    check_mandatory(cfg)
    check_declared(cfg)  # +group.key=value: a key the group's schema lacks, which Hydra adds all the same
    data = (check_data_plan, _check_paths, _check_val_split) if reads_data else ()
    for check in (_check_choices, _check_values, check_ranges, _check_loader, _check_device_and_backend, _check_world,
                  _check_model_and_data, _check_strategy, check_memory, _check_batching, *data, _check_eval, check_callbacks):  # fmt: skip
        with resolution_named():
            check(cfg)


def _check_choices(cfg: DictConfig) -> None:
    """Each key its schema types as a choice holds one of its values. Hydra checks them when it
    composes; a config made from a plain dict (a worker's, a saved run's for evaluation) has no
    schema, so they are checked here too."""
    for prefix, schema in _schemas(cfg):
        node = cfg[prefix] if prefix else cfg
        for key, hint in get_type_hints(schema).items():
            enums = [t for t in (get_args(hint) or (hint,)) if isinstance(t, type) and issubclass(t, Choice)]
            value = node.get(key) if enums else None  # only a choice's key: others may not resolve yet
            if value is not None:
                allowed = ", ".join(enums[0])
                _require(value in set(enums[0]), f"{prefix}.{key}".lstrip("."), f"got {value!r}; allowed: {allowed}")


def _schemas(cfg: DictConfig) -> Iterator[tuple[str, type]]:
    """(key, schema) of the top level, each group (by its choice) and each nested section."""
    from framework.config.schema import GROUP_SCHEMAS, Config

    yield "", Config
    for key, hint in get_type_hints(Config).items():
        if key in GROUP_SCHEMAS:
            schemas = GROUP_SCHEMAS[key]
            schema = schemas.get(cfg[key].get("name"), schemas.get("base"))
            if schema is not None:
                yield key, schema
        elif is_dataclass(hint):
            yield key, hint


def _check_values(cfg: DictConfig) -> None:
    """Counts and durations in their ranges (the schema's Enums check the named choices)."""
    for key, low in (("steps", 1), ("accumulation_steps", 1), ("data.batch_size", 1), ("backend.timeout_s", 1),
                     ("launch.max_restarts", 0), ("checkpoint.every", 0), ("checkpoint.keep_last", 0),
                     ("backend.trace_buffer", 0), ("metrics.log_every", 1), ("metrics.sample_every", 0),
                     ("memory.empty_cache_every", 0)):  # fmt: skip
        _at_least(cfg, key, low)
    if cfg.launch.nproc_per_node is not None:
        _at_least(cfg, "launch.nproc_per_node", 1)
    grace, step_timeout = cfg.checkpoint.preempt_grace_s, cfg.backend.step_timeout_s
    _require(grace > 0, "checkpoint.preempt_grace_s", f"got {grace}; must be > 0 seconds")
    _require(step_timeout is None or step_timeout > 0, "backend.step_timeout_s",
             f"got {step_timeout}; must be null or > 0 seconds")  # fmt: skip
    check_plan(cfg)
    version = cfg.parallel.get("version", 2)
    _require(version in (1, 2), "parallel.version", f"got {version!r}; allowed: 1, 2")
    if cfg.profile:
        _check_profiler(cfg)


def _check_profiler(cfg: DictConfig) -> None:
    """profile=true: a trace window the run reaches."""
    for key in ("wait", "warmup", "active"):
        _at_least(cfg, f"profiler.{key}", 1 if key == "active" else 0)
    window = cfg.profiler.wait + cfg.profiler.warmup + cfg.profiler.active
    _require(
        cfg.steps >= window,
        "profiler",
        f"profile=true traces steps {cfg.profiler.wait + cfg.profiler.warmup + 1}..{window} "
        f"(wait + warmup + active) but the run has steps={cfg.steps}; lower profiler.wait/active or raise steps",
    )


def _check_loader(cfg: DictConfig) -> None:
    """The data loader's processes and pinned memory."""
    workers, pin = cfg.data.num_workers, cfg.data.pin_memory
    if cfg.data.name == "hf":  # a stream's rows are read and permuted in windows of this many
        _at_least(cfg, "data.shuffle_buffer", 1)
    _require(workers == "auto" or (isinstance(workers, int) and workers >= 0), "data.num_workers",
             f"got {workers!r}; allowed: auto or an integer >= 0")  # fmt: skip
    _require(pin in ("auto", True, False), "data.pin_memory", f"got {pin!r}; allowed: auto, true, false")
    processes = workers != "auto" and workers > 0
    if cfg.data.prefetch_factor is not None:
        _require(processes, "data.prefetch_factor",
                 "only applies with data.num_workers > 0; set it to null or raise num_workers")  # fmt: skip
    if cfg.data.persistent_workers:
        _require(processes, "data.persistent_workers", "needs data.num_workers > 0")


def _check_device_and_backend(cfg: DictConfig) -> None:
    """A device and a process-group backend this machine has."""
    import torch.distributed as dist

    if cfg.device == "cuda":
        _require(
            cuda_device_count() > 0,
            "device",
            "cuda requested but no CUDA device is visible; use device=cpu or device=auto",
        )
    backend = cfg.backend.name
    if backend == "nccl":
        _require(
            cuda_device_count() > 0 and dist.is_nccl_available(),
            "backend",
            "nccl needs CUDA GPUs and a CUDA build of torch; none here. Use backend=gloo (or backend=auto)",
        )
        _require(
            resolve_device(cfg) == "cuda",
            "backend",
            "nccl communicates CUDA tensors; set device=cuda or device=auto",
        )
    if backend == "mpi":
        _require(
            dist.is_mpi_available(),
            "backend",
            "mpi is not built into this torch (the PyPI wheels leave it out); use backend=gloo or "
            "backend=nccl, or build torch from source against an MPI library",
        )
    if backend == "gloo":
        _require(
            dist.is_gloo_available(),
            "backend",
            "gloo is not built into this torch; use backend=nccl",
        )
    init = cfg.backend.init_method
    _require(
        init == "env" or init.startswith("tcp://") or init.startswith("file://"),
        "backend.init_method",
        f"got {init!r}; allowed: env, tcp://HOST:PORT, file:///PATH",
    )


def _check_world(cfg: DictConfig) -> None:
    """How many workers, against the strategy and the visible GPUs."""
    nproc = resolve_nproc(cfg)
    _require(
        nproc >= 1,
        "launch.nproc_per_node",
        "no CUDA device visible for one worker per GPU; set launch.nproc_per_node",
    )
    if cfg.parallel.name in ("none", "dp"):
        _require(
            nproc == 1,
            "launch.nproc_per_node",
            f"parallel={cfg.parallel.name} runs one process, got {nproc} workers; "
            "set launch.nproc_per_node=1 or choose parallel=ddp",
        )
    if resolve_device(cfg) == "cuda" and cfg.launch.nproc_per_node is not None:
        _require(
            nproc <= cuda_device_count(),
            "launch.nproc_per_node",
            f"got {nproc} workers but only {cuda_device_count()} GPUs are visible",
        )


def _check_model_and_data(cfg: DictConfig) -> None:
    """The model builds (on meta), trains on this data, and their shapes agree."""
    from framework.config.model import check_model

    check_model(cfg)
    data = cfg.data.name
    if data == "varlen":
        _require(1 <= cfg.data.min_len <= cfg.data.max_len, "data.min_len", "need 1 <= min_len <= max_len")
    else:
        _require(
            cfg.data.sampler == "distributed" and (not cfg.data.pack or data == "tokens"),
            "data.sampler" if cfg.data.sampler != "distributed" else "data.pack",
            "length grouping, token budgets and packing are for variable-length data: use data=varlen",
        )


def _check_batching(cfg: DictConfig) -> None:
    """Packing and per-rank batch sizes: where they apply."""
    if cfg.data.pack:
        _require(
            "doc_ids" in _forward_args(cfg),
            "data.pack",
            "packing needs a model whose forward takes doc_ids (attention within documents), as gpt's does",
        )
        _require(
            cfg.parallel.name != "dp",  # cp: the ring masks by document; pp: check_pipeline
            "data.pack",
            "not with parallel=dp (nn.DataParallel); use ddp",
        )
        _require(
            cfg.data.sampler == "distributed",
            "data.sampler",
            "packed blocks all have pack_len tokens: use sampler=distributed",
        )
    if cfg.data.rank_batch_sizes:
        sizes = list(cfg.data.rank_batch_sizes)
        _require(
            cfg.parallel.name in ("ddp", "fsdp") and len(sizes) == world_size_of(cfg) and min(sizes) >= 1,
            "data.rank_batch_sizes",
            f"one micro-batch size >= 1 per rank of parallel=ddp or fsdp ({world_size_of(cfg)} ranks), got {sizes}",
        )
        _require(
            cfg.data.sampler == "distributed",
            "data.sampler",
            "rank_batch_sizes makes its own batches: use sampler=distributed",
        )


def _forward_args(cfg: DictConfig) -> tuple[str, ...]:
    import inspect

    from framework.config.model import meta_model

    return tuple(inspect.signature(meta_model(cfg).forward).parameters)


def _check_paths(cfg: DictConfig) -> None:
    """Files and folders the run reads exist (images, text, a checkpoint to resume)."""
    data = cfg.data.name
    if data == "images" and cfg.data.source != "synthetic":
        from framework.data.images import check_image_root

        problem = check_image_root(cfg.data.source, cfg.data.root)
        _require(problem is None, "data.root", problem or "")
    if data == "text" and cfg.data.path is not None:
        _require(os.path.exists(cfg.data.path), "data.path", f"no file or folder at {cfg.data.path!r}")
    _check_tokenizer(cfg)
    if cfg.data.get("_target_"):  # the user's dataset builds here, once, where its error is one line
        from framework.data import user_data_problem

        _require((problem := user_data_problem(cfg.data)) is None, "data._target_", problem or "")
    if cfg.checkpoint.resume not in (None, "auto", "best"):
        _require(
            os.path.isdir(cfg.checkpoint.resume),
            "checkpoint.resume",
            f"no checkpoint folder at {cfg.checkpoint.resume!r} (or `auto`: the run's newest checkpoint, `best`: its best)",
        )


def _check_strategy(cfg: DictConfig) -> None:
    """Strategy-specific checks: degrees against the world size and the model's shape."""
    from framework.parallel.dims import DimsError, ParallelDims

    p = cfg.parallel
    if p.name == "dp":
        _require(
            resolve_device(cfg) == "cuda" and cuda_device_count() > 1,
            "parallel",
            "dp (torch.nn.DataParallel, one process driving several GPUs) needs more than one CUDA "
            f"device; device={cfg.device} with {cuda_device_count()} here. Use parallel=ddp, which is faster anyway",
        )
    if p.name not in ("fsdp", "tp", "pp", "hybrid", "cp"):
        return
    from framework.config.model import model_dims_of, resolve_sequence_parallel

    n_layer, n_head = model_dims_of(cfg)
    try:
        dims = ParallelDims.from_config(p, world_size_of(cfg), n_layer, n_head)
        note = resolve_sequence_parallel(cfg, dims.tp)  # auto -> a bool in cfg; said where it is off
        dims.check_run(cfg)
    except DimsError as err:
        raise ConfigError(err.key, str(err).split(": ", 1)[1]) from None
    from framework.config.model import check_pipeline, check_tensor_parallel

    _require(
        dims.cp == 1 or p.get("cp_impl", "ring") != "torch" or resolve_device(cfg) == "cuda",
        "parallel.cp_impl",
        "torch's context_parallel runs CUDA SDPA kernels only; on CPU use parallel.cp_impl=ring",
    )
    if dims.tp > 1:
        check_tensor_parallel(cfg)
    if dims.pp > 1:
        check_pipeline(cfg)
    if note and int(os.environ.get("RANK", 0)) == 0:  # once the layout is accepted: a refused one says only why
        print(note, flush=True)


def _check_val_split(cfg: DictConfig) -> None:
    """A validation split the data holds out, where evaluation reads one (its file, data.val_path)."""
    check_val_split(cfg.data, cfg.eval.every > 0 or cfg.eval.at_start)


def _check_eval(cfg: DictConfig) -> None:
    """Evaluation settings (the split they read: _check_val_split)."""
    e = cfg.eval
    _at_least(cfg, "eval.every", 0)
    _at_least(cfg, "eval.patience", 0)
    _require(e.steps == -1 or e.steps >= 1, "eval.steps", f"got {e.steps}; must be -1 (the whole split) or >= 1")
    _require(e.min_delta >= 0, "eval.min_delta", f"got {e.min_delta}; must be >= 0")
    for key, used in (("eval.patience", e.patience), ("checkpoint.monitor", cfg.checkpoint.monitor),
                      ("optimize", cfg.optimize == "val_loss")):  # fmt: skip
        _require(not used or e.every > 0, key, "needs evaluation during training: set eval.every=N (> 0)")


def _check_tokenizer(cfg: DictConfig) -> None:
    """Token shards, tokenizers and a pretrained model's vocabulary (framework.data.tokens)."""
    from framework.data.tokens import config_problem

    problem = config_problem(cfg)
    if problem is not None:
        raise ConfigError(*problem)
