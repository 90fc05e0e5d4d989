"""The CUDA-only checks of issue 27 (`gpu`-marked: skipped without CUDA; benchmarks/gpu.sh runs
them with `pytest -m gpu`): what tests/test_gpu_ready.py proves on CPU for each decision, here on
the hardware itself."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import count_syncs, train_in_process

CUDA_SMOKE = ["experiment=smoke", "device=cuda", "model.n_layer=2", "model.n_embd=64", "data.seq_len=64"]


@pytest.mark.gpu
def test_cuda_peaks_reset_between_in_process_runs(tmp_path):
    big = train_in_process([*CUDA_SMOKE, "data.batch_size=32", "steps=3"], tmp_path / "big")
    small = train_in_process([*CUDA_SMOKE, "data.batch_size=2", "steps=3"], tmp_path / "small")
    assert small["memory"]["device_peak_bytes"] < big["memory"]["device_peak_bytes"]


@pytest.mark.gpu
def test_cuda_loop_syncs_once_per_logged_step(monkeypatch, tmp_path):
    base = [*CUDA_SMOKE, "metrics.log_every=4", "metrics.sample_every=0"]
    short = count_syncs(monkeypatch, [*base, "steps=8"], tmp_path / "short")
    long = count_syncs(monkeypatch, [*base, "steps=16"], tmp_path / "long")
    assert long - short == 2, (short, long)


@pytest.mark.gpu
def test_cuda_dp_replicas_compute_in_bf16_and_record_activations():
    if torch.cuda.device_count() < 2:
        pytest.skip("parallel=dp needs two GPUs")
    from framework.measure.memory import SavedActivationMeter
    from framework.parallel.dp import DataParallel

    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    dp, meter = DataParallel(model), SavedActivationMeter(model)
    with torch.autocast("cuda", dtype=torch.bfloat16), meter.measure():
        out = dp(torch.randn(16, 64, device="cuda"))
        assert out.dtype == torch.bfloat16 and meter.live > 0
        out.float().sum().backward()


@pytest.mark.gpu
def test_cuda_pipeline_batches_are_pinned():
    from framework.data import concat_batches

    inputs, target = concat_batches([((torch.ones(2, 4),), torch.zeros(2)) for _ in range(3)], pin=True)
    assert inputs[0].is_pinned() and target.is_pinned() and inputs[0].shape == (6, 4)


@pytest.mark.gpu
def test_cuda_offload_keeps_state_on_the_host_and_explains_the_peak(tmp_path):
    from tests.helpers import read_summary, train_cli

    args = [*CUDA_SMOKE, "parallel=fsdp", "memory=offload", "launch.nproc_per_node=1", "steps=4",
            "metrics.sample_every=1", "logger=none"]  # fmt: skip
    proc = train_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    memory = read_summary(tmp_path)["memory"]
    assert memory["offloaded_bytes"] > 0 and memory["breakdown"]["unexplained_bytes"] >= 0, memory


@pytest.mark.gpu
def test_cuda_memory_history_is_written_for_the_profiler_window(tmp_path):
    from tests.helpers import train_cli

    proc = train_cli([*CUDA_SMOKE, "parallel=none", "steps=6", "profile=true", "profiler.memory=true",
                      "logger=none"], tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "profile" / "rank0.memory.pickle").stat().st_size > 0
