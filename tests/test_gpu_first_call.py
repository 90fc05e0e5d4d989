"""The first GPU run cannot fail (issue 37): what it times, flags, binds and fuses, decided by
functions tested here on CPU with the values a GPU machine would give them; and gpu.py's rows,
each saved as it finishes, a failing row leaving the rows before and after it written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from framework.dist import bound_device, cuda_device_index, slurm_binds_gpus
from framework.figures import Registry
from framework.measure.metrics import above_ceiling
from framework.optimizers.build import fuses
from framework.run.ledger import Ledger
from framework.run.step import PendingStep

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- a window's time


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def settle_with_device(ledger: Ledger, clock: Clock, device_done_at: float, monkeypatch) -> list:
    real_stack = torch.stack

    class Synced:
        def __init__(self, tensor):
            self.tensor = tensor

        def tolist(self):
            clock.now = max(clock.now, device_done_at)  # the host waits here for the device
            return self.tensor.tolist()

    monkeypatch.setattr(torch, "stack", lambda ts: Synced(real_stack(ts)))
    try:
        return ledger.settle()
    finally:
        monkeypatch.setattr(torch, "stack", real_stack)


def add_step(ledger: Ledger, clock: Clock, step: int, host_s: float) -> None:
    started = ledger.clock()
    clock.now += host_s  # the host queues the step's kernels and goes on
    values = torch.tensor([2.0, 1.0, 16.0, 2.0, 1.0, 1.0, float("nan")])  # the loop's own (step.CORE)
    data = SimpleNamespace(tokens_in=lambda b: 16, slots_in=lambda b: 16)
    ledger.add(PendingStep(values, False, started), step, [(0, (None, torch.zeros(2)))], data)


def test_a_windows_seconds_are_the_wall_time_between_syncs_not_the_hosts(monkeypatch):
    """Four steps the host queues in 10 ms each, which the device finishes 2 s after the window
    began: each step is 0.5 s (the host's 10 ms would read tokens/s and MFU 50x high)."""
    clock = Clock()
    ledger = Ledger(sequence_data=True, figures=Registry(), clock=clock)
    begin = clock.now
    for step in range(4):
        add_step(ledger, clock, step, host_s=0.01)
    settled = settle_with_device(ledger, clock, device_done_at=begin + 2.0, monkeypatch=monkeypatch)
    assert [e.figures.seconds for e in settled] == pytest.approx([0.5] * 4)
    assert [e.step for e in settled] == [0, 1, 2, 3] and settled[0].figures.tokens == 16

    # an evaluation or a checkpoint between windows is in neither: the next window starts at its first step
    clock.now += 30.0
    begin = clock.now
    add_step(ledger, clock, 4, host_s=0.01)
    (entry,) = settle_with_device(ledger, clock, device_done_at=begin + 0.25, monkeypatch=monkeypatch)
    assert entry.figures.seconds == pytest.approx(0.25)


def test_a_cpu_window_is_the_steps_own_time():
    """On a CPU the device is done when the host is: the window is the steps' host time."""
    clock = Clock()
    ledger = Ledger(sequence_data=False, figures=Registry(), clock=clock)
    for step, host_s in enumerate((0.3, 0.1)):
        add_step(ledger, clock, step, host_s)
    settled = ledger.settle()
    assert [e.figures.seconds for e in settled] == pytest.approx([0.2, 0.2])
    assert settled[0].figures.tokens is None and settled[0].figures.samples == 2


# --------------------------------------------------------------------------- MFU above the ceiling


def test_an_mfu_above_the_measured_matmul_ceiling_is_flagged_not_reported():
    h200_bf16 = 989e12  # the datasheet's dense bf16 peak
    assert above_ceiling(0.55, h200_bf16, ceiling_tflops=790) is None  # 544 TFLOP/s: below 790
    flag = above_ceiling(0.85, h200_bf16, ceiling_tflops=790)  # 841 TFLOP/s: more than the matmul reached
    assert flag and "79.9%" in flag and "metrics.ceiling_tflops=790" in flag
    assert above_ceiling(0.85, h200_bf16, ceiling_tflops=None) is None  # no measurement: nothing to judge by
    assert above_ceiling(None, h200_bf16, ceiling_tflops=790) is None  # no MFU (no peak known, an image model)


def test_the_summary_withholds_an_impossible_mfu(tmp_path):
    """A real run told a ceiling below what it achieves: summary.json has no MFU and says why."""
    from tests.helpers import train_in_process

    common = ["experiment=smoke", "steps=3", "model.n_layer=1", "model.n_embd=32", "data.seq_len=16",
              "metrics.peak_tflops=1e-3", "metrics.sample_every=0"]  # fmt: skip
    honest = train_in_process([*common, "metrics.ceiling_tflops=1e3"], tmp_path / "honest")
    assert honest["mfu"] is not None and honest["mfu_flag"] is None
    flagged = train_in_process([*common, "metrics.ceiling_tflops=1e-9"], tmp_path / "flagged")
    assert flagged["mfu"] is None and flagged["hfu"] is None
    assert "above the measured matmul ceiling" in flagged["mfu_flag"]


# --------------------------------------------------------------------------- devices


def test_more_local_ranks_than_visible_gpus_is_refused():
    assert [cuda_device_index(r, 8, 8) for r in range(8)] == list(range(8))  # torchrun on 8 GPUs
    assert [cuda_device_index(r, 2, 8) for r in range(2)] == [0, 1]  # fewer ranks than GPUs
    with pytest.raises(RuntimeError, match=r"2 ranks on this node but 1 CUDA device\(s\).*at most 1"):
        cuda_device_index(1, 2, 1)  # two ranks on the one H200
    # SLURM's per-task binding: each task sees its own GPU(s), renumbered from 0
    assert [cuda_device_index(r, 4, 1, bound=True) for r in range(4)] == [0, 0, 0, 0]
    assert [cuda_device_index(r, 4, 2, bound=True) for r in range(4)] == [0, 0, 0, 0]
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES"):
        cuda_device_index(0, 1, 0)
    assert slurm_binds_gpus({"SLURM_GPUS_PER_TASK": "1"}) and slurm_binds_gpus({"SLURM_GPU_BIND": "closest"})
    assert not slurm_binds_gpus({"SLURM_LOCALID": "1"})


def test_nccl_gets_the_ranks_device_and_gloo_none():
    assert bound_device(torch.device("cuda", 3), "nccl") == {"device_id": torch.device("cuda", 3)}
    assert bound_device(torch.device("cuda", 0), "cpu:gloo,cuda:nccl") == {"device_id": torch.device("cuda", 0)}
    assert bound_device(torch.device("cpu"), "gloo") == {}


def test_the_optimizer_is_fused_exactly_where_every_parameter_is_on_cuda():
    cuda = SimpleNamespace(device=torch.device("cuda", 0))
    host = SimpleNamespace(device=torch.device("cpu"))
    sharded = SimpleNamespace(
        device=torch.device("cuda", 0), _local_tensor=SimpleNamespace(device=torch.device("cuda", 1))
    )
    assert fuses([cuda, cuda]) is True and fuses([sharded]) is True
    assert fuses([cuda, host]) is None  # FSDP's CPU offload: the update runs on the host
    assert fuses([host]) is None and fuses([]) is None

    from omegaconf import OmegaConf

    from framework.optimizers.build import build_optimizer

    cfg = OmegaConf.create({"_target_": "torch.optim.AdamW", "lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1})
    optimizer = build_optimizer(torch.nn.Linear(4, 4), cfg)
    assert optimizer.defaults["fused"] is None  # a CPU model: torch's default update, as before


def test_pipeline_parallel_is_refused_on_a_torch_whose_pipelining_trains_off():
    """Under torch 2.11 (the lent GPU machine's) pp's runs crash under gloo or train off one
    process (the rehearsal environment's run of tests/test_strategies.py): refused in one line."""
    from framework.config.model import pipeline_torch_too_old

    assert pipeline_torch_too_old("2.11.0+cu130") and pipeline_torch_too_old("2.13.1")
    assert (
        not pipeline_torch_too_old("2.14.1+cu130")
        and not pipeline_torch_too_old("2.15.0")
        and not pipeline_torch_too_old("3.0.0")
    )


# --------------------------------------------------------------------------- gpu.py's rows


def test_every_row_is_saved_as_it_finishes_and_a_failed_row_stops_none(tmp_path):
    """The stand-in rows of gpu.py with one forced to fail: rows.jsonl and gpu.md hold every
    row, the failed one between the others; the run folders' summaries are in the archive."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--out", str(out), "--stand-in",
           "--rows", "probe,parity,precision bf16,memory breakdown", "--fail-row", "parity", "--budget", "400"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    names = [r["row"] for r in rows]
    assert names == ["probe", "parity", "precision bf16", "memory breakdown"], names
    status = {r["row"]: r["status"] for r in rows}
    assert status["parity"] == "failed" and "injected" in next(r for r in rows if r["row"] == "parity")["figures"]
    assert all(s == "ok" for n, s in status.items() if n != "parity"), rows
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]  # a failed row: the script says so
    table = (out / "gpu.md").read_text()
    assert all(n in table for n in names) and "failed" in table
    import tarfile

    with tarfile.open(out / "runs.tar.gz") as archive:
        summaries = [m.name for m in archive.getmembers() if m.name.endswith("summary.json")]
    assert len(summaries) == 2, summaries  # the runs of the rows after the failed one


def test_the_rows_of_two_calls_render_one_table(tmp_path, monkeypatch):
    """A second call's rows replace the first's skipped ones; the probe names the machine."""
    monkeypatch.setenv("HYDRADIST_RESULTS_DIR", str(tmp_path))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu import render

    def row(name, status, figures, data=None):
        return json.dumps({"row": name, "status": status, "figures": figures, "wall_s": 1.0, "data": data or {}})

    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("\n".join([row("probe", "ok", "790 TFLOP/s", {"machine": "NVIDIA H200, torch 2.11.0"}),
                                row("headline llama 1B", "ok", "MFU 41%"), row("parity", "skipped", "time budget spent")]))  # fmt: skip
    second.write_text(row("parity", "ok", "max loss gap 2e-5") + "\n")
    text = render([first, second]).read_text()
    assert "NVIDIA H200, torch 2.11.0" in text and "| parity | ok | max loss gap 2e-5 |" in text
    assert "time budget spent" not in text and text.index("probe") < text.index("headline") < text.index("parity")


def test_the_float8_rows_skip_in_one_line_where_torchao_is_absent(tmp_path, monkeypatch):
    """The lent machine may hold no torchao, and gpu.sh reaches no index: each float8 row says so
    in one line and is skipped, starting no job (a carried wheel, make gpu-wheels, lets them run)."""
    import importlib.util
    import time

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_float8
    from gpu import ROWS

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    monkeypatch.setattr(gpu_float8, "train", lambda *a, **k: pytest.fail("a float8 row started a job"))
    ctx = gpu_float8.Context(tmp_path, True, time.time() + 60, None)
    assert set(gpu_float8.ROWS) <= set(ROWS) and list(ROWS)[-len(gpu_float8.ROWS) :] == list(gpu_float8.ROWS)
    for row in gpu_float8.ROWS.values():
        status, figures, _ = row.run(ctx, 60)
        assert status == "skipped" and "torchao absent" in figures and "\n" not in figures, figures
