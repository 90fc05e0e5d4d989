"""Scale-true building: every rank allocates and initialises only its own part of the model
(meta-device initialisation), with the values of the single-process model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import run_workers, world_config

BASE = ["experiment=smoke", "logger=none", "model.n_layer=4", "model.n_head=4", "model.n_embd=64"]


def _built_equals_single_process(rank: int, world: int, overrides: list[str]) -> list[str]:
    from framework.checkpoint.full import full_model_state_dict
    from framework.contract import build_model
    from framework.dist import DistInfo
    from framework.run.trainer import build

    cfg = OmegaConf.create(world_config(overrides, world))
    info = DistInfo(rank, world, rank, world, torch.device("cpu"), "gloo")
    full = full_model_state_dict(build(cfg, info).par)
    if rank != 0:  # gathered onto rank 0's host alone (an export of a model that fits only sharded)
        return [] if full == {} else ["a full copy on another rank"]
    torch.manual_seed(cfg.seed)
    plain = build_model(cfg.model, "cpu").state_dict()
    assert full.keys() == plain.keys()
    return [k for k in plain if not torch.equal(plain[k], full[k])]


@pytest.mark.parametrize(
    "overrides,world",
    [
        (["parallel=fsdp"], 2),
        (["parallel=tp"], 2),
        (["parallel=pp"], 2),
        (["parallel=hybrid", "parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=-1"], 4),
        (["parallel=ddp"], 2),
    ],
    ids=["fsdp", "tp", "pp", "pp2-fsdp-tp2", "ddp"],
)
def test_every_layout_initialises_the_single_process_model(overrides, world):
    """Built on the meta device and filled shard by shard (row-seeded init), the gathered model
    equals `GPT(...)` built in one process from the same seed, exactly."""
    differing = run_workers(_built_equals_single_process, world, [*BASE, *overrides])
    assert differing == {r: [] for r in range(world)}


def _largest_allocation(rank: int, world: int, overrides: list[str]) -> tuple[int, int, int]:
    from torch.utils._python_dispatch import TorchDispatchMode

    from framework.dist import DistInfo
    from framework.run.trainer import build

    class Allocations(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                # plain tensors: a DTensor's size is its global one; its local shard shows up here too
                if type(t) in (torch.Tensor, torch.nn.Parameter) and not t.is_meta:
                    self.largest = max(self.largest, t.numel())
            return out

    cfg = OmegaConf.create(world_config(overrides, world))
    info = DistInfo(rank, world, rank, world, torch.device("cpu"), "gloo")
    with Allocations() as probe:
        setup = build(cfg, info)
    params = list(setup.par.module.parameters())
    full = max(p.numel() for p in params)  # DTensor: the global size
    local = max((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
    return probe.largest, full, local


def test_fsdp_never_allocates_a_full_size_parameter():
    """gpt 2 x 512 under fsdp at 4 ranks: its MLP matrices (2048 x 512) are the largest tensors,
    and every rank holds a quarter of each. No tensor allocated while building (the model, its
    shards, the optimizer, the data) reaches the size of one full matrix."""
    overrides = ["experiment=smoke", "logger=none", "parallel=fsdp", "model.n_layer=2", "model.n_head=4",
                 "model.n_embd=512"]  # fmt: skip
    results = run_workers(_largest_allocation, 4, overrides)
    for largest, full, local in results.values():
        assert full == 2048 * 512 and local == full // 4
        assert largest < full // 2, f"a tensor of {largest} elements was allocated (full parameter: {full})"


@pytest.mark.slow  # the default run forms two nodes from SLURM tasks (test_sweeps.py) and runs torchrun on one
def test_two_torchrun_agents_form_one_run_as_two_nodes(tmp_path):
    """`torchrun --nnodes=2` twice on this machine, as on two nodes (c10d rendezvous, one worker
    each): one 2-rank run in one directory named from the rendezvous id, with the losses of
    `python train.py` on 2 local workers."""
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT, free_port, losses, read_summary, task_outputs, train_cli, wait_tasks

    args = ["experiment=smoke", "logger=none", "steps=4", "device=cpu"]
    port = free_port()
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
             "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=twonodes"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "SLURM_"))}
    env["WANDB_MODE"] = "offline"
    nodes = [
        subprocess.Popen([*agent, f"--node_rank={n}", str(ROOT / "train.py"), *args], cwd=tmp_path, env=env,
                         stdout=open(tmp_path / f"task{n}.log", "w"), stderr=subprocess.STDOUT, text=True)
        for n in range(2)
    ]  # fmt: skip
    assert wait_tasks(nodes, tmp_path, timeout=300) == [0, 0], task_outputs(tmp_path, 2)
    runs = list((tmp_path / "outputs" / "jobs").iterdir())
    assert [r.name for r in runs] == ["torchrun-twonodes"]
    assert read_summary(runs[0])["world_size"] == 2

    local = tmp_path / "local"
    assert train_cli(args, local).returncode == 0
    assert losses(runs[0]) == losses(local)


def _optimizer_groups(rank: int, world: int, overrides: list[str]) -> tuple[int, int, str]:
    from framework.dist import DistInfo
    from framework.run.trainer import build

    cfg = OmegaConf.create(world_config(overrides, world))
    setup = build(cfg, DistInfo(rank, world, rank, world, torch.device("cpu"), "gloo"))
    groups = setup.optimizer.param_groups  # the blocks' matrices, the other decayed parameters, the rest
    decay, (no_decay,) = [g for g in groups if g["weight_decay"] > 0], [g for g in groups if g["weight_decay"] == 0]
    assert all(g["weight_decay"] == cfg.optim.weight_decay > 0 for g in decay) and decay[0].get("matrix")
    return sum(len(g["params"]) for g in decay), len(no_decay["params"]), type(setup.precision.scaler).__name__


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel=fsdp", "parallel.version=1"],
        pytest.param(["parallel=fsdp"], marks=pytest.mark.slow),
        ["parallel=ddp"],
    ],
    ids=["fsdp1", "fsdp2", "ddp"],
)
def test_weight_decay_groups_are_the_plain_models_under_every_wrapper(overrides):
    """FSDP1 flattens every parameter to 1-d; grouping by shape would turn weight decay off.
    Grouped by the plain model's names, the matrices decay under every wrapper. FSDP1 with amp
    gets the sharded loss scaler, so every rank skips the same steps."""
    from framework.contract import build_model

    plain = build_model({"_target_": "models.gpt.GPT", "n_layer": 4, "n_head": 4, "n_embd": 64, "dropout": 0.0}, "cpu")
    matrices = sum(p.dim() >= 2 for p in plain.parameters())
    groups = run_workers(_optimizer_groups, 2, [*BASE, "precision=amp", "optim.weight_decay=0.1", *overrides])
    scaler = "GradScaler" if "parallel=ddp" in overrides else "LocalShardScaler"  # a ShardedGradScaler
    for n_decay, n_other, scaler_type in groups.values():
        assert (n_decay, n_other) == (matrices, len(list(plain.parameters())) - matrices)
        assert scaler_type == scaler


def test_nccl_with_cpu_offload_also_gets_a_cpu_backend():
    from framework.config import resolve_backend
    from tests.helpers import compose_config

    assert resolve_backend(compose_config(["backend=nccl", "parallel=fsdp", "memory=offload"])) == "cpu:gloo,cuda:nccl"
    assert resolve_backend(compose_config(["backend=nccl", "parallel=fsdp"])) == "nccl"


def _peak_rss_from_outside(tmp_path, overrides: list[str]) -> int:
    from framework.measure.memory import peak_rss_of

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, str(root / "train.py"), *overrides, "device=cpu", f"hydra.run.dir={tmp_path}"]
    return peak_rss_of(cmd, cwd=root, env={**os.environ, "WANDB_MODE": "offline"}, stdout=subprocess.DEVNULL)


@pytest.mark.slow  # two launches of a 100M gpt read from outside; benchmarks/memory.py writes the same table
def test_fsdp_at_4_ranks_peaks_under_0_58_of_one_process(tmp_path):
    """gpt 8 x 1024 (about 100M parameters), T=64, B=4, 2 steps: the largest process's peak RSS,
    measured from outside, is at most 0.58 x `parallel=none`'s (each with its defaults)."""
    big = ["experiment=smoke", "logger=none", "progress=false", "model.n_layer=8", "model.n_embd=1024",
           "model.n_head=8", "data.seq_len=64", "data.batch_size=4", "steps=2"]  # fmt: skip
    none = _peak_rss_from_outside(tmp_path / "none", [*big, "parallel=none"])
    fsdp = _peak_rss_from_outside(tmp_path / "fsdp", [*big, "parallel=fsdp", "launch.nproc_per_node=4"])
    assert fsdp <= 0.58 * none, f"fsdp@4 peak {fsdp >> 10} MiB against none's {none >> 10} MiB: {fsdp / none:.3f}"
