"""The loss trajectory does not depend on how the global batch is split across ranks and
micro-batches (fp32, dropout 0): DDP and accumulation are exact re-arrangements of one batch."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import losses, run_workers, train_cli

BASE = ["experiment=smoke", "steps=5", "logger=none", "optim.grad_clip=0"]


def _run(tmp_path, name, args):
    run = tmp_path / name
    proc = train_cli([*BASE, *args], run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(run)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, one micro-batch of 8 per step."""
    return _run(tmp_path_factory.mktemp("ref"), "none_1x8", ["parallel=none", "data.batch_size=8"])


@pytest.mark.parametrize(
    "name,args",
    [
        # plain ddp meets one process in most other files; the default run keeps the accumulating splits
        pytest.param(
            "ddp_2x4", ["parallel=ddp", "launch.nproc_per_node=2", "data.batch_size=4"], marks=pytest.mark.slow
        ),
        ("none_accum4x2", ["parallel=none", "data.batch_size=2", "accumulation_steps=4"]),
        (
            "ddp_2x_accum4x1",
            [
                "parallel=ddp",
                "launch.nproc_per_node=2",
                "data.batch_size=1",
                "accumulation_steps=4",
            ],
        ),
    ],
)
def test_same_losses_however_the_global_batch_is_split(tmp_path, reference, name, args):
    got = _run(tmp_path, name, args)
    assert len(got) == len(reference) == 5
    assert reference[-1] < reference[0]  # it trains, so the comparison is not between constants
    for step, (a, b) in enumerate(zip(got, reference, strict=True), start=1):
        assert abs(a - b) / abs(b) <= 1e-4, f"step {step}: {name} loss {a} vs single-process {b}"


def _no_sync_worker(rank: int, world: int):
    from omegaconf import OmegaConf

    from framework.config.parallel_schema import DDPConfig
    from framework.config.schema import MemoryConfig
    from framework.contract import build_model, spec_of
    from framework.converters import converted_model
    from framework.dist import DistInfo
    from framework.parallel.apply import parallelize

    linear = {"_target_": "torch.nn.Linear", "in_features": 4, "out_features": 1, "bias": False}
    parts = {"parallel": DDPConfig(), "memory": MemoryConfig(), "model": linear}
    cfg = OmegaConf.create({**parts, "compile": False, "seed": 0})
    info = DistInfo(rank, world, rank, world, torch.device("cpu"), "gloo")
    meta = build_model(cfg.model)
    spec = spec_of(meta, cfg.model)
    model, _ = converted_model(meta, spec, cfg, info)  # built on this rank's device, as a run builds it
    par = parallelize(model, spec, cfg, info)
    weight = par.module.module.weight  # DDP holds the model at .module
    x = torch.full((2, 4), float(rank + 1))  # each rank sees different data
    with par.grad_sync(False):
        par.module(x).sum().backward()
    local = weight.grad.clone()  # not synchronised yet: this rank's own gradient
    with par.grad_sync(True):
        par.module(x).sum().backward()
    synced = weight.grad.clone()
    return local, synced


def test_no_sync_skips_communication_until_the_last_micro_batch():
    results = run_workers(_no_sync_worker, 2)
    (local0, synced0), (local1, synced1) = results[0], results[1]
    assert torch.allclose(local0, torch.full((1, 4), 2.0))  # 2 samples of value 1
    assert torch.allclose(local1, torch.full((1, 4), 4.0))  # 2 samples of value 2
    # the synchronised step averages the accumulated gradients over ranks: (2+2 + 4+4) / 2
    assert torch.allclose(synced0, synced1) and torch.allclose(synced0, torch.full((1, 4), 6.0))
