"""The config schema: one dataclass per config group choice, registered in Hydra's ConfigStore
under `schema/<group>` (outside the user-facing groups, so `--help` does not offer them as
choices). The YAML files of conf/ extend them (`defaults: [/schema/<group>@_here_: <name>, _self_]`),
so an unknown key or a value of the wrong type fails when Hydra composes the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from framework.config.model_schema import (
    GPTConfig,
    HFConfig,
    LlamaConfig,
    LSTMConfig,
    MLPConfig,
    ModelConfig,
    ResNetConfig,
)

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
    timeout_s: int = 600  # collective timeout of the process group (set-up and the first step)
    step_timeout_s: float | None = None  # after the first step, a shorter collective timeout (null: timeout_s)
    trace_buffer: int = 2000  # flight recorder: the last N collectives per rank, to name a hung one (0: off)
    init_method: str = "env"  # env (MASTER_ADDR/PORT from the launcher) | tcp://host:port | file:///path
    gloo_socket_ifname: str | None = None  # GLOO_SOCKET_IFNAME
    nccl: NCCLConfig = field(default_factory=NCCLConfig)


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
    # context parallel: each sequence split over cp ranks (zigzag), attention by a ring of sends
    cp: int = 1
    cp_impl: str = "ring"  # ring (ours: any device, gloo or NCCL) | torch (torch's context_parallel, CUDA only)


@dataclass
class PrecisionConfig:
    name: str = "fp32"  # fp32 | amp (float16 autocast + GradScaler) | bf16 (bfloat16 autocast)
    init_scale: float = 65536.0  # GradScaler's starting loss scale (amp only)
    growth_interval: int = 2000
    # CUDA: fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa; the MFU peak and
    # the planner follow). Under amp/bf16 it applies to the ops autocast leaves in fp32.
    tf32: bool = True


@dataclass
class MemoryConfig:
    name: str = "none"  # none | checkpoint
    checkpoint_every: int = 1  # checkpoint every k-th transformer block (1: all of them)
    empty_cache_every: int = 0  # release the accelerator's cached blocks every N steps (0: never)
    cpu_offload: bool = False  # FSDP: keep sharded parameters, gradients and optimizer state in CPU memory
    # glibc malloc policy (framework.memory.set_host_allocator): lean | steady | glibc | auto (lean
    # under fsdp and hybrid, steady elsewhere)
    host_allocator: str = "auto"


@dataclass
class LoaderFields:
    name: str = MISSING
    batch_size: int = 8  # micro-batch of ONE data-parallel rank
    # auto: on CUDA, a few loader processes (min(4, cores per GPU - 1)) and pinned memory; on a
    # CPU neither (the ranks share the cores with training): framework.data.loader_settings
    num_workers: Any = "auto"  # auto | an int >= 0
    pin_memory: Any = "auto"  # auto | true | false (true: CUDA only)
    persistent_workers: bool = False
    prefetch_factor: int | None = None  # only with num_workers > 0 (torch's default: 2)
    drop_last: bool = True
    shuffle: bool = True
    sampler: str = "distributed"  # distributed | length_grouped | token_budget (varlen)
    max_tokens: int = 4096  # token_budget: padded tokens per rank per micro-batch
    rank_batch_sizes: list[int] | None = None  # per data-parallel rank micro-batch sizes (by capability)
    pack: bool = False  # varlen + gpt: concatenate sequences into blocks of pack_len, no padding
    pack_len: int = 128
    val_fraction: float = 0.0  # held out for validation: text, the corpus' tail; else samples/documents (seeded)
    val_path: str | None = None  # text: a separate file or folder to validate on (instead of val_fraction)


@dataclass
class TextDataConfig(LoaderFields):
    name: str = "text"
    path: str | None = None  # file or folder of text; null: this Python's standard library source
    seq_len: int = 128
    max_bytes: int = 4_000_000  # read at most this many bytes of the corpus
    tokenizer: str = "bytes"  # bytes (ids 0..255) | <path to a tokenizer.json> (bpe: prepare shards, data=tokens)


@dataclass
class TokensDataConfig(LoaderFields):
    """Token shards written by `python -m framework.data.prepare` (memory-mapped, never read whole)."""

    name: str = "tokens"
    path: str = MISSING  # the shards' folder (index.json + shard-*.bin)
    seq_len: int = 128
    split: str = "train"  # train | val (the shards prepare --val-fraction set aside)
    tokenizer: str | None = None  # null: the shards' own; else checked against it (bytes | bpe | a tokenizer.json)


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
class CustomDataConfig(LoaderFields):
    """data=custom: your own map-style Dataset by `_target_`; the keys beside it are its arguments."""

    name: str = "custom"
    _target_: str = MISSING  # a Dataset class or factory, e.g. pkg.module.MyDataset
    seq_len: int | None = None  # lm data: tokens per sample, where the model checks its block size


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
    schedule_steps: int | None = None  # the LR schedule's length (null: steps; a resumed run keeps its own)


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
    resume: str | None = None  # a checkpoint folder to resume from, auto: this run's newest (if any), best: its best
    keep_last: int = 0  # keep only the newest K complete checkpoints (0: all)
    async_save: bool = False  # write the model and optimizer in a background thread (DCP async_save)
    preempt_grace_s: float = 25.0  # after SIGTERM/SIGINT: the time to end the step and save before exiting anyway
    export: bool = False  # at the end, the full model: <run dir>/hf (llama, hf: Hugging Face format), else model.pt
    verify: str = "full"  # full | size | off: what a resume checks against the manifest (framework/integrity.py)
    on_error: str = "stop"  # stop | warn: a failed save (a full disk) stops the run, or warns and retries next time
    monitor: str | None = None  # val_loss: keep a complete checkpoint of the best evaluation (<root>/best)


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
class PlanConfig:
    """The planner (framework/plan): `python -m framework.plan`, `parallel=auto`, and every run's
    check of its prediction. Null figures are probed once and cached (CPU: a matmul and a gloo
    all-reduce), or nominal under a launcher."""

    world_size: int | None = None  # python -m framework.plan: plan for this many ranks (null: the run's)
    memory_budget_mb: float | None = None  # per rank; null: the device's memory (CPU: RAM / local ranks)
    peak_tflops: float | None = None  # per device; null: metrics.peak_tflops, a known GPU, or the CPU probe
    intra_node_gbps: float | None = None  # collective bandwidth within a node, GB/s; null: probed
    inter_node_gbps: float | None = None  # across nodes; null: as within
    latency_us: float | None = None  # per collective call; null: probed
    overlap: float | None = None  # share of compute that hides data-parallel traffic; null: 0 CPU, 0.8 CUDA
    op_overhead_us: float | None = None  # dispatch cost per operator; null: probed (CPU) or nominal
    nodes: int = 1  # nodes the world spans (groups wider than a node use inter_node_gbps)
    auto: Any = None  # set by parallel=auto: the layout it chose and why (read by the run)


@dataclass
class EvalConfig:
    """Validation during training (framework/evaluation.py) on the data group's validation split."""

    every: int = 0  # evaluate every N optimizer steps (0: never); when on, also once at the end
    steps: int = -1  # batches per evaluation per data-parallel rank (-1: the whole validation split)
    at_start: bool = False  # also evaluate the initial weights, before the first step (step 0)
    patience: int = 0  # early stopping: stop after K evaluations without improvement (0: off)
    min_delta: float = 0.0  # an improvement lowers the best val_loss by more than this


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
    plan: PlanConfig = field(default_factory=PlanConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    compile: bool = False  # torch.compile each transformer block (small models: the whole model)
    profile: bool = False  # a torch.profiler trace per rank under <run dir>/profile (see `profiler`)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    nonfinite: str = "stop"  # a NaN/inf loss or gradient: stop (an error naming the step) | skip (not applied, counted)
    optimize: str = "tokens_per_s"  # returned to a sweeper: tokens_per_s | samples_per_s | final_loss | val_loss


# group -> {schema name: dataclass}, stored as `schema/<group>/<name>`; a group with one schema
# for all its choices names it `base`
GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "backend": {"base": BackendConfig},
    "parallel": {"base": ParallelConfig},
    "precision": {"base": PrecisionConfig},
    "memory": {"base": MemoryConfig},
    "data": {
        "text": TextDataConfig,
        "images": ImagesDataConfig,
        "vectors": VectorsDataConfig,
        "varlen": VarlenDataConfig,
        "custom": CustomDataConfig,
        "tokens": TokensDataConfig,
    },
    "model": {
        "base": ModelConfig,
        "gpt": GPTConfig,
        "llama": LlamaConfig,
        "mlp": MLPConfig,
        "resnet": ResNetConfig,
        "lstm": LSTMConfig,
        "hf": HFConfig,
    },
    "optim": {"base": OptimConfig},
    "logger": {"base": LoggerConfig},
}


def register_configs() -> None:
    """Put every schema into Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, schemas in GROUP_SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
