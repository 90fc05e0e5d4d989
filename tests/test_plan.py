"""The planner: `parallel=auto` under a memory budget, the error when nothing fits, the ranked table
of `python -m framework.plan`, and the formulas that need no run. (Every run checks the planner's
prediction of itself: the parity and measurement tests assert those errors for ddp, fsdp both
ways, tp, pp with every schedule, hybrid and HSDP at world sizes 2 and 4.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from framework.plan import bubble, candidates, predict
from framework.plan.model import Layout
from tests.helpers import ROOT, assert_plan_holds, compose_config, read_summary, train_cli

# a gpt of about 100M parameters (8 blocks x 1024 wide: 12 x 8 x 1024^2), short sequences
GPT_100M = ["experiment=smoke", "logger=none", "model.n_layer=8", "model.n_embd=1024", "model.n_head=8",
            "data.seq_len=32", "data.batch_size=4"]  # fmt: skip
LINK = ["plan.latency_us=100", "plan.intra_node_gbps=1"]  # fixed link figures: no probe in tests
MB = 2**20


def test_auto_under_a_budget_below_ddp_picks_a_sharded_layout_that_fits(tmp_path):
    budget = 1200  # DDP needs ~1.6 GB of model state per rank for 100M parameters (Adam, fp32)
    ddp = predict(compose_config([*GPT_100M, "parallel=ddp"]), 4)
    assert ddp["total_bytes"] > budget * MB
    run = train_cli(
        [*GPT_100M, *LINK, "parallel=auto", f"plan.memory_budget_mb={budget}", "launch.nproc_per_node=4", "steps=1"],
        tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = read_summary(tmp_path)
    auto = summary["plan"]["auto"]
    assert auto["layout"] != "ddp" and summary["choices"]["parallel"] != "ddp"
    assert "fit 1200 MB per rank" in auto["why"] and "parallel=auto:" in run.stdout
    assert {r["layout"] for r in auto["ranked"] if not r["fits"]} == {"ddp"}
    memory = summary["memory"]
    assert memory["param_bytes"] + memory["grad_bytes"] + memory["optim_bytes"] <= budget * MB
    assert_plan_holds(summary, auto["layout"])


def test_a_budget_no_layout_meets_is_an_error_before_any_worker_starts(tmp_path):
    run = train_cli(
        [*GPT_100M, *LINK, "parallel=auto", "plan.memory_budget_mb=100", "launch.nproc_per_node=4"], tmp_path
    )
    assert run.returncode == 2
    assert "plan.memory_budget_mb: no layout fits 100 MB per rank at 4 ranks" in run.stderr
    assert "the smallest predicted footprint is" in run.stderr
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_the_plan_command_ranks_every_layout_fastest_first():
    cmd = [
        sys.executable,
        "-m",
        "framework.plan",
        "experiment=smoke",
        "model.n_head=4",
        "model.n_layer=4",
        "plan.world_size=4",
        *LINK,
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| ") and "layout" not in line]
    layouts = [r[1].strip() for r in rows]
    for expected in ("ddp", "fsdp", "fsdp(grad_op)", "tp", "pp 1F1B m=4", "pp GPipe m=4", "hybrid dp2xtp2",
                     "hybrid dp2xpp2", "hybrid pp2xtp2"):  # fmt: skip
        assert expected in layouts, (expected, layouts)
    step_ms = [float(r[12]) for r in rows]
    assert step_ms == sorted(step_ms)  # an ample budget: everything fits, fastest first
    # and the order is the link's, not only the table's own: ddp and both fsdp variants compute
    # the same per rank, so their step times differ by exactly their extra calls and bytes on
    # the configured link (100 us per call, 1 GB/s), read from their own columns
    by = {r[1].strip(): (float(r[12]), int(r[9]), float(r[10])) for r in rows}
    for slower in ("fsdp(grad_op)", "fsdp"):
        (t0, calls0, mb0), (t1, calls1, mb1) = by["ddp"], by[slower]
        wire_ms = (calls1 - calls0) * 0.1 + (mb1 - mb0) * MB / 1e9 * 1e3
        assert wire_ms > 0.5 and t1 - t0 == pytest.approx(wire_ms, abs=0.15), (slower, by)
    assert f"parallel=auto would run: {layouts[0]}" in out.stdout


def test_candidates_respect_the_model_and_the_batch():
    cfg = compose_config(["experiment=smoke", "data.batch_size=4"])  # 2 heads, 2 layers, 4 samples per rank
    names = {predict(c.cfg, 4)["layout"] for c in candidates(cfg, 4)}
    assert "tp" not in names  # 2 heads do not split over 4 ranks
    assert not any(n.startswith("pp") for n in names)  # 2 layers cannot fill 4 stages
    assert {"ddp", "fsdp", "fsdp(grad_op)"} <= names


def test_pipeline_bubble_shrinks_with_micro_batches_and_interleaving():
    one_f_one_b = Layout("pp", pp=4, schedule="1F1B", n_microbatches=4)
    assert bubble(one_f_one_b) == pytest.approx(3 / 7)
    assert bubble(Layout("pp", pp=4, schedule="1F1B", n_microbatches=12)) == pytest.approx(3 / 15)
    interleaved = Layout("pp", pp=4, schedule="Interleaved1F1B", n_microbatches=4, stages_per_rank=2)
    assert bubble(interleaved) == pytest.approx(3 / 11)
    assert bubble(Layout("ddp", dp_replicate=4)) == 0.0


def test_ranks_under_a_launcher_rank_from_the_config_alone(tmp_path, monkeypatch):
    """Every rank of a torchrun/srun job must pick the same layout: `config` ignores the cache
    (nodes may hold different ones) and never probes; a run's own check reads the cache."""
    import json

    from framework.plan.profile import NOMINAL, _link_key, machine_profile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = compose_config(["experiment=smoke", "plan.peak_tflops=1"])
    (tmp_path / "hydradist").mkdir()
    key = _link_key("cpu", "gloo", 4)
    (tmp_path / "hydradist" / "links.json").write_text(json.dumps({key: {"bytes_per_s": 123.0, "latency_s": 0.5}}))
    assert machine_profile(cfg, 4, "cache").intra_bytes_per_s == 123.0
    alike = machine_profile(cfg, 4, "config")
    assert alike.intra_bytes_per_s == NOMINAL["gbps"] * 1e9 and alike.latency_s == NOMINAL["latency_us"] * 1e-6
    configured = machine_profile(
        compose_config(["experiment=smoke", "plan.intra_node_gbps=2", "plan.latency_us=7"]), 4, "config"
    )
    assert configured.intra_bytes_per_s == 2e9 and configured.latency_s == pytest.approx(7e-6)
