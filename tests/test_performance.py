"""Performance features: torch.compile (same losses as eager), profiler traces, MFU that can be
audited (peak table, CPU probe), start-up time, and the GPU script's CPU dry run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from framework.config import validate
from framework.contract import build_model
from framework.measure.metrics import cpu_peak_flops, gpu_peak_tflops
from framework.run.sweep import run_configs
from tests.helpers import ROOT, compose_config, losses, read_summary, train_cli, world_config

BASE = ["experiment=smoke", "logger=none", "steps=4"]


def config(overrides: list[str], world: int) -> dict:
    return world_config([*BASE, *overrides], world)


@pytest.mark.slow  # compile=true against one process under every strategy is the matrix's (default tier)
def test_compile_trains_like_eager_under_ddp_fsdp_and_checkpointing_and_is_refused_with_tp(tmp_path):
    """Under tensor parallel torch 2.14's compiled backward of a DTensor redistribute fails or
    trains off eager for llama, hf and user models (docs/results/matrix.md): refused in one line."""
    from framework.config import ConfigError

    with pytest.raises(ConfigError, match=r"^compile: .*set compile=false with tensor parallel$"):
        config(["parallel=tp", "compile=true"], 2)
    strategies = {
        "ddp": ["parallel=ddp"],
        "fsdp": ["parallel=fsdp"],
        "ddp_checkpoint": ["parallel=ddp", "memory=checkpoint"],
    }
    configs = {
        f"{name}-{c}": config([*args, f"compile={c}"], 2)
        for name, args in strategies.items()
        for c in ("false", "true")
    }
    summaries = run_configs(configs, 2, str(tmp_path))
    for name in strategies:
        eager, compiled = summaries[f"{name}-false"], summaries[f"{name}-true"]
        assert compiled["status"] == "ok" and compiled["compile_s"] > 0 and eager["compile_s"] is None
        assert losses(tmp_path / f"{name}-true") == pytest.approx(losses(tmp_path / f"{name}-false"), rel=1e-3), name


def test_compile_trains_like_eager_in_one_process(tmp_path):
    """compile=true really compiles (dynamo captured graphs of the model's blocks in this process)
    and trains like eager; compile=false captures none."""
    from torch._dynamo.utils import counters

    from framework.run.trainer import run

    graphs = {}
    for c in ("false", "true"):
        counters.clear()
        cfg = OmegaConf.create(config(["parallel=none", f"compile={c}"], 1))
        assert run(cfg, str(tmp_path / c), {"parallel": "none"})["status"] == "ok"
        graphs[c] = counters["stats"]["unique_graphs"]
    assert graphs["false"] == 0 and graphs["true"] >= 1, graphs
    assert losses(tmp_path / "true") == pytest.approx(losses(tmp_path / "false"), rel=1e-3)


def test_profile_writes_a_chrome_trace_per_rank_with_collectives(tmp_path):
    run = tmp_path / "run"
    proc = train_cli(
        [*BASE, "steps=5", "profile=true", "profiler.wait=1", "profiler.warmup=1", "profiler.active=2"], run
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"rank{rank}.trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert "gloo:all_reduce" in names and "c10d::allreduce_" in names  # DDP's gradient all-reduce
        assert any(n.startswith("aten::mm") or n == "aten::addmm" for n in names)  # the compute
        assert any(e.get("cat") == "python_function" for e in trace["traceEvents"])  # with stacks
        # the recorded window: profiler.active optimizer steps, marked by the profiler
        assert sum(1 for n in names if n.startswith("ProfilerStep#")) == 2


def test_a_profile_window_longer_than_the_run_is_a_config_error():
    from framework.config import ConfigError

    with pytest.raises(ConfigError) as err:
        validate(compose_config([*BASE, "profile=true", "profiler.wait=3"]))
    assert err.value.key == "profiler" and "steps=4" in str(err.value)


def test_cpu_runs_report_mfu_from_a_cached_matmul_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    peak = cpu_peak_flops()
    assert peak > 1e8  # any CPU does more than 0.1 GFLOP/s
    assert cpu_peak_flops() == peak  # the second call reads the cache
    assert json.loads((tmp_path / "cache" / "hydradist" / "peak_flops.json").read_text())

    # the run's peak is the probe's cached figure: a known one, planted for every thread count a
    # worker may have (workers probing together would each cache their own)
    cache_file = tmp_path / "cache" / "hydradist" / "peak_flops.json"
    key = next(iter(json.loads(cache_file.read_text())))
    planted = {re.sub(r"threads=\d+", f"threads={n}", key): 1e10 for n in range(1, (os.cpu_count() or 1) + 1)}
    cache_file.write_text(json.dumps(planted))
    run = tmp_path / "run"
    proc = train_cli([*BASE, "memory=checkpoint"], run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_summary(run)
    assert s["peak_tflops_per_device"] == 0.01
    assert 0 < s["mfu"] < s["hfu"] < 1  # recomputation counts for HFU only
    # the FLOPs are the model's formula at this sequence length, the rate the measured one, 2 devices
    cfg = compose_config(BASE)
    gpt = build_model(cfg.model, "meta")
    assert s["flops_per_token"] == gpt.flops_per_token(cfg.data.seq_len)
    assert s["mfu"] == pytest.approx(s["flops_per_token"] * s["throughput"]["tokens_per_s"] / 2 / 1e10, rel=1e-9)
    assert 0 < s["startup_s"] < 120
    # bf16 autocast: the peak is probed on the same kernels, so MFU stays a fraction
    proc = train_cli([*BASE, "precision=bf16"], tmp_path / "bf16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert 0 < read_summary(tmp_path / "bf16")["mfu"] < 1


def test_mfu_peak_table_matches_whole_gpu_names():
    assert gpu_peak_tflops("NVIDIA L4") == 121.0
    assert gpu_peak_tflops("NVIDIA L40") == 181.0  # not an L4
    assert gpu_peak_tflops("NVIDIA L40S") == 362.0
    assert gpu_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_peak_tflops("Tesla T4") is None


def test_the_gpu_script_runs_its_probe_stand_in_and_saves_the_row(tmp_path):
    """gpu.sh as on the lent machine, less the GPU: picks the python, checks the imports, and the
    probe row's stand-in lands in $OUT (the whole call is rehearsed by benchmarks/gpu_rehearsal.sh)."""
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--stand-in", "--rows", "probe"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = [json.loads(x) for x in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert row["row"] == "probe" and row["status"] == "ok" and row["data"]["matmul_tflops"] > 0
    assert "| probe | ok |" in (tmp_path / "gpu.md").read_text() and (tmp_path / "gpu.log").exists()


def test_the_overhead_benchmarks_in_process_part_declares_the_loops_figures_as_the_trainer_does(monkeypatch):
    """benchmarks/overhead.py's last measure (the callback machinery's cost a step, in-process)
    declares the loop's own figures (control/...) as the trainer does, as the framework's: a user's
    figure may not take those names, and the benchmark once died there after printing its table."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import overhead

    bare, noop = overhead.hook_cost(steps=20)
    assert bare > 0 and noop > 0


@pytest.mark.slow  # the benchmark itself, end to end; its parts are tested above
def test_overhead_benchmark_runs_and_prints_its_ratio():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--pairs", "1", "--steps", "6",
                           "--precisions", "fp32"], cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    *_, last, written = proc.stdout.strip().splitlines()
    assert written.startswith("written: ") and not written.startswith(f"written: {ROOT / 'docs'}")
    assert last.startswith("framework/raw throughput ratio: ") and float(last.split(": ")[1]) > 0.5
