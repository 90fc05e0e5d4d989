"""The named values a config key may take, as Enums (OmegaConf checks them when Hydra composes).

Each is a str Enum whose member names are its values, so code elsewhere compares them with plain
strings (`cfg.parallel.name == "ddp"`), formats them as their value and writes them to JSON as
strings; a command line or a YAML file names a member by its value (`parallel.schedule=1F1B`).
"""

from __future__ import annotations

from enum import Enum


class Choice(str, Enum):
    """A str Enum that prints as its value (enum.StrEnum, which Python 3.10 lacks)."""

    __str__ = str.__str__
    __format__ = str.__format__


def _choice(name: str, values: str) -> type[Choice]:
    """A Choice whose members are `values` (space-separated), each named as itself (names such
    as `1F1B` are not Python identifiers, so a class statement cannot spell them)."""
    return Choice(name, [(v, v) for v in values.split()], module=__name__)


BackendName = _choice("BackendName", "auto gloo nccl mpi")
ParallelName = _choice("ParallelName", "none dp ddp fsdp tp pp hybrid cp auto")
CommHook = _choice("CommHook", "none fp16 bf16 powersgd")
ReduceDtype = _choice("ReduceDtype", "fp32 bf16")
ShardingStrategy = _choice("ShardingStrategy", "FULL_SHARD SHARD_GRAD_OP HYBRID_SHARD NO_SHARD")
# framework.parallel.pipeline maps each to torch's schedule class (a test keeps the two alike)
Schedule = _choice("Schedule", "GPipe 1F1B Interleaved1F1B InterleavedZeroBubble ZBVZeroBubble")
CpImpl = _choice("CpImpl", "ring torch")
PrecisionName = _choice("PrecisionName", "fp32 amp bf16")
MemoryName = _choice("MemoryName", "none checkpoint selective budget offload offload_activations")
HostAllocator = _choice("HostAllocator", "auto lean steady glibc")  # framework.measure.memory's policies
PlanProfile = _choice("PlanProfile", "probe cache config")  # framework.plan.profile's MEASURES
Sampler = _choice("Sampler", "distributed length_grouped token_budget")
ImageSource = _choice("ImageSource", "synthetic folder cifar10")
VarlenSource = _choice("VarlenSource", "synthetic text")
TransformsOn = _choice("TransformsOn", "device loader")
HFFormat = _choice("HFFormat", "auto parquet json arrow disk")
LoggerName = _choice("LoggerName", "wandb tensorboard all none")
WandbMode = _choice("WandbMode", "offline online disabled")
Device = _choice("Device", "auto cpu cuda")
StartMethod = _choice("StartMethod", "spawn fork forkserver")
Nonfinite = _choice("Nonfinite", "stop skip")
Verify = _choice("Verify", "full size off")
OnError = _choice("OnError", "stop warn")
Monitor = _choice("Monitor", "val_loss")
Optimize = _choice("Optimize", "tokens_per_s samples_per_s final_loss val_loss")
