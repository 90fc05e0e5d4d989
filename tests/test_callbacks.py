"""Callbacks by `_target_` (framework/callbacks, docs/callbacks.md): docs/callbacks.md's own `StopAt`,
copied out of the repository into a package of its own, under ddp, fsdp and pp: it sees every
step, its figure lands in metrics.jsonl, W&B and summary.json, it stops the run at the step it
picks, and its state resumes from a checkpoint. Bad entries are refused in one line before any
worker starts; the figure registry packs sum/max/min/mean into one all-reduce."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
import torch

from framework.config import ConfigError, validate
from framework.figures import Figure, FigureError, Registry
from tests.helpers import ROOT, compose_config, read_metrics, read_summary, train_cli, wandb_runs

SMOKE = ["experiment=smoke", "steps=6", "data.batch_size=4"]
LAYOUTS = {
    "ddp": ["parallel=ddp", "launch.nproc_per_node=2"],
    "fsdp": ["parallel=fsdp", "launch.nproc_per_node=2"],
    "pp": ["parallel=pp", "launch.nproc_per_node=2", "parallel.n_microbatches=2"],
}


def docs_example() -> str:
    """The python block of docs/callbacks.md that defines StopAt."""
    text = (ROOT / "docs" / "callbacks.md").read_text()
    return next(b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "class StopAt" in b)


@pytest.fixture(scope="module")
def user_package(tmp_path_factory):
    """docs/callbacks.md's StopAt as a user's own package, outside the repository."""
    root = tmp_path_factory.mktemp("site")
    (root / "userpkg").mkdir()
    (root / "userpkg" / "__init__.py").write_text("")
    (root / "userpkg" / "callbacks.py").write_text(docs_example())
    return {"PYTHONPATH": str(root)}


def stop_at(n: int) -> list[str]:
    return ["+callbacks.mine._target_=userpkg.callbacks.StopAt", f"+callbacks.mine.stop_at={n}"]


# ddp in the long tier: fsdp and pp reach the same hooks through the sharded and the staged step
@pytest.mark.parametrize("layout", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp", "pp"])
def test_a_users_callback_sees_every_step_adds_a_figure_stops_the_run_and_resumes(layout, user_package, tmp_path):
    """StopAt(3) from a package outside the repository, checkpoints every 2 steps: three lines,
    `user/seen` 1, 2, 3 in metrics.jsonl and `user/seen_ranks` 2, 4, 6 (summed over the 2 ranks:
    every rank saw every step), their last in summary.json and in W&B; resumed from step 2 into a
    new run with StopAt(5), it counts on from its checkpoint (3, 4, 5), not from 0."""
    first, resumed, world = tmp_path / "first", tmp_path / "resumed", 2
    proc = train_cli([*SMOKE, *LAYOUTS[layout], *stop_at(3), "checkpoint.every=2"], first, env=user_package, wandb=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, summary = read_metrics(first), read_summary(first)
    seen = [(m["step"], m["user/seen"], m["user/seen_ranks"]) for m in metrics]
    assert seen == [(s, s, s * world) for s in (1, 2, 3)]
    assert summary["status"] == "ok" and summary["figures"]["user/seen"] == 3
    assert summary["figures"]["user/seen_ranks"] == 3 * world and summary["choices"]["callbacks"] == "default"
    assert summary["choices"]["peft"] == "none"  # every group's choice, peft's too
    (run,) = wandb_runs(first)
    assert {"user/seen", "user/seen_ranks"} <= run["summary"], run["summary"]
    proc = train_cli([*SMOKE, *LAYOUTS[layout], *stop_at(5), f"checkpoint.resume={first / 'checkpoints' / 'step-000002'}"],
                     resumed, env=user_package)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [(m["step"], m["user/seen"], m["user/seen_ranks"]) for m in read_metrics(resumed)]
    assert seen == [(s, s, s * world) for s in (3, 4, 5)]


def test_the_docs_example_is_a_callback_the_config_check_accepts(user_package, monkeypatch):
    monkeypatch.syspath_prepend(user_package["PYTHONPATH"])
    validate(compose_config(["experiment=smoke", *stop_at(2)]))


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["+callbacks.mine._target_=nopkg.Nothing"], "callbacks.mine._target_", "does not import"),
        (["+callbacks.mine._target_=collections.OrderedDict"], "callbacks.mine._target_", "defines no hook"),
        (["+callbacks.mine._target_=tests.test_callbacks.Twice"], "callbacks.mine.figures", "declared twice"),
        (["+callbacks.mine._target_=tests.test_callbacks.Spread"], "callbacks.mine.figures", "reduce='spread'"),
        (["+callbacks.mine._target_=tests.test_callbacks.Spread", "+callbacks.mine.wrong=1"], "callbacks.mine.wrong",
         "takes no arguments"),
        (["+callbacks.mine._target_=tests.test_callbacks.Needs"], "callbacks.mine.n", "not set"),
        (["+callbacks.mine._target_=tests.test_callbacks.Clash"], "callbacks.mine.figures", "framework's own"),
        (["+callbacks.mine._target_=tests.test_callbacks.Missing"], "callbacks.mine._target_", "has no class"),
        (["+callbacks.eval._target_=tests.test_callbacks.Twice"], "callbacks.eval", "framework's own"),
    ],
)  # fmt: skip
def test_bad_callback_entries_are_one_line_naming_the_key(overrides, key, says):
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["experiment=smoke", *overrides]))
    assert err.value.key == key and says in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_bad_entry_stops_train_py_before_any_worker_starts(tmp_path):
    proc = train_cli([*SMOKE, "+callbacks.mine._target_=nopkg.Nothing"], tmp_path / "run")
    assert proc.returncode == 2 and "callbacks.mine._target_" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "run" / "metrics.jsonl").exists()


class Twice:
    figures = (Figure("user/a"), {"name": "user/a", "reduce": "max"})

    def on_step_end(self, step):
        return {"user/a": 1.0}


class Spread:
    figures = ({"name": "user/b", "reduce": "spread"},)

    def __init__(self):
        pass

    def on_step_end(self, step):
        return {"user/b": 1.0}


class Needs:
    def __init__(self, n: int):
        self.n = n

    def on_start(self, step):
        pass


class Clash:  # a figure named as the evaluation's
    figures = ({"name": "val_loss", "reduce": "max"},)

    def on_step_end(self, step):
        return {"val_loss": 1.0}


def test_one_all_reduce_carries_sum_max_min_and_mean():
    """Two ranks' packed vectors, summed as the all-reduce sums them, read back: sum and mean per
    value, max and min from a row each rank fills alone; a vector figure keeps its width."""
    reg = Registry(world=2)
    for f in (Figure("s"), Figure("hi", reduce="max"), Figure("lo", reduce="min"), Figure("avg", reduce="mean"),
              Figure("v", width=3), Figure("derived", reduce=None)):  # fmt: skip
        reg.declare(f, "test")
    ranks = [{"s": 1.0, "hi": 5.0, "lo": -2.0, "avg": 4.0, "v": [1, 2, 3]},
             {"s": 2.0, "hi": 7.0, "lo": 3.0, "avg": 8.0, "v": [10, 20, 30]}]  # fmt: skip
    summed = sum(reg.pack(values, rank, torch.device("cpu")) for rank, values in enumerate(ranks))
    assert reg.read(summed.tolist()) == {"s": 3.0, "hi": 7.0, "lo": -2.0, "avg": 6.0, "v": [11.0, 22.0, 33.0]}
    device = reg.totals(summed)
    assert device["hi"].item() == 7.0 and device["v"].tolist() == [11.0, 22.0, 33.0]
    with pytest.raises(FigureError, match="declared twice"):
        reg.declare(Figure("s"), "another")
    steps = [{"s": 1.0, "v": [1, 1, 1]}, {"s": 3.0, "v": [2, 2, 2]}]
    reg.figures["s"] = Figure("s", summary=("mean", "last", "max"))
    assert reg.summarize(steps)["figures"] == {"s": 2.0, "s_last": 3.0, "s_max": 3.0, "v": [1.5, 1.5, 1.5]}


def test_the_docs_hooks_are_the_contracts():
    from framework.hooks import HOOKS

    table = (ROOT / "docs" / "callbacks.md").read_text()
    assert all(f"`{hook}(" in table for hook in HOOKS), [h for h in HOOKS if f"`{h}(" not in table]
    assert textwrap.dedent(docs_example()).count("def ") >= 5


def test_a_callback_saves_skips_an_update_and_rolls_back(tmp_path):
    """tests.probes.Requests under ddp x2: the checkpoint it asked for after step 1; step 2's update
    not applied (skipped: true, counted); after step 4 the run goes back to that checkpoint and
    replays steps 2-4 bit for bit (the same weights, data and random state), then step 5;
    metrics.jsonl holds each step once, and the LR the callback set for each step (issue 68: the
    logged LR is the one applied, whoever set it)."""
    run = tmp_path / "run"
    proc = train_cli([*SMOKE, *LAYOUTS["ddp"], "steps=5", "+callbacks.ask._target_=tests.probes.Requests"], run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (run / "checkpoints" / "step-000001").is_dir() and "rolled back to step 1" in proc.stdout
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5] and [m["skipped"] for m in metrics][:3] == [
        False,
        True,
        False,
    ]
    assert read_summary(run)["nonfinite_skipped"] == 1
    assert [m["lr"] for m in metrics] == pytest.approx([1e-3 * k for k in range(1, 6)])
    seen = [tuple(s) for s in json.loads((run / "losses-rank0.json").read_text())]
    assert [s for s, _ in seen] == [1, 2, 3, 4, 2, 3, 4, 5]
    assert seen[1:4] == seen[4:7], seen  # the replay: the same losses, bit for bit


def test_a_stop_asked_on_one_rank_before_the_all_reduce_stops_every_rank_at_the_settle(tmp_path):
    """Rank 1 alone asks to stop in on_step_end of step 2, a step that does not settle
    (metrics.log_every=4): the request rides that step's all-reduce, and every rank stops after
    step 4, the next settle (no rank goes on to wait for the others)."""
    run = tmp_path / "run"
    args = [*SMOKE, *LAYOUTS["ddp"], "steps=8", "metrics.log_every=4", "metrics.sample_every=0",
            "+callbacks.ask._target_=tests.probes.StopOnOneRank", "+callbacks.ask.at=1"]  # fmt: skip
    proc = train_cli(args, run, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [m["step"] for m in read_metrics(run)] == [4] and "stopped after step 4 of 8" in proc.stdout
    assert read_summary(run)["stopped"]["after_step"] == 4
