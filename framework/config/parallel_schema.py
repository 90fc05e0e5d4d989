"""The `parallel` group's schemas: `ParallelConfig` (what every choice has), DDP's knobs, and the
strategies on a device mesh, each with its own knobs on top of the mesh's degrees."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from framework.config.choices import CommHook, CpImpl, ParallelName, ReduceDtype, Schedule, ShardingStrategy

__all__ = [
    "CPConfig",
    "DDPConfig",
    "FSDPConfig",
    "HybridConfig",
    "MeshConfig",
    "PPConfig",
    "ParallelConfig",
    "TPConfig",
]


@dataclass
class ParallelConfig:
    """What every `parallel` choice has; none, dp and auto have nothing more."""

    name: ParallelName = MISSING
    # BatchNorm over every data-parallel rank's micro-batch (one process's statistics); false:
    # each rank's own (torch's default, one all-reduce fewer per layer and direction)
    sync_batchnorm: bool = True


@dataclass
class DDPConfig(ParallelConfig):
    """torch.nn.parallel.DistributedDataParallel."""

    name: ParallelName = ParallelName.ddp
    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False
    broadcast_buffers: bool = True
    comm_hook: CommHook = CommHook.none
    powersgd_rank: int = 1


@dataclass
class MeshConfig(ParallelConfig):
    """The strategies on a device mesh (fsdp, tp, pp, cp, hybrid): the degrees of its axes
    pp x dp_replicate x dp_shard x cp x tp. -1: the ranks left over; 0 (tp, pp): auto, 2-way where
    the world and the model allow. Any choice may widen another axis (`parallel=fsdp
    parallel.tp=2`); that axis' knobs then take their defaults (the values below)."""

    dp_replicate: int = 1
    dp_shard: int = -1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: each sequence split over cp ranks (zigzag), attention by a ring of sends
    ep: int = 1  # expert parallel: a mixture of experts' routed experts split over ep of the dp_shard ranks


@dataclass
class FSDPConfig(MeshConfig):
    name: ParallelName = ParallelName.fsdp
    version: int = 2  # 2: fully_shard (FSDP2); 1: FullyShardedDataParallel (FSDP1)
    reshard_after_forward: bool = True  # True: FULL_SHARD (ZeRO-3); False: SHARD_GRAD_OP (ZeRO-2)
    reduce_dtype: ReduceDtype = ReduceDtype.fp32  # gradient reduction dtype under bf16/amp
    sync_every_microbatch: bool = False  # accumulation: reduce-scatter every micro-batch (less memory)
    sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD  # FSDP1 only


@dataclass
class TPConfig(MeshConfig):
    name: ParallelName = ParallelName.tp
    tp: int = -1
    dp_shard: int = 1
    sequence_parallel: bool | None = None  # None: auto, on where the model's plan declares it (validation decides)
    loss_parallel: bool = False


@dataclass
class PPConfig(MeshConfig):
    name: ParallelName = ParallelName.pp
    pp: int = -1
    dp_shard: int = 1
    schedule: Schedule = Schedule["1F1B"]
    n_microbatches: int = 4
    stages_per_rank: int = 0  # 0: auto (1 for GPipe/1F1B, 2 for interleaved and V schedules)


@dataclass
class CPConfig(FSDPConfig):
    """Context parallel: parameters sharded with FSDP over dp_shard x cp, so FSDP's knobs apply."""

    name: ParallelName = ParallelName.cp
    cp: int = -1
    dp_shard: int = 1
    cp_impl: CpImpl = CpImpl.ring  # ring: ours, any device; torch: torch's context_parallel, CUDA only


@dataclass
class HybridConfig(CPConfig, TPConfig, PPConfig):
    """FSDP over dp x pipeline over pp x tensor parallel over tp (x context parallel over cp)."""

    name: ParallelName = ParallelName.hybrid
    tp: int = 0
    pp: int = 0
    cp: int = 1
    dp_shard: int = -1
    n_microbatches: int = 2
    reshard_after_forward: bool = False  # stages run several micro-batches: keep parameters gathered
