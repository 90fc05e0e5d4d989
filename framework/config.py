"""Config schemas and validation.

Every config group has a dataclass schema registered in Hydra's ConfigStore as ``base_<name>``;
the YAML files of ``conf/`` extend them (``defaults: [base_x, _self_]``), so an unknown key or a
value of the wrong type fails when Hydra composes the config, before anything runs.

``validate(cfg)`` then checks what a schema cannot: value ranges and combinations (a strategy that
does not fit the model, a backend this machine lacks, ...). It raises ``ConfigError`` naming the
key and the allowed values, and runs in the launching process, before any worker starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig


class ConfigError(ValueError):
    """A configuration that cannot run. ``key`` is the dotted config key at fault."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


# ----------------------------------------------------------------------------- groups


@dataclass
class NCCLConfig:
    """NCCL tuning knobs, exported to every worker as NCCL_<NAME> before the process group starts.
    null: left unset (NCCL's own choice)."""

    algo: str | None = None  # Tree | Ring | CollnetDirect | NVLS ... (NCCL_ALGO)
    proto: str | None = None  # LL | LL128 | Simple
    socket_ifname: str | None = None  # e.g. eth0: the interface for bootstrap and socket traffic
    ib_disable: int | None = None  # 1: no InfiniBand, use sockets
    p2p_disable: int | None = None  # 1: no NVLink/PCIe peer-to-peer
    cross_nic: int | None = None
    nthreads: int | None = None
    buffsize: int | None = None
    min_nchannels: int | None = None
    max_nchannels: int | None = None
    debug: str | None = None  # WARN | INFO | TRACE
    debug_subsys: str | None = None  # e.g. INIT,COLL


@dataclass
class BackendConfig:
    name: str = "auto"  # auto | gloo | nccl | mpi (auto: nccl with CUDA, else gloo)
    timeout_s: int = 600  # collective timeout of the process group
    init_method: str = "env"  # env (MASTER_ADDR/PORT from the launcher) | tcp://host:port | file:///path
    gloo_socket_ifname: str | None = None  # GLOO_SOCKET_IFNAME
    nccl: NCCLConfig = field(default_factory=NCCLConfig)


def backend_env(cfg: DictConfig) -> dict[str, str]:
    """Environment variables the `backend` group sets (unset knobs stay unset)."""
    env = {f"NCCL_{k.upper()}": str(v) for k, v in cfg.nccl.items() if v is not None}
    if cfg.gloo_socket_ifname is not None:
        env["GLOO_SOCKET_IFNAME"] = cfg.gloo_socket_ifname
    return env


@dataclass
class ParallelConfig:
    name: str = "ddp"  # none | dp | ddp | fsdp | tp | pp | hybrid
    # Degrees of the mesh pp x dp_replicate x dp_shard x tp (fsdp, tp, pp, hybrid).
    # -1: the ranks left over; 0 (tp, pp): auto, 2-way where the world and the model allow.
    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    # DDP (torch.nn.parallel.DistributedDataParallel)
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    comm_hook: str = "none"  # none | fp16 | bf16 | powersgd
    powersgd_rank: int = 1
    # FSDP
    version: int = 2  # 2: fully_shard (FSDP2); 1: FullyShardedDataParallel (FSDP1)
    reshard_after_forward: bool = True  # True: FULL_SHARD (ZeRO-3); False: SHARD_GRAD_OP (ZeRO-2)
    reduce_dtype: str = "fp32"  # gradient reduction dtype under bf16/amp: fp32 | bf16
    sync_every_microbatch: bool = False  # accumulation: reduce-scatter every micro-batch (less memory)
    sharding_strategy: str = "FULL_SHARD"  # FSDP1: FULL_SHARD | SHARD_GRAD_OP | HYBRID_SHARD | NO_SHARD
    # tensor parallel
    sequence_parallel: bool = True
    loss_parallel: bool = False
    # pipeline parallel
    schedule: str = "1F1B"  # GPipe | 1F1B | Interleaved1F1B | InterleavedZeroBubble | ZBVZeroBubble
    n_microbatches: int = 4
    stages_per_rank: int = 0  # 0: auto (1 for GPipe/1F1B, 2 for interleaved and V schedules)


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32 | amp (float16 autocast + GradScaler) | bf16 (bfloat16 autocast)
    init_scale: float = 65536.0  # GradScaler's starting loss scale (amp only)
    growth_interval: int = 2000


@dataclass
class MemoryConfig:
    name: str = "none"  # none | checkpoint
    checkpoint_every: int = 1  # checkpoint every k-th transformer block (1: all of them)
    empty_cache_every: int = 0  # release the accelerator's cached blocks every N steps (0: never)
    cpu_offload: bool = False  # FSDP: keep sharded parameters, gradients and optimizer state in CPU memory


@dataclass
class LoaderFields:
    name: str = MISSING
    batch_size: int = 8  # micro-batch of ONE data-parallel rank
    num_workers: int = 0
    pin_memory: bool = False
    persistent_workers: bool = False
    prefetch_factor: int | None = None  # only with num_workers > 0 (torch's default: 2)
    drop_last: bool = True
    shuffle: bool = True
    sampler: str = "distributed"  # distributed | length_grouped | token_budget (varlen)
    max_tokens: int = 4096  # token_budget: padded tokens per rank per micro-batch
    rank_batch_sizes: list[int] | None = None  # per data-parallel rank micro-batch sizes (by capability)
    pack: bool = False  # varlen + gpt: concatenate sequences into blocks of pack_len, no padding
    pack_len: int = 128


@dataclass
class TextDataConfig(LoaderFields):
    name: str = "text"
    path: str | None = None  # file or folder of text; null: this Python's standard library source
    seq_len: int = 128
    max_bytes: int = 4_000_000  # read at most this many bytes of the corpus
    val_fraction: float = 0.0


@dataclass
class ImagesDataConfig(LoaderFields):
    name: str = "images"
    num_samples: int = 2048
    image_size: int = 32
    channels: int = 3
    num_classes: int = 10
    noise: float = 1.0  # synthetic only
    source: str = "synthetic"  # synthetic | folder (torchvision ImageFolder) | cifar10 (local, never downloaded)
    root: str | None = None  # folder or CIFAR-10 root
    transforms_on: str = "device"  # device: batched augmentation on the training device | loader: per sample in workers
    augment: bool = True  # random crop (4-pixel padding) and horizontal flip


@dataclass
class VectorsDataConfig(LoaderFields):
    name: str = "vectors"
    num_samples: int = 4096
    dim: int = 32
    num_classes: int = 8


@dataclass
class VarlenDataConfig(LoaderFields):
    name: str = "varlen"
    num_samples: int = 4096
    vocab_size: int = 32
    num_classes: int = 4
    min_len: int = 4
    max_len: int = 128
    mean_len: float = 24.0  # long-tailed (log-normal) lengths around this mean
    source: str = "synthetic"  # synthetic | text (paragraphs of the text corpus)
    path: str | None = None  # source=text: a file or folder of text; null: the stdlib source
    seq_len: int = 128  # the longest input a model sees (max_len, or pack_len when packing)


@dataclass
class GPTConfig:
    name: str = "gpt"
    vocab_size: int = 256
    block_size: int = 128  # longest sequence the model accepts
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False


@dataclass
class MLPConfig:
    name: str = "mlp"
    in_dim: int = 32
    hidden: int = 256
    depth: int = 3
    num_classes: int = 8
    dropout: float = 0.0


@dataclass
class ResNetConfig:
    name: str = "resnet"
    arch: str = "resnet18"  # any torchvision.models resnet builder name
    num_classes: int = 10
    small_input: bool = True  # 3x3 stem without max-pool, for 32x32 images


@dataclass
class LSTMConfig:
    name: str = "lstm"
    vocab_size: int = 32
    embed_dim: int = 64
    hidden: int = 128
    num_layers: int = 1
    num_classes: int = 4
    bidirectional: bool = False


@dataclass
class OptimConfig:
    name: str = "adamw"  # adamw | sgd
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    momentum: float = 0.9  # sgd only
    grad_clip: float = 1.0  # max global gradient norm (0: no clipping)
    schedule: str = "cosine"  # cosine | constant
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1


@dataclass
class LoggerConfig:
    name: str = "wandb"  # wandb | tensorboard | all (wandb and tensorboard) | none
    project: str = "hydradist"  # W&B
    entity: str | None = None
    mode: str = "offline"  # W&B: offline | online | disabled
    group: str | None = None  # W&B group; null: in a multirun, the sweep directory's name
    run_name: str | None = None  # null: set by train.py (a sweep job: its overrides)
    tags: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- top level


@dataclass
class LaunchConfig:
    nproc_per_node: int | None = None  # null: 1 for parallel=none, else one per GPU (CPU: 2)
    max_restarts: int = 0
    master_port: int | None = None  # srun without torchrun: the rendezvous port (null: from the job id)
    monitor_interval_s: float = 0.1
    start_method: str = "spawn"


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N optimizer steps (0: never); always saved at the end if > 0
    dir: str | None = None  # null: <run dir>/checkpoints
    resume: str | None = None  # a checkpoint folder to resume from
    export: bool = False  # at the end, write the full (unsharded) model state to <run dir>/model.pt


@dataclass
class MetricsConfig:
    peak_tflops: float | None = None  # per-device peak for MFU; null: known GPUs only
    log_every: int = 1
    sample_every: int = 50  # measure memory and communication on the 3rd step and every N (0: off)


@dataclass
class ProfilerConfig:
    """profile=true: which steps torch.profiler traces (after `wait` steps, `warmup` traced and
    discarded, then `active` recorded), and what it records."""

    wait: int = 2
    warmup: int = 1
    active: int = 2
    with_stack: bool = True  # Python stacks on every event
    memory: bool = False  # CUDA: also the allocator's history, for the memory visualiser


@dataclass
class SweepConfig:
    skip_done: bool = False  # a rerun of a multirun skips the jobs whose summary says ok


@dataclass
class Config:
    backend: Any = MISSING
    parallel: Any = MISSING
    precision: Any = MISSING
    memory: Any = MISSING
    data: Any = MISSING
    model: Any = MISSING
    optim: Any = MISSING
    logger: Any = MISSING
    seed: int = 1337
    steps: int = 100  # optimizer steps
    accumulation_steps: int = 1  # micro-batches per optimizer step
    device: str = "auto"  # auto | cpu | cuda
    progress: bool = True  # progress bar on rank 0
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    compile: bool = False  # torch.compile each transformer block (small models: the whole model)
    profile: bool = False  # a torch.profiler trace per rank under <run dir>/profile (see `profiler`)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    optimize: str = "tokens_per_s"  # what the task returns to a sweeper: tokens_per_s | samples_per_s | final_loss


GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "backend": {"base_backend": BackendConfig},
    "parallel": {"base_parallel": ParallelConfig},
    "precision": {"base_precision": PrecisionConfig},
    "memory": {"base_memory": MemoryConfig},
    "data": {
        "base_text": TextDataConfig,
        "base_images": ImagesDataConfig,
        "base_vectors": VectorsDataConfig,
        "base_varlen": VarlenDataConfig,
    },
    "model": {
        "base_gpt": GPTConfig,
        "base_mlp": MLPConfig,
        "base_resnet": ResNetConfig,
        "base_lstm": LSTMConfig,
    },
    "optim": {"base_optim": OptimConfig},
    "logger": {"base_logger": LoggerConfig},
}


def register_configs() -> None:
    """Put every schema into Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, schemas in GROUP_SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=group, name=name, node=node)


# ----------------------------------------------------------------------------- validation

ALLOWED = {
    "backend.name": ("auto", "gloo", "nccl", "mpi"),
    "parallel.name": ("none", "dp", "ddp", "fsdp", "tp", "pp", "hybrid"),
    "parallel.version": (1, 2),
    "parallel.reduce_dtype": ("fp32", "bf16"),
    "parallel.sharding_strategy": ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"),
    "parallel.schedule": (
        "GPipe",
        "1F1B",
        "Interleaved1F1B",
        "InterleavedZeroBubble",
        "ZBVZeroBubble",
    ),
    "parallel.comm_hook": ("none", "fp16", "bf16", "powersgd"),
    "precision.name": ("fp32", "amp", "bf16"),
    "memory.name": ("none", "checkpoint", "offload"),
    "optim.name": ("adamw", "sgd"),
    "optim.schedule": ("cosine", "constant"),
    "logger.name": ("wandb", "tensorboard", "all", "none"),
    "optimize": ("tokens_per_s", "samples_per_s", "final_loss"),
    "logger.mode": ("offline", "online", "disabled"),
    "device": ("auto", "cpu", "cuda"),
    "data.sampler": ("distributed", "length_grouped", "token_budget"),
    "launch.start_method": ("spawn", "fork", "forkserver"),
}

# Which data each model can train on: (model, data) pairs that make a task.
MODEL_DATA = {
    "gpt": ("text", "varlen"),
    "mlp": ("vectors",),
    "resnet": ("images",),
    "lstm": ("varlen",),
}


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


def resolve_device(cfg: DictConfig) -> str:
    import torch

    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def resolve_backend(cfg: DictConfig) -> str:
    return {"cpu": "gloo", "cuda": "nccl"}[resolve_device(cfg)] if cfg.backend.name == "auto" else cfg.backend.name


def resolve_nproc(cfg: DictConfig) -> int:
    """Local worker processes to start: explicit, else 1 for parallel=none, else per GPU (CPU: 2)."""
    import torch

    if cfg.launch.nproc_per_node is not None:
        return cfg.launch.nproc_per_node
    if cfg.parallel.name == "none":
        return 1
    if resolve_device(cfg) == "cuda":
        return torch.cuda.device_count()
    return 2


def validate(cfg: DictConfig) -> None:
    """Raise ConfigError for the first setting that cannot run. Called before any worker starts."""
    import torch
    import torch.distributed as dist

    for key, allowed in ALLOWED.items():
        value = _get(cfg, key)
        _require(value in allowed, key, f"got {value!r}; allowed: {', '.join(map(str, allowed))}")

    _at_least(cfg, "steps", 1)
    _at_least(cfg, "accumulation_steps", 1)
    _at_least(cfg, "data.batch_size", 1)
    _at_least(cfg, "data.num_workers", 0)
    _at_least(cfg, "backend.timeout_s", 1)
    _at_least(cfg, "launch.max_restarts", 0)
    _at_least(cfg, "checkpoint.every", 0)
    _at_least(cfg, "metrics.log_every", 1)
    _at_least(cfg, "metrics.sample_every", 0)
    _at_least(cfg, "memory.checkpoint_every", 1)
    _at_least(cfg, "memory.empty_cache_every", 0)
    if cfg.profile:
        for key in ("wait", "warmup", "active"):
            _at_least(cfg, f"profiler.{key}", 1 if key == "active" else 0)
        window = cfg.profiler.wait + cfg.profiler.warmup + cfg.profiler.active
        _require(
            cfg.steps >= window,
            "profiler",
            f"profile=true traces steps {cfg.profiler.wait + cfg.profiler.warmup + 1}..{window} "
            f"(wait + warmup + active) but the run has steps={cfg.steps}; lower profiler.wait/active or raise steps",
        )
    if cfg.launch.nproc_per_node is not None:
        _at_least(cfg, "launch.nproc_per_node", 1)
    _require(cfg.optim.lr > 0, "optim.lr", f"got {cfg.optim.lr}; must be > 0")
    if cfg.data.prefetch_factor is not None:
        _require(
            cfg.data.num_workers > 0,
            "data.prefetch_factor",
            "only applies with data.num_workers > 0; set it to null or raise num_workers",
        )
    if cfg.data.persistent_workers:
        _require(
            cfg.data.num_workers > 0,
            "data.persistent_workers",
            "needs data.num_workers > 0",
        )

    # device and backend this machine can run
    if cfg.device == "cuda":
        _require(
            torch.cuda.is_available(),
            "device",
            "cuda requested but no CUDA device is visible; use device=cpu or device=auto",
        )
    backend = cfg.backend.name
    if backend == "nccl":
        _require(
            torch.cuda.is_available() and dist.is_nccl_available(),
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

    # world size and strategy
    model = cfg.model.name
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
            nproc <= torch.cuda.device_count(),
            "launch.nproc_per_node",
            f"got {nproc} workers but only {torch.cuda.device_count()} GPUs are visible",
        )

    _validate_strategy(cfg, nproc)
    if cfg.memory.cpu_offload:
        _require(
            cfg.parallel.name in ("fsdp", "hybrid"),
            "memory.cpu_offload",
            f"CPU offload is an FSDP feature; got parallel={cfg.parallel.name}. Use parallel=fsdp",
        )
        _require(
            resolve_device(cfg) == "cuda",
            "memory.cpu_offload",
            "FSDP CPU offload moves shards between GPU and CPU memory and needs CUDA; none here. "
            "Use memory=none or memory=checkpoint",
        )
    if cfg.memory.name == "checkpoint":
        _require(
            model != "lstm",
            "memory",
            "checkpointing wraps a model's blocks; lstm has none. Use memory=none",
        )

    # model and data fit together
    data = cfg.data.name
    _require(model in MODEL_DATA, "model", f"got {model!r}; allowed: {', '.join(MODEL_DATA)}")
    _require(
        data in MODEL_DATA[model],
        "data",
        f"model={model} trains on data={'|'.join(MODEL_DATA[model])}, got data={data}; "
        f"add data={MODEL_DATA[model][0]} (or use experiment={model})",
    )
    if model == "gpt":
        _require(
            cfg.model.n_embd % cfg.model.n_head == 0,
            "model.n_head",
            f"n_embd={cfg.model.n_embd} must divide evenly into n_head={cfg.model.n_head} heads",
        )
        _require(
            cfg.data.seq_len <= cfg.model.block_size,
            "data.seq_len",
            f"got {cfg.data.seq_len}; must be <= model.block_size={cfg.model.block_size}",
        )
        _require(cfg.data.seq_len >= 2, "data.seq_len", "must be >= 2")
    if model == "lstm":
        _require(
            cfg.data.vocab_size <= cfg.model.vocab_size,
            "model.vocab_size",
            f"got {cfg.model.vocab_size}; must be >= data.vocab_size={cfg.data.vocab_size}",
        )
    if data == "varlen":
        _require(1 <= cfg.data.min_len <= cfg.data.max_len, "data.min_len", "need 1 <= min_len <= max_len")
        _require(
            cfg.data.source in ("synthetic", "text"),
            "data.source",
            f"got {cfg.data.source!r}; allowed: synthetic, text",
        )
        if model == "gpt":
            _require(cfg.data.min_len >= 2, "data.min_len", "language modelling needs sequences of >= 2 tokens")
            longest = cfg.data.pack_len if cfg.data.pack else cfg.data.max_len - 1
            _require(
                longest <= cfg.model.block_size,
                "model.block_size",
                f"got {cfg.model.block_size}; the longest input is {longest} tokens",
            )
    else:
        _require(
            cfg.data.sampler == "distributed" and not cfg.data.pack,
            "data.sampler" if cfg.data.sampler != "distributed" else "data.pack",
            "length grouping, token budgets and packing are for variable-length data: use data=varlen",
        )
    if cfg.data.pack:
        _require(
            model == "gpt",
            "data.pack",
            "packing keeps attention within documents in gpt only; lstm packs with pack_padded_sequence",
        )
        _require(
            cfg.parallel.name in ("none", "ddp", "fsdp"),
            "data.pack",
            f"not with parallel={cfg.parallel.name}; use none, ddp or fsdp",
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
    if data == "images":
        _require(
            cfg.data.source in ("synthetic", "folder", "cifar10"),
            "data.source",
            f"got {cfg.data.source!r}; allowed: synthetic, folder, cifar10",
        )
        _require(
            cfg.data.transforms_on in ("device", "loader"),
            "data.transforms_on",
            f"got {cfg.data.transforms_on!r}; allowed: device, loader",
        )
        if cfg.data.source != "synthetic":
            from framework.data.images import check_image_root

            problem = check_image_root(cfg.data.source, cfg.data.root)
            _require(problem is None, "data.root", problem or "")
    if data == "text" and cfg.data.path is not None:
        import os

        _require(os.path.exists(cfg.data.path), "data.path", f"no file or folder at {cfg.data.path!r}")
    if cfg.checkpoint.resume is not None:
        import os

        _require(
            os.path.isdir(cfg.checkpoint.resume),
            "checkpoint.resume",
            f"no checkpoint folder at {cfg.checkpoint.resume!r}",
        )


def world_size_of(cfg: DictConfig) -> int:
    """The world the run will have: the launcher's (torchrun sets WORLD_SIZE) or ours."""
    import os

    from framework.dist import launched_as_worker

    if launched_as_worker():
        return int(os.environ["WORLD_SIZE"])
    return resolve_nproc(cfg)


def _validate_strategy(cfg: DictConfig, nproc: int) -> None:
    """Strategy-specific checks: degrees against the world size and the model's shape."""
    import torch

    from framework.parallel.dims import DimsError, ParallelDims
    from framework.parallel.pipeline import stages_per_rank

    p, model = cfg.parallel, cfg.model.name
    if p.name == "dp":
        _require(
            torch.cuda.is_available() and torch.cuda.device_count() > 1,
            "parallel",
            "dp (torch.nn.DataParallel, one process driving several GPUs) needs more than one CUDA "
            "device; none here. Use parallel=ddp, which is faster anyway",
        )
    if p.name in ("tp", "pp", "hybrid"):
        _require(
            model == "gpt",
            "parallel",
            f"parallel={p.name} splits transformer blocks and heads: model=gpt only, got model={model}",
        )
    if p.name not in ("fsdp", "tp", "pp", "hybrid"):
        return
    n_layer, n_head = (cfg.model.n_layer, cfg.model.n_head) if model == "gpt" else (None, None)
    try:
        dims = ParallelDims.from_config(p, world_size_of(cfg), n_layer, n_head)
    except DimsError as err:
        raise ConfigError(err.key, str(err).split(": ", 1)[1]) from None
    if p.version == 1:
        _require(
            dims.tp == 1 and dims.pp == 1,
            "parallel.version",
            "FSDP1 (version=1) shards data-parallel only; use version=2 with tp or pp",
        )
        hybrid = p.sharding_strategy == "HYBRID_SHARD"
        _require(
            hybrid == (dims.dp_replicate > 1),
            "parallel.sharding_strategy",
            "HYBRID_SHARD needs parallel.dp_replicate > 1 (replicas of shard groups) and the other strategies dp_replicate=1",
        )
    if dims.pp > 1:
        _require(
            cfg.precision.name != "amp",
            "precision",
            "amp (float16 loss scaling) is not supported with pipeline parallel; use precision=bf16",
        )
        local_batch = cfg.data.batch_size * cfg.accumulation_steps
        _require(
            local_batch % p.n_microbatches == 0,
            "parallel.n_microbatches",
            f"must divide the local batch data.batch_size x accumulation_steps = {local_batch}",
        )
        stages = dims.pp * stages_per_rank(p)
        _require(
            p.n_microbatches >= stages or p.schedule in ("GPipe", "1F1B"),
            "parallel.n_microbatches",
            f"the {p.schedule} schedule needs at least as many micro-batches as stages ({stages})",
        )
    if dims.tp > 1 and p.sequence_parallel:
        _require(
            cfg.data.seq_len % dims.tp == 0,
            "data.seq_len",
            f"sequence parallel splits sequences over tp={dims.tp} ranks; {cfg.data.seq_len} does not divide",
        )
