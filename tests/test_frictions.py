"""What a new user meets on a first run and a resumed one, run as a user runs it: the console
says what happened (resumed, started fresh, data cut short, the schedule's length), W&B prints
nothing of its own but the sync hint, and the run folder holds no empty log.

Two runs share one folder: a fresh one with `checkpoint.resume=auto` and W&B on, then the same
run resumed with `steps` raised."""

from __future__ import annotations

import math
import re

import pytest
import torch
from omegaconf import OmegaConf

from framework.config import compose
from framework.schedules import build_scheduler, resumed_schedule
from tests.helpers import read_metrics, train_cli

TINY = ["experiment=smoke", "parallel=none", "checkpoint.every=3", "checkpoint.resume=auto", "metrics.sample_every=0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("frictions") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("WANDB_SILENT", raising=False)  # conftest silences W&B; a user's shell does not
        first = train_cli([*TINY, "steps=6"], run_dir, wandb=True)
    resumed = train_cli([*TINY, "steps=10", "logger=none"], run_dir)
    return run_dir, first, resumed


def test_fresh_auto_resume_says_it_starts_fresh(runs):
    _, first, _ = runs
    assert first.returncode == 0, first.stderr[-3000:]  # (tests/test_reliability.py resumes from a checkpoint)
    lines = [line for line in first.stdout.splitlines() if line.startswith("checkpoint.resume=auto:")]
    assert len(lines) == 1 and "starting fresh" in lines[0] and "hydra.run.dir=" in lines[0], first.stdout


def test_wandb_is_quiet_but_keeps_its_sync_hint(runs):
    _, first, _ = runs
    console = first.stdout + first.stderr
    assert "Run history" not in console and "Run summary" not in console, console[-3000:]
    assert not [line for line in console.splitlines() if line.startswith("wandb:")], console[-3000:]
    hint = [line for line in first.stdout.splitlines() if line.startswith("W&B offline run:")]
    assert len(hint) == 1 and "wandb sync " in hint[0]


def test_a_preset_that_cuts_the_corpus_says_so(runs):
    _, first, _ = runs
    lines = [line for line in first.stdout.splitlines() if line.startswith("data: reading the first")]
    assert len(lines) == 1 and "200,000 of" in lines[0] and "data.max_bytes=200000" in lines[0], first.stdout


def test_no_empty_train_log(runs, tmp_path):
    run_dir, _, resumed = runs
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert not (run_dir / "train.log").exists()
    failed = train_cli(["experiment=smoke", "data.path=/nonexistent/corpus"], tmp_path / "failed")
    assert failed.returncode == 2, failed.stderr[-2000:]
    assert not (tmp_path / "failed" / "train.log").exists()


def test_resumed_run_says_so_and_reports_its_own_segment(runs):
    run_dir, first, resumed = runs
    assert "resumed from step 6 (checkpoint " in resumed.stdout, resumed.stdout
    metrics = {m["step"]: m for m in read_metrics(run_dir)}
    assert sorted(metrics) == list(range(1, 11))
    done = next(line for line in resumed.stdout.splitlines() if line.startswith("done:"))
    assert done.startswith(f"done: steps 7-10 (4 this run, resumed from step 6), loss {metrics[7]['loss']:.4f} -> ")
    first_done = next(line for line in first.stdout.splitlines() if line.startswith("done:"))
    assert first_done.startswith(f"done: 6 steps, loss {metrics[1]['loss']:.4f} -> ")


def test_raised_steps_keep_the_schedule_and_say_so(runs):
    run_dir, _, resumed = runs
    assert "steps=10: the LR schedule spans 6 steps (as saved; schedule.steps=N re-plans it)" in resumed.stdout
    lrs = [m["lr"] for m in read_metrics(run_dir)]
    # cosine down over the saved 6 steps, then flat at its floor: no jump at step 7 (each step
    # logs the LR its update applied)
    assert all(b <= a + 1e-12 for a, b in zip(lrs[:-1], lrs[1:], strict=True)), lrs
    assert math.isclose(lrs[-1], lrs[6], rel_tol=1e-9) and lrs[5] > lrs[6], lrs


def test_schedule_steps_replans_a_resumed_schedule():
    """`schedule.steps` set on resume stretches the schedule; unset, the saved length stays."""
    cfg = compose([]).schedule  # warm-up + cosine, its span unset
    param = torch.nn.Parameter(torch.zeros(1))
    first = build_scheduler(torch.optim.SGD([param], lr=1.0), cfg, 6)
    for _ in range(3):
        first.optimizer.step()
        first.step()
    state = first.state_dict()

    kept = build_scheduler(torch.optim.SGD([param], lr=1.0), cfg, 10)
    kept.load_state_dict(state)
    assert resumed_schedule(kept, cfg, 6) is None and kept.schedule_steps == 6
    line = resumed_schedule(kept, cfg, 10)
    assert kept.schedule_steps == 6 and re.search(r"spans 6 steps \(as saved", line)

    stretched = build_scheduler(torch.optim.SGD([param], lr=1.0), cfg, 10)
    stretched.load_state_dict(state)
    line = resumed_schedule(stretched, OmegaConf.merge(cfg, {"steps": 20}), 10)
    assert stretched.schedule_steps == 20 and "spans 20 steps (set by schedule.steps)" in line
    stretched.optimizer.step()
    stretched.step()
    assert stretched.get_last_lr()[0] > first.get_last_lr()[0] * 0.99  # a longer cosine decays slower
