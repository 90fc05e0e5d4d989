"""Checkpoints on disk (torch.distributed.checkpoint): a resumed run continues exactly."""

from __future__ import annotations

import pytest

from tests.helpers import read_metrics, train_cli


@pytest.mark.parametrize("parallel", ["none", "ddp"])
def test_resume_continues_the_same_trajectory(tmp_path, parallel):
    args = [
        "experiment=smoke",
        "logger=none",
        f"parallel={parallel}",
        "steps=8",
        "optim.warmup_steps=2",
    ]
    full = tmp_path / "full"
    proc = train_cli([*args, "checkpoint.every=4"], full)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = full / "checkpoints" / "step-000004"
    assert (ckpt / ".metadata").exists()

    resumed = tmp_path / "resumed"
    proc = train_cli([*args, f"checkpoint.resume={ckpt}"], resumed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before = {m["step"]: m for m in read_metrics(full)}
    after = read_metrics(resumed)
    assert [m["step"] for m in after] == [5, 6, 7, 8]
    for m in after:  # same data position, weights, optimizer state and learning rate
        assert m["lr"] == pytest.approx(before[m["step"]]["lr"], rel=1e-9)
        assert m["loss"] == pytest.approx(before[m["step"]]["loss"], rel=1e-5)
