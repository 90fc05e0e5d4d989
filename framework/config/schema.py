"""The config schema: one dataclass per config group choice, registered in Hydra's ConfigStore
under `schema/<group>` (outside the user-facing groups, so `--help` does not offer them as
choices). The YAML files of conf/ extend them (`defaults: [/schema/<group>@_here_: <name>, _self_]`),
so an unknown key or a value of the wrong type fails when Hydra composes the config. A group
whose choices differ has a base schema with what they share and one schema per choice holding only
its own keys (Hydra's "same config group" structured-config example), so `--cfg job` shows what
applies; code that reads a key some choice lacks reads it with `.get(key, default)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from framework.config.choices import (
    BackendName,
    Device,
    LoggerName,
    Monitor,
    Nonfinite,
    OnError,
    Optimize,
    PrecisionName,
    StartMethod,
    Verify,
    WandbMode,
)
from framework.config.data_schema import DATA_SCHEMAS
from framework.config.memory_schema import (
    BudgetMemoryConfig,
    CheckpointMemoryConfig,
    MemoryConfig,
    SelectiveMemoryConfig,
)
from framework.config.model_schema import (
    GPTConfig,
    HFConfig,
    LlamaConfig,
    LoraConfig,
    LSTMConfig,
    MLPConfig,
    ModelConfig,
    PeftConfig,
    ResNetConfig,
)
from framework.config.parallel_schema import (
    CPConfig,
    DDPConfig,
    FSDPConfig,
    HybridConfig,
    ParallelConfig,
    PPConfig,
    TPConfig,
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
    name: BackendName = BackendName.auto  # auto: nccl with CUDA, else gloo
    timeout_s: int = 600  # collective timeout of the process group (set-up and the first step)
    step_timeout_s: float | None = None  # after the first step, a shorter collective timeout (null: timeout_s)
    trace_buffer: int = 2000  # flight recorder: the last N collectives per rank, to name a hung one (0: off)
    init_method: str = "env"  # env (MASTER_ADDR/PORT from the launcher) | tcp://host:port | file:///path
    gloo_socket_ifname: str | None = None  # GLOO_SOCKET_IFNAME
    nccl: NCCLConfig = field(default_factory=NCCLConfig)


@dataclass
class PrecisionConfig:
    name: PrecisionName = PrecisionName.fp32  # amp: float16 autocast + GradScaler; bf16: bfloat16 autocast
    # CUDA: fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa; the MFU peak and
    # the planner follow). Under amp/bf16 it applies to the ops autocast leaves in fp32.
    tf32: bool = True


@dataclass
class AmpConfig(PrecisionConfig):
    name: PrecisionName = PrecisionName.amp
    init_scale: float = 65536.0  # GradScaler's starting loss scale
    growth_interval: int = 2000


@dataclass
class LoggerConfig:
    """tensorboard (event files under <run dir>/tensorboard) and none have nothing more."""

    name: LoggerName = MISSING


@dataclass
class WandbLoggerConfig(LoggerConfig):
    """wandb, and all (wandb and tensorboard): the W&B run's settings."""

    name: LoggerName = LoggerName.wandb
    project: str = "hydradist"
    entity: str | None = None
    mode: WandbMode = WandbMode.offline
    group: str | None = None  # null: in a multirun, the sweep directory's name
    run_name: str | None = None  # null: set by train.py (a sweep job: its overrides)
    tags: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- top level


@dataclass
class LaunchConfig:
    nproc_per_node: int | None = None  # null: 1 for parallel=none, else one per GPU (CPU: 2)
    max_restarts: int = 0
    master_port: int | None = None  # srun without torchrun: the rendezvous port (null: from the job id)
    monitor_interval_s: float = 0.1
    start_method: StartMethod = StartMethod.forkserver  # forkserver: workers fork from one that imported torch


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N optimizer steps (0: never); always saved at the end if > 0
    dir: str | None = None  # null: <run dir>/checkpoints
    resume: str | None = None  # a checkpoint folder to resume from, auto: this run's newest (if any), best: its best
    keep_last: int = 0  # keep only the newest K complete checkpoints (0: all)
    async_save: bool = False  # write the model and optimizer in a background thread (DCP async_save)
    preempt_grace_s: float = 25.0  # after SIGTERM/SIGINT: the time to end the step and save before exiting anyway
    export: bool = False  # at the end, the full model: <run dir>/hf (llama, hf: Hugging Face format), else model.pt
    verify: Verify = Verify.full  # what a resume checks against the manifest (framework/checkpoint/integrity.py)
    on_error: OnError = OnError.stop  # a failed save (a full disk) stops the run, or warns and retries next time
    monitor: Monitor | None = None  # val_loss: keep a complete checkpoint of the best evaluation (<root>/best)


@dataclass
class MetricsConfig:
    peak_tflops: float | None = None  # per-device peak for MFU; null: known GPUs only
    # the dense-matmul rate this device was measured to reach (benchmarks/gpu.sh's probe row): an
    # MFU above it cannot be true (a step timed before the device finished) and is flagged, not reported
    ceiling_tflops: float | None = None
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
    gpu: str | None = None  # plan for this GPU from its published figures (A100, H100, H200; any machine)
    gpu_power_w: float | None = None  # the GPUs' power limit, watts (null: the part's TDP); lower is slower
    search: bool = True  # python -m framework.plan: rank every layout (false: the configured one, its split)
    dry_run: bool = False  # python -m framework.plan: lay out the configured strategy on a fake world (no search)
    # the figures not given above: probe (the cache, else measured once and cached), cache (the
    # cache, else nominal), config (nominal: no probe, no cache, as ranks a launcher started use;
    # a plan, and so parallel=auto's pick, that no machine's speed or load can change); or a
    # rows.jsonl of benchmarks/gpu.sh: its probe row's matmul and copy rates refine the GPU's
    profile: str = "probe"


@dataclass
class EvalConfig:
    """Validation during training (framework/callbacks/evaluation.py) on the data group's validation split."""

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
    backend: BackendConfig = MISSING
    parallel: ParallelConfig = MISSING
    precision: PrecisionConfig = MISSING
    memory: MemoryConfig = MISSING
    peft: PeftConfig = MISSING
    # data and model stay untyped: a user's own data/<name>.yaml or model/<name>.yaml (on
    # hydra.searchpath) is a choice with keys of its own, which a typed group would refuse
    data: Any = MISSING
    model: Any = MISSING
    # components (framework/components.py): a class by `_target_` and its kwargs, checked against
    # the class's signature before any worker starts (a user's class takes keys of its own)
    optim: Any = MISSING
    schedule: Any = MISSING
    logger: LoggerConfig = MISSING
    seed: int = 1337
    steps: int = 100  # optimizer steps
    accumulation_steps: int = 1  # micro-batches per optimizer step
    device: Device = Device.auto
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
    nonfinite: Nonfinite = Nonfinite.stop  # a NaN/inf loss or gradient: stop (an error naming the step) or skip it
    # named callbacks, each a `_target_` class and its arguments (framework/callbacks, docs/callbacks.md)
    callbacks: dict[str, Any] = field(default_factory=dict)
    # model converters, each a `_target_` class with convert(model), applied in order (framework/converters)
    converters: dict[str, Any] = field(default_factory=dict)
    optimize: Optimize = Optimize.tokens_per_s  # the figure returned to a sweeper


# group -> {schema name: dataclass}, stored as `schema/<group>/<name>`; a group with one schema
# for all its choices names it `base`
GROUP_SCHEMAS: dict[str, dict[str, type]] = {
    "backend": {"base": BackendConfig},
    "parallel": {
        "base": ParallelConfig,
        "ddp": DDPConfig,
        "fsdp": FSDPConfig,
        "tp": TPConfig,
        "pp": PPConfig,
        "cp": CPConfig,
        "hybrid": HybridConfig,
    },
    "precision": {"base": PrecisionConfig, "amp": AmpConfig},
    "memory": {
        "base": MemoryConfig,
        "checkpoint": CheckpointMemoryConfig,
        "selective": SelectiveMemoryConfig,
        "budget": BudgetMemoryConfig,
    },  # fmt: skip
    "peft": {"base": PeftConfig, "lora": LoraConfig},
    "data": DATA_SCHEMAS,
    "model": {
        "base": ModelConfig,
        "gpt": GPTConfig,
        "llama": LlamaConfig,
        "mlp": MLPConfig,
        "resnet": ResNetConfig,
        "lstm": LSTMConfig,
        "hf": HFConfig,
    },
    "logger": {"base": LoggerConfig, "wandb": WandbLoggerConfig, "all": WandbLoggerConfig},
}


def group_schema(group: str, choice: str) -> type:
    """The schema a choice's YAML extends: its own, else the group's base."""
    schemas = GROUP_SCHEMAS[group]
    return schemas.get(choice, schemas.get("base"))


def register_configs() -> None:
    """Put every schema into Hydra's ConfigStore, once per process (each compose asks)."""
    cs = ConfigStore.instance()
    if cs.repo.get("base_config.yaml") is not None:
        return
    cs.store(name="base_config", node=Config)
    for group, schemas in GROUP_SCHEMAS.items():
        for name, node in schemas.items():
            cs.store(group=f"schema/{group}", name=name, node=node)
