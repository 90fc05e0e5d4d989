"""The structure's own parts, without processes: the strategy object's answers and the run
record (summary.json) that only framework/run/run_files.py writes and reads."""

from __future__ import annotations

import ast
import json
import signal

import pytest
from omegaconf import OmegaConf

from framework.parallel.dims import ParallelDims, Strategy
from framework.run.run_files import SUMMARY_FILE, Summary, read_summary, write_summary
from tests.helpers import ROOT


@pytest.mark.parametrize(
    "name, version, answers",
    [  # one_process, needs_backend, on_mesh, fsdp1
        ("none", 2, (True, False, False, False)),
        ("dp", 2, (False, False, False, False)),
        ("ddp", 1, (False, True, False, False)),  # a version does not make DDP an FSDP
        ("fsdp", 2, (False, True, True, False)),
        ("fsdp", 1, (False, True, True, True)),
        ("tp", 2, (False, True, True, False)),
        ("pp", 2, (False, True, True, False)),
        ("hybrid", 1, (False, True, True, True)),
    ],
)
def test_the_strategy_answers_from_its_name_and_version(name, version, answers):
    s = Strategy.of(OmegaConf.create({"name": name, "version": version}))
    assert (s.one_process, s.needs_backend, s.on_mesh, s.fsdp1) == answers
    # materialised after wrapping only where the wrapper shards or splits a meta model in place
    assert s.materialise_late(on_meta=True) == (s.on_mesh and not s.fsdp1)
    assert not s.materialise_late(on_meta=False)


def test_fsdp_shards_even_on_one_rank_and_tp_only_with_data_parallel_ranks():
    one = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)
    tp2 = ParallelDims(dp_replicate=1, dp_shard=1, tp=2, pp=1, world_size=2)
    dp2 = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=1, world_size=4)
    assert Strategy("fsdp").shards(one) and not Strategy("tp").shards(tp2) and Strategy("hybrid").shards(dp2)
    assert not Strategy("ddp").shards(dp2)  # not on a mesh: DDP replicates
    assert Strategy.of(OmegaConf.create({"name": "ddp"})).version == 2  # a group without FSDP's key


def test_the_strategy_counts_the_devices_its_ranks_compute_on():
    import torch

    assert [Strategy(n).devices(4) for n in ("ddp", "fsdp", "tp", "pp", "hybrid")] == [4] * 5  # one per rank
    assert Strategy("none").devices(1) == 1
    assert Strategy("dp").devices(1) == torch.cuda.device_count()  # one process drives every visible GPU


@pytest.mark.parametrize(
    "summary",
    [
        Summary("ok", {"parallel": "ddp"}, figures={"steps": 3, "checkpoint": {"saves": 1}, "final_loss": 1.5}),
        Summary.failed(ValueError("bad"), {"parallel": "fsdp"}),
        Summary("preempted", {"parallel": "ddp"}, step=4, checkpoint="/c/step_4", signal="SIGTERM"),
        Summary("aborted", {}, error="RuntimeError: a peer failed"),
    ],
)
def test_every_status_round_trips_through_the_one_file(tmp_path, summary):
    write_summary(str(tmp_path), summary)
    on_disk = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert on_disk["status"] == summary.status and on_disk["choices"] == summary.choices
    assert read_summary(tmp_path) == summary
    assert not list(tmp_path.glob("*.tmp"))  # written atomically: no temporary left


def test_summary_keys_stay_at_the_top_level_of_the_file(tmp_path):
    write_summary(str(tmp_path), Summary("preempted", {"parallel": "ddp"}, step=4, checkpoint="/c", signal="SIGINT"))
    assert json.loads((tmp_path / SUMMARY_FILE).read_text()) == {
        "status": "preempted", "choices": {"parallel": "ddp"}, "step": 4, "checkpoint": "/c", "signal": "SIGINT",
    }  # fmt: skip
    assert Summary.failed(KeyError("x"), {}).to_dict() == {"status": "failed", "error": "KeyError: 'x'", "choices": {}}


def test_a_missing_or_broken_summary_reads_as_none_and_an_unknown_status_is_refused(tmp_path):
    assert read_summary(tmp_path) is None
    (tmp_path / SUMMARY_FILE).write_text("{not json")
    assert read_summary(tmp_path) is None
    (tmp_path / SUMMARY_FILE).write_text('{"status": "done"}')
    assert read_summary(tmp_path) is None
    with pytest.raises(ValueError, match="allowed: ok, failed, preempted, aborted"):
        Summary("done", {})


def test_only_run_files_names_the_summary_file():
    """One writer and one reader: no other framework module opens summary.json by its name."""
    named = []
    for path in sorted((ROOT / "framework").rglob("*.py")):
        if path.name == "run_files.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip() == SUMMARY_FILE:
                named.append(str(path.relative_to(ROOT)))
    assert not named, named


# ----------------------------------------------------------------------------- local workers


def _what_a_worker_sees(tag: str) -> tuple:
    import multiprocessing
    import os
    import signal
    import sys

    sigterm = signal.getsignal(signal.SIGTERM)
    method = multiprocessing.get_start_method()
    return (
        tag,
        os.environ.get("HYDRADIST_PROBE"),
        os.environ["RANK"],
        os.getcwd(),
        sys.path[-1],
        sigterm,
        method,
        ("framework.run.trainer" in sys.modules),
    )


def test_workers_see_the_callers_environment_as_it_is_at_each_launch(tmp_path, monkeypatch):
    """Workers fork from a forkserver started at the first launch, which keeps that moment's
    environment: each launch still hands its workers the caller's environment, sys.path and
    working directory as they are now, SIGTERM at its default (the forkserver ignores it), the
    platform's start method for processes of its own, and the trainer already imported (what the
    forkserver is for)."""
    import sys

    from framework.machine import launch_local

    monkeypatch.setenv("HYDRADIST_PROBE", "first")
    first = launch_local(2, _what_a_worker_sees, "a")
    monkeypatch.setenv("HYDRADIST_PROBE", "second")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [*sys.path, str(tmp_path)])
    second = launch_local(2, _what_a_worker_sees, "b")
    for rank in (0, 1):
        assert first[rank][:3] == ("a", "first", str(rank)) and first[rank][-1]
        assert second[rank][:5] == ("b", "second", str(rank), str(tmp_path), str(tmp_path))
        assert second[rank][5] == signal.SIG_DFL and second[rank][-1]
        assert second[rank][6] == "fork"  # what its DataLoader workers start with, as under torchrun


def test_the_peak_read_from_outside_includes_the_forked_workers(tmp_path):
    """`/usr/bin/time -f %M` (POSIX wait4) sees the largest process among those waited for: the
    launcher waits for the forkserver at exit, so a forked worker's peak reaches it as a spawned
    one's does (here a worker that holds 1.5 GB, far above the launcher's own)."""
    import os
    import sys

    from framework.measure.memory import peak_rss_of

    code = (
        "from framework.machine import launch_local\n"
        "def hold():\n"
        "    import torch\n"
        "    x = torch.ones(384 * 2**20)  # 1.5 GB of fp32\n"
        "    return float(x[0])\n"
        "if __name__ == '__main__':\n"
        "    assert launch_local(1, hold) == {0: 1.0}\n"
    )
    script = tmp_path / "hold.py"
    script.write_text(code)
    peak = peak_rss_of([sys.executable, str(script)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert peak > 1536 * 2**20, peak / 2**20


def _wrappers_alive_after_a_run(config: dict, run_dir: str) -> list[str]:
    import gc

    import torch
    from omegaconf import OmegaConf

    from framework.run.trainer import run

    run(OmegaConf.create(config), run_dir, {"parallel": config["parallel"]["name"]})
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.distributed.fsdp.FSDPModule)
    return sorted({type(o).__name__ for o in gc.get_objects() if isinstance(o, wrappers)})


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_run_frees_its_process_groups_while_the_interpreter_is_whole(tmp_path, strategy):
    """A wrapper sits in a reference cycle and holds its process group: left to the interpreter's
    shutdown, Gloo's threads are torn down there and a torchrun worker (which, unlike a forked
    one, runs that shutdown) aborted now and then with SIGABRT after training correctly. When a
    run returns, no wrapper is left."""
    from framework.machine import launch_local
    from tests.helpers import world_config

    config = world_config(["experiment=smoke", "logger=none", "steps=2", f"parallel={strategy}"], 2)
    left = launch_local(2, _wrappers_alive_after_a_run, config, str(tmp_path))
    assert left == {0: [], 1: []}
