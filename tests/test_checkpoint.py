"""Checkpoints on disk (torch.distributed.checkpoint): a resumed run continues exactly."""

from __future__ import annotations

import pytest

from tests.helpers import read_metrics, read_summary, train_cli


@pytest.mark.slow  # the default run resumes bitwise in tests/test_reliability.py (epoch boundary, preemption)
@pytest.mark.parametrize("parallel", ["none", "ddp"])
def test_resume_continues_the_same_trajectory(tmp_path, parallel):
    args = [
        "experiment=smoke",
        "logger=none",
        f"parallel={parallel}",
        "steps=8",
        "schedule.warmup_steps=2",
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


def test_a_worker_death_restarts_the_workers_from_the_last_checkpoint(tmp_path, monkeypatch):
    """launch.max_restarts: rank 1 dies abruptly before step 5 (fault injection, first attempt
    only); the elastic agent restarts both workers, which rejoin a fresh gloo group and continue
    from the step-4 checkpoint: the run ends as an uninterrupted one does."""
    args = ["experiment=smoke", "logger=none", "steps=6", "checkpoint.every=2"]
    clean = tmp_path / "clean"
    assert train_cli(args, clean).returncode == 0
    monkeypatch.setenv("HYDRADIST_FAULT", "1:4")
    restarted = tmp_path / "restarted"
    proc = train_cli([*args, "launch.max_restarts=1"], restarted)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "restart 1 of launch.max_restarts=1 after a worker failed: continuing from" in proc.stdout
    assert "step-000004" in proc.stdout
    got, want = read_metrics(restarted), read_metrics(clean)
    assert [m["step"] for m in got] == list(range(1, 7))  # each step once
    assert [m["loss"] for m in got] == pytest.approx([m["loss"] for m in want], rel=1e-6)
    assert read_summary(restarted)["first_loss"] == pytest.approx(want[0]["loss"])


def test_without_restarts_a_worker_death_fails_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRADIST_FAULT", "1:2")
    proc = train_cli(["experiment=smoke", "logger=none", "steps=4"], tmp_path / "run")
    assert proc.returncode != 0 and "worker rank 1 failed" in proc.stderr
