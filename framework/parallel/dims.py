"""The parallel degrees of a run and its device mesh, validated in one place (as torchtitan's
ParallelDims).

Glossary: a mesh *axis* (``pp``, ``dp_replicate``, ``dp_shard``, ``cp``, ``tp``) is a group of
ranks; it is not a tensor *dim*. The world is laid out pp x dp_replicate x dp_shard x cp x tp, tp
innermost so tensor-parallel peers (which talk most) are neighbouring ranks, on one node where
possible, and context-parallel peers (a ring of sends per layer) next to them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import cached_property

import torch
from omegaconf import DictConfig, OmegaConf

AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# Axes made by flattening (cp's dp_shard_cp, expert parallel's dp_shard) are sliced from the root
# mesh by name, which torch still supports but warns about on every slice
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
EP_AXES = ("pp", "dp_replicate", "dp_shard_mod_ep", "ep", "cp", "tp")  # dp_shard split for expert parallel
# with context parallel, ep spans whole cp groups: ep = dp_shard_in_ep x cp (torchtitan's layout)
EP_CP_AXES = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")


class DimsError(ValueError):
    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


@dataclass(frozen=True)
class Strategy:
    """What the chosen strategy means to the rest of the run, answered here once: the trainer,
    `parallelize` and the launcher ask it instead of comparing names."""

    name: str  # parallel.name: none | dp | ddp | fsdp | tp | pp | hybrid
    version: int = 2  # FSDP's (parallel.version), on a mesh

    @classmethod
    def of(cls, parallel: DictConfig) -> Strategy:
        return cls(parallel.name, parallel.get("version", 2))

    @property
    def one_process(self) -> bool:
        """Trains in the launching process itself (no workers to start; a launcher's world is 1)."""
        return self.name == "none"

    @property
    def needs_backend(self) -> bool:
        """Needs a process group: every strategy but none and dp (one process drives every GPU)."""
        return self.name not in ("none", "dp")

    def devices(self, world_size: int) -> int:
        """The accelerators (or CPU ranks) a run of `world_size` ranks computes on: one per rank,
        but under dp the one process drives every visible GPU (for MFU's peak)."""
        return torch.cuda.device_count() if self.name == "dp" else world_size

    @property
    def on_mesh(self) -> bool:
        """fsdp, tp, pp and hybrid: laid out on a device mesh (ParallelDims)."""
        return self.name not in ("none", "dp", "ddp")

    @property
    def fsdp1(self) -> bool:
        """FullyShardedDataParallel (it flattens parameters, and wants a sharded grad scaler)."""
        return self.on_mesh and self.version == 1

    def shards(self, dims: ParallelDims) -> bool:
        """FSDP over the data-parallel axes: when they hold more than one rank, and always under
        parallel=fsdp, so that a single GPU exercises FSDP's code path (mixed precision, offload)."""
        return self.on_mesh and (dims.dp * dims.cp > 1 or self.name == "fsdp")

    def materialise_late(self, on_meta: bool) -> bool:
        """A model kept on the meta device is allocated after parallelizing, this rank's part only,
        by the strategies that shard or split it (FSDP2, tensor parallel, pipeline); the others
        (none, dp, ddp, FSDP1) allocate the whole model before wrapping it."""
        return on_meta and self.on_mesh and not self.fsdp1


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise DimsError(key, message)


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    world_size: int
    cp: int = 1  # context parallel: each sequence split over cp ranks (they read the same batch)
    ep: int = 1  # expert parallel: routed experts split over ep of the dp_shard ranks (framework/parallel/expert.py)

    @classmethod
    def from_config(
        cls, cfg: DictConfig, world_size: int, n_layer: int | None = None, n_head: int | None = None
    ) -> ParallelDims:
        """Resolve `cfg` (the `parallel` group) at `world_size`: 0 means auto (hybrid's defaults),
        -1 on one dp axis means "the ranks left over". Raises DimsError naming the key."""
        # a choice off the mesh (ddp: the planner asks too) has no degrees: all ranks data-parallel
        tp, pp, rep, shard = cfg.get("tp", 1), cfg.get("pp", 1), cfg.get("dp_replicate", 1), cfg.get("dp_shard", -1)
        cp = cfg.get("cp", 1)
        if cp == 0 or cp < -1:
            raise DimsError("parallel.cp", f"got {cp}; must be >= 1 (1: no context parallel) or -1 (the rest)")
        if tp == 0:  # auto: 2-way tensor parallel where the world (less cp) and the heads split evenly
            rest = world_size // cp if cp > 0 else 1
            tp = 2 if rest % 2 == 0 and (n_head is None or n_head % 2 == 0) else 1
        if tp == -1:
            tp = world_size
        if pp == 0:  # auto: 2 stages when at least 2-way data parallel remains (never with cp)
            pp = 2 if cp == 1 and (world_size // tp) % 4 == 0 and (n_layer is None or n_layer % 2 == 0) else 1
        if pp == -1:
            pp = world_size // tp
        for key, value in (
            ("parallel.tp", tp),
            ("parallel.pp", pp),
            ("parallel.dp_replicate", rep),
        ):
            if value < 1:
                raise DimsError(key, f"got {value}; must be >= 1 (or -1: the rest of the world; 0: auto)")
        if cp == -1:
            cp = _rest_of_world("parallel.cp", world_size, tp * pp * rep * shard, "tp x pp x dp_replicate x dp_shard")
        if shard == -1:
            if world_size % (tp * pp * rep * cp):
                raise DimsError(
                    "parallel.dp_shard",
                    f"-1 (the ranks left over): the world size {world_size} does not divide by tp x pp x dp_replicate "
                    f"x cp = {tp * pp * rep * cp} (tp={tp}, pp={pp}, dp_replicate={rep}, cp={cp}); change those "
                    "degrees or launch.nproc_per_node",
                )
            shard = world_size // (tp * pp * rep * cp)
        if shard < 1:
            raise DimsError("parallel.dp_shard", f"got {shard}; must be >= 1 or -1 (the rest of the world)")
        if rep * shard * cp * tp * pp != world_size:
            raise DimsError(
                "parallel",
                f"dp_replicate({rep}) x dp_shard({shard}) x cp({cp}) x tp({tp}) x pp({pp}) = "
                f"{rep * shard * cp * tp * pp}, but the world size is {world_size}; "
                + _filling(cfg, world_size, n_layer, n_head, rep * shard * cp * tp * pp),
            )
        dims = cls(rep, shard, tp, pp, world_size, cp, _expert_degree(cfg.get("ep", 1), shard, cp))
        from framework.parallel.pipeline import stages_per_rank

        dims.check_model(n_layer, n_head, stages_per_rank(cfg))
        return dims

    def check_model(self, n_layer: int | None, n_head: int | None, stages_per_rank: int = 1) -> None:
        if self.tp > 1 and n_head is not None and n_head % self.tp:
            raise DimsError(
                "parallel.tp",
                f"{n_head} attention heads do not split evenly over tp={self.tp} ranks",
            )
        stages = self.pp * stages_per_rank
        if self.pp > 1 and n_layer is not None and n_layer < stages:
            raise DimsError("parallel.pp", f"{n_layer} layers cannot fill {stages} pipeline stages")

    def check_run(self, cfg: DictConfig) -> None:
        """What these degrees demand of the rest of the config (`cfg`: the whole run's)."""
        from framework.parallel.pipeline import least_microbatches, stages_per_rank

        p = cfg.parallel
        if p.get("version", 2) == 1:
            _require(self.tp == 1 and self.pp == 1 and self.ep == 1, "parallel.version",
                     "FSDP1 (version=1) shards data-parallel only; use version=2 with tp, pp or ep")  # fmt: skip
            _require(
                (p.sharding_strategy == "HYBRID_SHARD") == (self.dp_replicate > 1),
                "parallel.sharding_strategy",
                "HYBRID_SHARD needs parallel.dp_replicate > 1 (replicas of shard groups) and the other "
                "strategies dp_replicate=1",
            )
        if self.pp > 1:
            local_batch = cfg.data.batch_size * cfg.accumulation_steps
            n_microbatches, schedule = p.get("n_microbatches", 4), p.get("schedule", "1F1B")
            _require(local_batch % n_microbatches == 0, "parallel.n_microbatches",
                     f"must divide the local batch data.batch_size x accumulation_steps = {local_batch}")  # fmt: skip
            stages = self.pp * stages_per_rank(p)
            _require(
                n_microbatches >= least_microbatches(schedule, stages),
                "parallel.n_microbatches",
                f"the {schedule} schedule needs at least as many micro-batches as stages ({stages})",
            )
        seq_len = cfg.data.get("seq_len")  # data of no sequences (vectors, images): the model's checks refuse tp
        if self.tp > 1 and p.get("sequence_parallel", None) and seq_len is not None:  # resolved by now
            _require(
                seq_len % (self.tp * self.cp) == 0,
                "data.seq_len",
                f"sequence parallel splits sequences over tp={self.tp} x cp={self.cp} ranks; {seq_len} does not divide",
            )
        if self.cp > 1:
            from framework.parallel.context import cp_config_problem

            problem = cp_config_problem(self, cfg)
            if problem is not None:
                raise DimsError(*problem)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches a step reads."""
        return self.dp_replicate * self.dp_shard

    @property
    def degrees(self) -> dict[str, int]:
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }

    @property
    def layout(self) -> dict[str, int]:
        """The degrees and how dp_shard is laid out for experts (ep: 1 without): summary.parallel_dims."""
        return {**self.degrees, "ep": self.ep}

    def build_mesh(self, device_type: str):
        """The mesh over AXES. With expert parallel, dp_shard is laid out as dp_shard_mod_ep x ep
        (ep innermost: a rank's expert peers are neighbours) and flattened back to dp_shard, so
        the rest of the framework sees the same mesh; experts are sharded over ep and, by FSDP,
        over dp_shard_mod_ep (torchtitan's layout)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.ep == 1:
            return init_device_mesh(device_type, tuple(self.degrees.values()), mesh_dim_names=AXES)
        if self.cp > 1:  # ep = dp_shard_in_ep x cp: the tokens of every cp rank are routed to the experts
            in_ep = self.ep // self.cp
            shape = (self.pp, self.dp_replicate, self.dp_shard // in_ep, in_ep, self.cp, self.tp)
            mesh = init_device_mesh(device_type, shape, mesh_dim_names=EP_CP_AXES)
            mesh["dp_shard_mod_ep", "dp_shard_in_ep"]._flatten("dp_shard")
            mesh["dp_shard_in_ep", "cp"]._flatten("ep")
            mesh["dp_shard_mod_ep", "dp_shard_in_ep", "cp"]._flatten("dp_shard_cp")  # FSDP's (Mesh.dp_mesh)
            return mesh
        shape = (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.ep, self.cp, self.tp)
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=EP_AXES)
        mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        return mesh


def _expert_degree(ep: int, dp_shard: int, cp: int) -> int:
    """parallel.ep: it borrows from the dp_shard ranks (each holds experts / ep experts); with
    context parallel from dp_shard x cp, whole cp groups (torchtitan's layout)."""
    _require(ep >= 1, "parallel.ep", f"got {ep}; must be >= 1 (1: no expert parallel)")
    if cp > 1 and ep > 1:
        _require(ep % cp == 0 and dp_shard % (ep // cp) == 0, "parallel.ep",
                 f"got {ep}; with context parallel expert parallel spans whole cp groups: it must be a multiple "
                 f"of cp={cp}, and ep / cp must divide dp_shard={dp_shard}")  # fmt: skip
        return ep
    _require(dp_shard % ep == 0, "parallel.ep",
             f"got {ep}; expert parallel splits the dp_shard={dp_shard} ranks, so it must divide them")  # fmt: skip
    return ep


def _filling(cfg: DictConfig, world_size: int, n_layer: int | None, n_head: int | None, product: int) -> str:
    """What makes degrees whose product is not the world size fit it: the one degree that, set to
    -1, resolves here to a layout the model splits into (each tried as the run resolves it), else
    the world those degrees take."""
    given = OmegaConf.to_container(cfg)
    for key in ("dp_shard", "cp", "pp", "tp"):
        if given.get(key, 1) == -1:  # it fills the rest already
            continue
        try:
            dims = ParallelDims.from_config(OmegaConf.create({**given, key: -1}), world_size, n_layer, n_head)
        except DimsError:
            continue
        return f"set parallel.{key}=-1 to fill it ({key}={getattr(dims, key)})"
    return f"no degree set to -1 fills it: choose degrees whose product divides {world_size}, or launch.nproc_per_node={product}"


def _rest_of_world(key: str, world_size: int, others: int, names: str) -> int:
    if others < 1 or world_size % others:
        raise DimsError(key, f"-1 takes the ranks left over: world size {world_size} does not divide by {names} "
                             f"= {others} (set the other degrees, none of them -1)")  # fmt: skip
    return world_size // others


@dataclass
class Mesh:
    """The mesh with the coordinates the rest of the framework asks for."""

    dims: ParallelDims
    device_mesh: object  # torch DeviceMesh over AXES

    @cached_property
    def dp_mesh(self):
        """The mesh FSDP shards over: 2-D (replicate, shard) for HSDP, else 1-D. With context
        parallel, shard is dp_shard x cp flattened: cp ranks share model state (as torchtitan)."""
        if self.dims.cp == 1:
            shard = "dp_shard"
        else:
            shard = "dp_shard_cp"  # under expert parallel laid out by build_mesh already
            flat = self.device_mesh[shard] if self.dims.ep > 1 else self.device_mesh["dp_shard", "cp"]._flatten(shard)
            if self.dims.dp_replicate == 1:
                return flat
        return self.device_mesh["dp_replicate", shard] if self.dims.dp_replicate > 1 else self.device_mesh[shard]

    @cached_property
    def dp_group(self):
        """The process group of every data-parallel rank (replicate x shard; cp ranks excluded:
        they hold parts of the same samples)."""
        if self.dims.dp_replicate > 1 and self.dims.dp_shard > 1:
            return self.device_mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
        return self.device_mesh["dp_replicate" if self.dims.dp_replicate > 1 else "dp_shard"].get_group()

    @cached_property
    def expert_meshes(self) -> tuple:
        """(ep mesh: the ranks that split the experts, FSDP's mesh for the experts: the data-parallel
        ranks left, 2-D with dp_replicate), under expert parallel."""
        rest = ("dp_replicate", "dp_shard_mod_ep") if self.dims.dp_replicate > 1 else "dp_shard_mod_ep"
        return self.device_mesh["ep"], self.device_mesh[rest]

    @property
    def cp_rank(self) -> int:
        return self.device_mesh["cp"].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return (
            self.device_mesh["dp_replicate"].get_local_rank() * self.dims.dp_shard
            + self.device_mesh["dp_shard"].get_local_rank()
        )

    @property
    def pp_rank(self) -> int:
        return self.device_mesh["pp"].get_local_rank()

    @property
    def tp_rank(self) -> int:
        return self.device_mesh["tp"].get_local_rank()
