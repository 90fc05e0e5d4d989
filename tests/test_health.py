"""Long runs that stay healthy (framework/callbacks/health/, docs/health.md): loss spikes warned of,
skipped on the device or rolled back; the slow rank named; a flipped bit caught between replicas;
and the goodput account. Faults come from HYDRADIST_FAULT=RANK:STEP:KIND (spike, slow, bitflip)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from framework.callbacks.health.spike import SpikeGuard
from framework.config import ConfigError, validate
from framework.figures import Registry
from framework.hooks import Control
from tests.helpers import (
    compose_config,
    count_syncs,
    losses,
    read_metrics,
    read_summary,
    train_cli,
    train_in_process,
    wandb_runs,
)

SMOKE = ["experiment=smoke", "progress=false"]
SPIKE = ["callbacks.spike.window=16", "callbacks.spike.watch=[loss]"]


class _Info:
    device = torch.device("cpu")
    is_main = False


class _Run:
    """What SpikeGuard reads of a run, for scoring synthetic series without one."""

    def __init__(self):
        self.info, self.control, self.figures = _Info(), Control(), Registry()


def scored(series: list[dict[str, float]], **kwargs) -> list[bool]:
    guard = SpikeGuard(action="skip", **kwargs)
    guard.on_build(_Run())
    flags = []
    for values in series:
        guard.run.control.clear()
        guard.on_before_update(0, {k: torch.tensor(v) for k, v in values.items()})
        flags.append(bool(guard.run.control.skip_when))
    return flags


def test_the_detector_flags_spikes_of_either_figure_and_not_the_noise_around_them():
    torch.manual_seed(0)
    noisy = [{"loss": 3 - 0.01 * k + 0.05 * torch.randn(()).item(), "grad_norm": 1 + 0.1 * torch.rand(()).item()}
             for k in range(40)]  # fmt: skip
    assert not any(scored(noisy, window=16))
    spiked = [dict(v) for v in noisy]
    spiked[20]["loss"] *= 10
    spiked[30]["grad_norm"] *= 10
    assert [k for k, f in enumerate(scored(spiked, window=16)) if f] == [20, 30]
    assert [k for k, f in enumerate(scored(spiked, window=16, watch=("loss",))) if f] == [20]
    assert [k for k, f in enumerate(scored(spiked, window=16, zscore=None, ratio=2.0)) if f] == [20, 30]
    overflowed = [dict(v) for v in spiked]  # amp's overflow steps: an inf norm is no value of the window
    for k in range(2, 40, 3):
        overflowed[k]["grad_norm"] = math.inf
    assert [k for k, f in enumerate(scored(overflowed, window=16, zscore=None, ratio=2.0)) if f] == [20, 30]
    early = [dict(v) for v in noisy[:15]]
    early[10]["loss"] *= 10
    assert not any(scored(early, window=16))  # warm-up: nothing is scored before a full window


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["callbacks.spike.action=explode"], "callbacks.spike.action", "one of off, warn, skip, rollback"),
        (["callbacks.spike.action=warn", "callbacks.spike.window=0"], "callbacks.spike.window", "integer >= 2"),
        (["callbacks.spike.action=rollback", "steps=300"], "callbacks.spike.action", "checkpoint.every=0"),
        # a guard that would never score: the default window (128) on a 60-step run
        (["steps=60", "checkpoint.every=10", "callbacks.spike.action=rollback"], "callbacks.spike.window",
         "the guard scores from step 129 (after window=128 steps), and the run ends at step 60: it would never score"),
        (["steps=60", "checkpoint.every=10", "callbacks.spike.action=rollback", "checkpoint.keep_last=2", *SPIKE],
         "checkpoint.keep_last", "keep_last >= 5, or 0 (all)"),
        (["steps=60", "checkpoint.every=10", "callbacks.spike.action=rollback", "callbacks.spike.max_rollbacks=0",
          *SPIKE], "callbacks.spike.max_rollbacks", "an integer >= 1"),
        (["callbacks.spike.watch=[loss,lr]"], "callbacks.spike.watch", "loss, grad_norm"),
        (["parallel=tp", "callbacks.checksum.every=10"], "callbacks.checksum.every", "tensor parallel"),
        (["parallel=fsdp", "callbacks.checksum.every=10"], "callbacks.checksum.every", "own shard"),
        (["callbacks.checksum.every=-1"], "callbacks.checksum.every", "0: off"),
        (["callbacks.straggler.every=-5"], "callbacks.straggler.every", "0: off"),
    ],
)  # fmt: skip
def test_bad_health_settings_are_one_line_naming_the_key(overrides, key, says):
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["experiment=smoke", *overrides]))
    assert err.value.key == key and says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_settings_that_flag_healthy_training_are_refused_and_the_defaults_flag_none():
    """The guard's settings replayed over the converging benchmark's clean runs (calibration.py):
    the defaults flag none of their steps; the tight setting a new user tried (window 8, z-score 1)
    and the smoke run's warmup=8 are refused in one line; the tests' own setting passes. The replay
    is the guard's own arithmetic: step by step through on_before_update gives the same flags."""
    from framework.callbacks.health.calibration import clean_runs, false_alarms, refusal, replay

    assert len(clean_runs()) == 10 and all(len(steps) == 300 for steps in clean_runs().values())
    assert false_alarms({}) == 0  # the default guard: no rollback on any clean run
    assert refusal({"window": 16, "watch": ("loss",)}) is None  # SPIKE, the setting of this file's runs
    tight = ["steps=40", "checkpoint.every=10", "callbacks.spike.action=rollback", "callbacks.spike.window=8",
             "callbacks.spike.zscore=1.0"]  # fmt: skip
    for overrides in (tight, ["steps=300", "callbacks.spike.action=warn", "callbacks.spike.warmup=8"]):
        with pytest.raises(ConfigError) as err:
            validate(compose_config(["experiment=smoke", *overrides]))
        said = str(err.value)
        assert err.value.key.startswith("callbacks.spike.") and "\n" not in said, said
        assert "of the 3000 steps of healthy training (the converging benchmark's 10 clean runs" in said, said
    steps = next(iter(clean_runs().values()))
    for settings in ({"window": 8, "warmup": 4, "zscore": 2.0}, {"window": 32, "zscore": None, "ratio": 1.5}):
        assert replay(steps, **settings) == scored(steps, **settings)


def test_rollback_goes_back_past_a_damaged_checkpoint_gives_up_in_one_line_and_logs_each_step_once(tmp_path):
    """The weights damaged (x4) in the very update that the step-20 checkpoint saves, under ddp x2
    with action=rollback and a checkpoint every 5 steps. The spike at step 21 goes back to step 20,
    comes back at once, and goes a checkpoint further back (15), where the rerun is clean: the run
    finishes within 10% of a run that never saw the damage (one process: ddp x2 is its parity), each
    step once in metrics.jsonl and in W&B's history (no W&B warning), the rerun steps marked. With
    max_rollbacks=1 the same run ends in one line naming what it tried, its checkpoints kept."""
    args = [*SMOKE, "steps=40", "checkpoint.every=5", *SPIKE]
    train_in_process([*args, "callbacks.spike.action=warn"], tmp_path / "clean")  # one process: ddp's parity
    damaged = {"HYDRADIST_FAULT": "*:19:damage"}
    gave_up = train_cli([*args, "callbacks.spike.action=rollback", "callbacks.spike.max_rollbacks=1"],
                        tmp_path / "gave_up", env=damaged)  # fmt: skip
    errors = [line for line in gave_up.stderr.splitlines() if line.startswith("error:")]
    assert gave_up.returncode != 0 and len(errors) == 1, gave_up.stderr[-3000:]
    assert errors[0].startswith(
        "error: the spike guard gave up: spikes at steps 21 and 21 each came back within "
        "16 steps of rolling back (to the checkpoints of steps 20), and callbacks.spike.max_rollbacks=1 "
        "allows no more in a row; the checkpoints are kept in "
    ), errors
    assert "Traceback" not in gave_up.stderr
    kept = sorted(p.name for p in (tmp_path / "gave_up" / "checkpoints").glob("step-*"))
    assert len(kept) == 4, kept  # 5, 10, 15, 20: intact, to resume from
    run = tmp_path / "rolled"
    proc = train_cli([*args, "callbacks.spike.action=rollback", "logger=wandb"], run, env=damaged)
    assert proc.returncode == 0, proc.stderr[-3000:]
    console = proc.stdout + proc.stderr
    assert "spike guard: loss scored from step 17 against the last 16 steps" in console, console
    assert "rolled back to step 20" in console and "rolled back to step 15" in console, console
    assert "WARNING" not in console and "monotonically" not in console, console
    block = read_summary(run)["spike"]
    assert block["rollbacks"] == [
        {"spike": 21, "to": 20, "came_back": False},
        {"spike": 21, "to": 15, "came_back": True},
    ]
    assert block["scored"] and block["scored_steps"] > 0 and block["count"] == 2
    assert block["events"][0]["data_resumes_at"]["samples"] > 0
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, 41))  # each step once: the abandoned ones dropped
    assert max(losses(run)) < 2 * losses(run)[0]  # the damaged steps are gone with their weights
    tail = lambda folder: sum(losses(folder)[-10:]) / 10  # noqa: E731  (the final loss: a step's alone is one batch's)
    assert tail(run) == pytest.approx(tail(tmp_path / "clean"), rel=0.10)
    (history,) = wandb_runs(run)
    assert history["steps"] == list(range(1, 41)), history["steps"]
    assert history["rerun"] == list(range(16, 22)), history["rerun"]  # steps 16-21 ran again from step 15
    columns = [tuple(c) for c in read_summary(run)["figure_columns"]]
    assert ("spikes", "spike", "count", "min") in columns and ("goodput", "goodput", "goodput", "max") in columns
    assert not read_summary(tmp_path / "clean")["spike"]["count"]


def test_skip_leaves_the_weights_as_a_run_that_never_applied_that_step(tmp_path, monkeypatch):
    """action=skip decides on the device; the run's weights after it are bitwise those of a run
    whose host skipped step 20's update outright (tests.probes.SkipAt): every later loss equal."""
    monkeypatch.setenv("HYDRADIST_FAULT", "0:19:spike")
    args = [*SMOKE, "steps=30", *SPIKE]
    train_in_process([*args, "callbacks.spike.action=skip"], tmp_path / "skip")
    train_in_process([*args, "+callbacks.at._target_=tests.probes.SkipAt", "+callbacks.at.step=19"], tmp_path / "host")
    got, want = read_metrics(tmp_path / "skip"), read_metrics(tmp_path / "host")
    assert [m["skipped"] for m in got] == [m["skipped"] for m in want] == [k == 19 for k in range(30)]
    assert [m["loss"] for m in got] == [m["loss"] for m in want]  # bit for bit
    assert got[19]["spike/flag"] == 1 and read_summary(tmp_path / "skip")["nonfinite_skipped"] == 1


def test_a_step_a_callback_skips_outright_is_no_spike(tmp_path):
    summary = train_in_process([*SMOKE, "steps=24", *SPIKE, "callbacks.spike.action=warn",
                                "+callbacks.at._target_=tests.probes.SkipAt", "+callbacks.at.step=19"], tmp_path)  # fmt: skip
    assert summary["spike"]["count"] == 0 and summary["nonfinite_skipped"] == 1


def test_a_device_skip_of_a_fused_sgd_leaves_it_as_if_that_step_never_came():
    """step_unless on the first step (no momentum yet) and a later one: as an optimizer that never
    took them (fused SGD takes the skip as found_inf once its state exists)."""
    from framework.optimizers.skip import step_unless

    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8))
    ref = torch.nn.Parameter(w.detach().clone())
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9, fused=True)
    want = torch.optim.SGD([ref], lr=0.1, momentum=0.9, fused=True)
    grads = [torch.randn(8) for _ in range(4)]
    for k, g in enumerate(grads):
        w.grad = g.clone()
        step_unless(opt, torch.tensor(k in (0, 2)), opt.step)
        if k not in (0, 2):
            ref.grad = g.clone()
            want.step()
    assert torch.equal(w, ref) and torch.equal(opt.state[w]["momentum_buffer"], want.state[ref]["momentum_buffer"])


def test_checksums_compare_the_replicas_of_hsdp_on_any_layout():
    validate(compose_config(["experiment=smoke", "parallel=fsdp", "parallel.dp_replicate=2",
                             "launch.nproc_per_node=4", "callbacks.checksum.every=10"]))  # fmt: skip


def test_warn_and_skip_add_no_host_sync(tmp_path, monkeypatch, capsys):
    base = [*SMOKE, "steps=24", "metrics.log_every=6", "metrics.sample_every=0", *SPIKE]
    monkeypatch.setenv("HYDRADIST_FAULT", "0:19:spike")
    without = count_syncs(monkeypatch, base, tmp_path / "off")
    monkeypatch.setenv("HYDRADIST_FAULT", "0:19:spike")
    with_skip = count_syncs(monkeypatch, [*base, "callbacks.spike.action=skip"], tmp_path / "skip")
    monkeypatch.setenv("HYDRADIST_FAULT", "0:19:spike")
    with_warn = count_syncs(monkeypatch, [*base, "callbacks.spike.action=warn"], tmp_path / "warn")
    assert with_skip == without == with_warn, (without, with_skip, with_warn)
    warned = read_metrics(tmp_path / "warn")  # lines every 6 steps: the event on step 24's
    assert [(m["step"], [e["step"] for e in m.get("spike/events", [])]) for m in warned] == [
        (6, []), (12, []), (18, []), (24, [20])]  # fmt: skip
    assert read_summary(tmp_path / "warn")["nonfinite_skipped"] == 0  # warned of, applied
    assert read_summary(tmp_path / "skip")["spike"]["events"][0]["action"] == "skip"
    assert "spike at step 20" in capsys.readouterr().out


def test_a_slow_rank_is_named_within_two_intervals_with_its_excess(tmp_path):
    """Rank 1 50 ms slower each step from step 6 (ddp x2): named by the console at the first or
    second report after (a rank is named at two slow reports in a row) and in W&B, its excess
    within 20% of 50 ms."""
    run = tmp_path / "run"
    proc = train_cli([*SMOKE, "steps=30", "callbacks.straggler.every=5"], run, env={"HYDRADIST_FAULT": "1:5:slow"},
                     wandb=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (logged,) = wandb_runs(run)  # W&B: each report as it comes (its history's last), and the run's goodput
    assert {"straggler/slowest_rank", "straggler/excess_s", "goodput/goodput"} <= logged["summary"], logged["summary"]
    named = [line for line in proc.stdout.splitlines() if line.startswith("straggler at step")]
    assert named and named[0].startswith(("straggler at step 10: rank 1", "straggler at step 15: rank 1")), named
    history = read_summary(run)["straggler"]["history"]
    late = [h for h in history if h["step"] >= 10]
    assert all(h["slowest_rank"] == 1 for h in late), history
    excess = sorted(h["excess_s"] for h in late)[len(late) // 2]
    assert excess == pytest.approx(0.05, rel=0.2), history


def test_a_flipped_bit_in_one_replica_is_caught_named_and_rolled_back(tmp_path):
    """ddp x3: one bit of rank 1's weights flipped before step 8; the check after step 10 names
    rank 1 against the two others, the run rolls back to the step-5 checkpoint (identical weights
    again) and finishes, every later check agreeing."""
    run = tmp_path / "run"
    args = [*SMOKE, "steps=20", "launch.nproc_per_node=3", "checkpoint.every=5",
            "callbacks.checksum.every=5", "callbacks.checksum.on_mismatch=rollback"]  # fmt: skip
    proc = train_cli(args, run, env={"HYDRADIST_FAULT": "1:7:bitflip"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "silent data corruption after step 10: the weights of rank(s) 1 against the others" in proc.stdout
    block = read_summary(run)["checksum"]
    assert block["mismatches"] == [{"step": 10, "ranks": [1], "replicas": [0, 1, 2], "action": "rollback"}]
    assert block["checks"] >= 4


def test_a_mismatch_between_two_replicas_stops_the_run_naming_both(tmp_path):
    proc = train_cli([*SMOKE, "steps=10", "callbacks.checksum.every=5"], tmp_path / "run",
                     env={"HYDRADIST_FAULT": "0:2:bitflip"})  # fmt: skip
    assert proc.returncode != 0
    assert "silent data corruption after step 5: the weights of rank(s) 0, 1 (no majority" in proc.stderr + proc.stdout


def test_goodput_accounts_for_the_wall_time_of_a_run_with_a_restart_saves_and_an_evaluation(tmp_path):
    """Rank 1 dies before step 11; the workers restart from the step-7 checkpoint. The parts of
    summary.goodput sum to its wall time within 5%, that wall time is the job's (as timed from
    outside), and each part shows where it should: two saves, a load, an evaluation, the restart."""
    run = tmp_path / "run"
    args = [*SMOKE, "steps=14", "checkpoint.every=7", "launch.max_restarts=1", "eval.every=7",
            "data.val_fraction=0.1", "eval.steps=2"]  # fmt: skip
    t0 = time.time()
    proc = train_cli(args, run, env={"HYDRADIST_FAULT": "1:10"})
    outside = time.time() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    g = read_summary(run)["goodput"]
    parts = {k: v for k, v in g.items() if k.endswith("_s") and k != "wall_s"}
    assert sum(parts.values()) == pytest.approx(g["wall_s"], rel=0.05), g
    assert 0.6 * outside < g["wall_s"] <= outside, (g["wall_s"], outside)
    for part in ("productive_s", "startup_s", "checkpoint_save_s", "checkpoint_load_s", "evaluation_s",
                 "restart_lost_s"):  # fmt: skip
        assert g[part] > 0, (part, g)
    assert g["goodput"] == pytest.approx(g["productive_s"] / g["wall_s"]) and 0 < g["goodput"] < 1
    assert all(math.isfinite(v) and v >= 0 for v in parts.values()), g
