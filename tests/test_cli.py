"""train.py as a user runs it: a real run end to end, sweeps, bad input and worker failures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import ROOT, read_metrics, read_summary, train_cli

SUMMARY_KEYS = {
    "status", "choices", "world_size", "global_batch_size", "steps", "first_loss", "final_loss",
    "throughput", "step_time_s", "mfu", "memory", "comm", "load_balance",
}  # fmt: skip


def test_smoke_run_trains_across_two_workers_and_logs_to_wandb_offline(tmp_path):
    run = tmp_path / "run"
    proc = train_cli(["experiment=smoke", "steps=12", "progress=true"], run, wandb=True)
    assert proc.returncode == 0, proc.stderr[-3000:]

    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == list(range(1, 13))
    for key in ("loss", "lr", "grad_norm", "step_time_s", "samples_per_s", "tokens_per_s"):
        assert all(m[key] is not None for m in metrics), key

    summary = read_summary(run)
    assert SUMMARY_KEYS <= set(summary)
    assert summary["status"] == "ok" and summary["world_size"] == 2
    assert summary["global_batch_size"] == 2 * 4
    assert summary["choices"]["parallel"] == "ddp" and summary["choices"]["experiment"] == "smoke"
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["throughput"]["tokens_per_s"] > 0
    assert set(summary["memory"]) >= {
        "param_bytes",
        "grad_bytes",
        "optim_bytes",
        "activation_bytes",
        "device_peak_bytes",
    }
    assert summary["memory"]["param_bytes"] > 0 and summary["memory"]["activation_bytes"] > 0
    assert summary["load_balance"]["imbalance"] == pytest.approx(1.0)

    # one run directory for the run, not one per rank; one offline W&B run that `wandb sync` can upload
    assert not list(run.glob("rank*"))
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb"))
    assert f"wandb sync {offline[0]}" in proc.stdout
    assert "it/s" in proc.stderr or "s/it" in proc.stderr  # the progress bar, rank 0 only
    assert (proc.stderr.count("12/12")) >= 1


# train.py with Hydra's config loader counted: every composition of the config, whoever asks
COUNTED = """
import atexit, runpy, sys
from hydra._internal.config_loader_impl import ConfigLoaderImpl
composed, load = [], ConfigLoaderImpl.load_configuration
ConfigLoaderImpl.load_configuration = lambda self, *a, **k: composed.append(1) or load(self, *a, **k)
atexit.register(lambda: print(f"composed {len(composed)} time(s)", file=sys.stderr))
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_plain_run_composes_its_config_once_and_says_when_its_workers_started(tmp_path):
    """`python train.py OVERRIDES` composes once (Hydra's own path composed twice more, and the
    overrides' check once before it); the summary splits the start-up: launch_s (to the workers)
    within startup_s (to the end of the first step)."""
    import subprocess
    import sys

    run = tmp_path / "run"
    cmd = [sys.executable, "-c", COUNTED, str(ROOT / "train.py"), "experiment=smoke", "steps=1", "logger=none",
           f"hydra.run.dir={run}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "composed 1 time(s)" in proc.stderr, proc.stderr[-2000:]
    assert (run / ".hydra" / "config.yaml").is_file() and (run / ".hydra" / "overrides.yaml").is_file()
    summary = read_summary(run)
    assert summary["status"] == "ok" and 0 < summary["launch_s"] < summary["startup_s"], summary
    # a misspelt key still is one line before anything starts, and a sweep keeps Hydra's path
    proc = subprocess.run([*cmd[:4], "stepz=1"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "stepz: no such key" in proc.stderr, proc.stderr[-2000:]


def test_multirun_sweeps_strategies_each_job_its_own_group_and_summary(tmp_path):
    sweep = tmp_path / "sweep"
    proc = train_cli(
        ["-m", "experiment=smoke", "steps=3", "logger=none", "parallel=none,ddp", "precision=fp32,bf16",
         f"hydra.sweep.dir={sweep}"]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert len(summaries) == 4
    seen = {(s["choices"]["parallel"], s["choices"]["precision"]) for s in summaries}
    assert seen == {("none", "fp32"), ("none", "bf16"), ("ddp", "fp32"), ("ddp", "bf16")}
    for s in summaries:
        assert s["status"] == "ok"
        assert s["world_size"] == (1 if s["choices"]["parallel"] == "none" else 2)


@pytest.mark.parametrize(
    "args,key",
    [
        (["launch.nproc_per_node=0"], "launch.nproc_per_node"),
        (["backend=nccl"], "backend"),
        (["steps=-1"], "steps"),
        (["steps=abc"], "steps"),
        (["model=lstm"], "data"),
        (["plan.gpu=B300"], "plan.gpu"),
    ],
)
def test_bad_input_is_one_clear_message_and_no_worker_starts(tmp_path, args, key):
    """Two cases run train.py as a process: a value the launcher's check (validate) refuses, which
    train.py prints as one `error:` line before any worker (as for every value that check refuses:
    tests/test_bad_inputs.py runs more), and one Hydra cannot merge (train.py's override check). The
    others are put to the same check in this process (a train.py start each saved)."""
    if args not in (["launch.nproc_per_node=0"], ["steps=abc"]):
        from tests.test_front_doors import refused

        err = refused(["logger=none", *args])
        assert err.key == key and str(err).startswith(f"{key}: ") and "\n" not in str(err), str(err)
        return
    run = tmp_path / "run"
    proc = train_cli(["logger=none", *args], run)
    assert proc.returncode != 0
    assert key in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (run / "metrics.jsonl").exists() and not (run / "summary.json").exists()


def test_worker_failure_exits_nonzero_and_shows_the_workers_error(tmp_path):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abc")  # fewer bytes than one training sequence: each worker fails to build data
    run = tmp_path / "run"
    proc = train_cli(["experiment=smoke", "logger=none", f"data.path={tiny}"], run)
    assert proc.returncode != 0
    assert re.search(r"worker rank \d failed", proc.stderr)
    assert "fewer than seq_len+1" in proc.stderr
    assert read_summary(run)["status"] == "failed"


def test_default_corpus_is_read_locally():
    from framework.data.datasets import default_corpus_files

    files = default_corpus_files()
    assert files and all(Path(f).suffix == ".py" for f in files)
    assert (ROOT / "conf" / "data" / "text.yaml").exists()


@pytest.mark.parametrize("init", ["env", "file"])
def test_backend_knobs_reach_the_workers_and_init_methods_work(tmp_path, init):
    run = tmp_path / "run"
    method = "env" if init == "env" else f"file://{tmp_path}/rendezvous"
    args = ["experiment=smoke", "logger=none", "steps=2", "backend=gloo", "backend.nccl.algo=Tree",
            "backend.nccl.socket_ifname=eth0", f"backend.init_method={method}"]  # fmt: skip
    proc = train_cli(args, run)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # set knobs exported into the workers' environment; unset ones stay unset
    assert read_summary(run)["backend_env"] == {
        "NCCL_ALGO": "Tree",
        "NCCL_SOCKET_IFNAME": "eth0",
        "TORCH_FR_BUFFER_SIZE": "2000",  # the flight recorder, on by default (backend.trace_buffer)
    }
    assert "algo: Tree" in (run / ".hydra" / "config.yaml").read_text()


@pytest.mark.slow
def test_the_default_job_learns(tmp_path):
    """`python train.py` with no arguments (W&B offline): gpt on the stdlib source, 2 workers, DDP."""
    run = tmp_path / "run"
    proc = train_cli([], run, wandb=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run)
    assert summary["choices"]["parallel"] == "ddp" and summary["world_size"] == 2
    assert summary["final_loss"] < 0.9 * summary["first_loss"]


def test_under_torchrun_each_process_is_a_worker_and_the_run_has_one_directory(tmp_path):
    import os
    import subprocess
    import sys

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run([*torchrun, str(ROOT / "train.py"), "experiment=smoke", "logger=none", "steps=3", "device=cpu"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "outputs").glob("*/*"))
    assert len(runs) == 1 and runs[0].name.startswith("torchrun-")  # not one per rank
    assert read_summary(runs[0])["world_size"] == 2 and len(read_metrics(runs[0])) == 3


README_STRATEGIES = [
    ["parallel=ddp", "precision=amp", "accumulation_steps=4"],
    ["parallel=fsdp"],
    ["parallel=fsdp", "parallel.version=1"],
    ["parallel=tp"],
    ["parallel=pp", "parallel.schedule=Interleaved1F1B", "model.n_layer=4"],
    ["parallel=hybrid", "launch.nproc_per_node=4"],
    ["parallel=fsdp", "parallel.pp=2", "parallel.tp=2", "launch.nproc_per_node=4"],
    ["parallel=ddp", "memory=checkpoint", "parallel.comm_hook=bf16"],
]


# the 4-rank examples, FSDP1 and the interleaved pipeline in `make test-all`; their layouts meet
# one process in the matrix (the default run keeps 1F1B's pp through the matrix and the README).
# Plain fsdp there too: the default run reads the README's own-model example under fsdp for
# warnings (tests/test_readme.py, its TinyLM rather than the smoke gpt)
LONG_EXAMPLES = ("launch.nproc_per_node=4", "parallel.version=1", "parallel.schedule=Interleaved1F1B")


def long_example(args: list[str]) -> bool:
    return bool(set(LONG_EXAMPLES) & set(args)) or args == ["parallel=fsdp"]


@pytest.mark.parametrize(
    "args",
    [pytest.param(a, marks=pytest.mark.slow) if long_example(a) else a for a in README_STRATEGIES],
    ids=lambda a: " ".join(a),
)
def test_strategy_examples_print_no_warnings(tmp_path, args):
    """The README's strategy examples run clean: a warning is fixed at its cause or explained in
    the README, never left for users to wonder about."""
    proc = train_cli(["experiment=smoke", "logger=none", "steps=2", *args], tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in (proc.stdout + proc.stderr).splitlines() if "Warning" in line or "WARNING" in line]
    assert not warnings, warnings[:5]
