"""The planner on H100s (benchmarks/plan_h100.py, docs/results/plan_h100.md): published H100 rows
forecast within 15%, their published peak memory within 10%, the step's split summing to the step, the power limit as an input, and a bad
power limit refused in one line naming plan.gpu_power_w. No GPU, no workers: the planner is a
pure function of the config."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from framework.config import ConfigError, validate
from tests.helpers import compose_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from plan_h100 import BF16_ROWS, _fsdp_8b, forecast, plan_rows  # noqa: E402


def test_every_published_h100_row_is_forecast_within_15_percent_and_the_split_sums_to_the_step():
    rows = plan_rows(BF16_ROWS)  # the float8 rows: tests/test_plan_float8.py
    assert len(rows) == len(BF16_ROWS) == 8
    for r in rows:
        assert abs(r["ratio"] - 1) <= 0.15, (r["name"], r["ratio"])
        assert sum(r["split"].values()) == pytest.approx(r["step"], rel=1e-12)
        assert all(v >= 0 for v in r["split"].values()), r["split"]
    held_out = {r["name"]: r for r in rows if r["gpus"] >= 8192}
    assert len(held_out) == 3 and held_out["405B TP8 PP16 DP128, 8K"]["split"]["bubble"] > 0


def test_every_published_peak_is_forecast_within_10_percent():
    """torchtitan's GiB (the allocator's reserved peak) against the forecast reserved peak: the
    8B rows under its selective "op" checkpointing (memory=selective, memory.matmul_every=2)."""
    rows = [r for r in plan_rows(BF16_ROWS) if r["published_gib"]]
    assert len(rows) == 4
    for r in rows:
        assert abs(r["peak_ratio"] - 1) <= 0.10, (r["name"], r["reserved_gib"], r["published_gib"])
        assert r["forecast_gib"] < r["reserved_gib"]  # the cached blocks on top of the allocated peak


def test_a_lower_power_limit_lowers_the_forecast_throughput():
    _, at_tdp = forecast(_fsdp_8b(1, False), 8, 700)
    _, capped = forecast(_fsdp_8b(1, False), 8, 500)
    assert capped < at_tdp * 0.9


def test_a_bad_power_limit_is_one_error_naming_the_key():
    from framework.plan.profile import machine_profile

    with pytest.raises(ConfigError, match=r"plan\.gpu_power_w: got -5"):
        validate(compose_config(["plan.gpu=H100", "plan.gpu_power_w=-5"]))
    with pytest.raises(ConfigError, match=r"plan\.gpu_power_w: got 900; an H100's power limit is 200 to 700 W"):
        machine_profile(compose_config(["plan.gpu=H100", "plan.gpu_power_w=900"]), 8)


def test_a_probe_row_refines_the_matmul_and_copy_rates(tmp_path):
    """plan.profile=<rows.jsonl> (benchmarks/gpu.sh's probe row): the measured bf16 matmul and
    device copy replace the published rates; a file without a probe row is one error naming the key."""
    import json

    from framework.plan.gpu import HBM_SHARE
    from framework.plan.profile import machine_profile

    rows = tmp_path / "rows.jsonl"
    data = {"matmul_tflops": 650.0, "copy_gb_per_s": 2600.0, "nvidia_smi": "NVIDIA H100 80GB HBM3, 550.54, 81559 MiB"}
    rows.write_text(json.dumps({"row": "probe", "status": "ok", "figures": "", "data": data}) + "\n")
    profile = machine_profile(compose_config(["precision=bf16", f"plan.profile={rows}"]), 8)
    assert profile.kernels.matmul_flops == pytest.approx(650e12)
    assert profile.kernels.bytes_per_s == pytest.approx(2600e9) and profile.sources["kernels"] == "probe row"
    assert profile.kernels.spec.hbm_tb_s == pytest.approx(2.6 / HBM_SHARE)
    rows.write_text(json.dumps({"row": "parity", "status": "ok", "figures": "", "data": {}}) + "\n")
    with pytest.raises(ConfigError, match=r"plan\.profile: .* holds no probe row"):
        machine_profile(compose_config(["precision=bf16", f"plan.profile={rows}"]), 8)
    with pytest.raises(ConfigError, match=r"plan\.profile: got 'nope'"):
        validate(compose_config(["plan.profile=nope"]))


def test_the_user_command_prints_the_configured_layouts_forecast_and_its_split(capsys):
    """`python -m framework.plan ... plan.search=false`: one layout, its tokens/s and its split."""
    from framework.doors.plan import main

    args = [o for o in _fsdp_8b(1, False) if o != "device=cpu"] + ["plan.world_size=8", "plan.search=false",
                                                                     "plan.gpu_power_w=500"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    rate = float(out.split(" tokens/s per rank")[0].rsplit(" ", 1)[1].replace(",", ""))
    assert out.startswith("fsdp at 8 ranks") and rate == pytest.approx(5762, rel=0.01)
    assert "split: compute" in out and "power limit: 500 W per GPU" in out


def test_torchtitans_405b_layout_fits_an_h100_and_the_llama3_layouts_fit_under_full_checkpointing():
    """torchtitan's 405B (FSDP 16 x TP 8, resharding after forward, loss parallel, full AC) fits an
    80 GB H100. The Llama 3 paper's layouts planned as published (no checkpointing) do not: their
    saved activations, this framework's Llama block's, are most of the peak (the doc says why);
    with every block checkpointed each fits."""
    from plan_h100 import H100_BYTES, fit_rows

    fits = {f["name"]: f for f in fit_rows(plan_rows(BF16_ROWS))}
    assert len(fits) == 4 and fits["405B FSDP 16 x TP 8, full AC"]["fits"]
    assert fits["405B FSDP 16 x TP 8, full AC"]["reserved_gib"] * 2**30 <= H100_BYTES
    for name, f in fits.items():
        assert f["full_ac_gib"] * 2**30 <= H100_BYTES, (name, f["full_ac_gib"])
        if "FSDP 16" not in name:
            assert not f["fits"] and f["activation_gib"] > 0.8 * f["reserved_gib"], (name, f)
