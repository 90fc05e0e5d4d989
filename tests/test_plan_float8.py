"""The planner's price of a converter, float8's (framework/plan/convert.py,
framework/converters/float8_price.py): torchtitan's float8 rows on H100s at 500 W forecast within
15% in throughput and 10% in memory, but the rows docs/results/plan_h100.md names as missed (each
with its reason there); a float8 forecast faster than the same bf16 one on an H100, its converted
weights all-gathered in half the bytes; and on a CPU (emulated float8) never faster than bf16. No
GPU, no workers: the planner is a pure function of the config."""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import pytest

from framework.config import compose
from framework.plan import predict

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from plan_h100 import FLOAT8_ROWS, forecast  # noqa: E402

# rows the forecast misses, by figure, each explained in docs/results/plan_h100.md ("float8 rows missed")
MISSED = {
    ("8B FSDP 2 x CP 4, 131,072 tokens, float8", "throughput"),
    ("8B FSDP 1 x CP 8, 262,144 tokens, float8", "throughput"),
    ("70B FSDP 32 x TP 8, float8 (2D)", "memory"),
    ("405B FSDP 8 x TP 8 x PP 8 1F1B, float8", "memory"),
    ("405B FSDP 8 x TP 8 x PP 8 interleaved, float8", "memory"),
}
SMALL = ["model=llama", "model.flavor=8b", "model.n_layers=2", "model.vocab_size=1024", "precision=bf16", "device=cpu",
         "data.seq_len=2048", "data.batch_size=2", "parallel=fsdp"]  # fmt: skip


@cache
def _rows() -> dict[str, dict]:
    from plan_h100 import plan_rows

    return {r["name"]: r for r in plan_rows(FLOAT8_ROWS)}


@pytest.mark.slow  # planning the nine rows' models takes minutes: the default tier prices Table 1's 8B row below
def test_every_float8_row_is_forecast_within_15_percent_and_its_peak_within_10_percent():
    rows = _rows()
    assert len(rows) == len(FLOAT8_ROWS) == 9
    for name, r in rows.items():
        if (name, "throughput") not in MISSED:
            assert abs(r["ratio"] - 1) <= 0.15, (name, r["ratio"])
        if (name, "memory") not in MISSED:
            assert abs(r["peak_ratio"] - 1) <= 0.10, (name, r["reserved_gib"], r["published_gib"])
        assert sum(r["split"].values()) == pytest.approx(r["step"], rel=1e-12)
    assert all(name in rows for name, _ in MISSED)


def test_float8_prices_compile_and_fp8_matmuls_beside_the_bf16_rows():
    """The 8B rows of Table 1: compiled bf16 faster than eager (fused elementwise kernels), float8
    faster again (its matmuls at twice bf16's rate), as published (5,762 < 6,667 < 8,532)."""
    from plan_h100 import _fsdp_8b

    _, eager = forecast(_fsdp_8b(1, False), 8, 500)
    _, compiled = forecast(_fsdp_8b(1, True), 8, 500)
    assert eager < compiled < _rows()["8B FSDP 8 + compile + float8"]["forecast_tps"]


def _gpu(extra: list[str], world: int = 8) -> dict:
    from framework.plan.profile import machine_profile

    cfg = compose([*SMALL, "plan.gpu=H100", "compile=true", *extra])
    return predict(cfg, world, machine_profile(cfg, world, "config"))


def test_the_converter_price_makes_float8_faster_and_halves_the_converted_weights_all_gather():
    from torchao.float8.float8_linear import Float8Linear

    from framework.config.model import meta_model

    bf16, fp8 = _gpu([]), _gpu(["converters=[float8]"])
    assert fp8["step_time_s"] < 0.85 * bf16["step_time_s"]
    gathered = {
        k: v["all_gather"]["bytes"] for k, v in (("bf16", bf16["comm"]["by_op"]), ("fp8", fp8["comm"]["by_op"]))
    }
    model = meta_model(compose([*SMALL, "converters=[float8]"]))
    converted = sum(m.weight.numel() for m in model.modules() if isinstance(m, Float8Linear))
    assert converted > 0
    gathers = 2  # forward and backward (FSDP reshards the blocks after forward); dims divide by 8: no padding
    assert gathered["bf16"] - gathered["fp8"] == gathers * converted * (2 - 1)  # 2 bytes an element, now 1
    assert fp8["memory"]["gathered_bytes"] < bf16["memory"]["gathered_bytes"]


def test_the_head_and_the_filtered_linears_stay_in_bf16_and_rowwise_gathers_in_bf16():
    """filter_fqns leaves its linears priced at bf16's rate (slower than all converted); rowwise
    has no float8 all-gather, so its gather bytes are bf16's."""
    all_in = _gpu(["converters=[float8]"])
    filtered = _gpu(["converters=[float8]", "converters.float8.filter_fqns=[w1,w2,w3]"])
    rowwise = _gpu(["converters=[float8]", "converters.float8.recipe=rowwise"])
    bf16 = _gpu([])
    assert all_in["step_time_s"] < filtered["step_time_s"] < bf16["step_time_s"]
    assert rowwise["comm"]["by_op"]["all_gather"] == bf16["comm"]["by_op"]["all_gather"]


def test_emulated_float8_on_a_cpu_is_priced_slower_than_bf16_never_faster():
    """Under the planner's CPU path (probed kernels, no GPU spec) a float8 matmul is emulated: the
    high-precision matmul plus the casts. Kernels here are made up (no probe): 1 TFLOP/s matmuls."""
    import dataclasses

    from framework.plan.kernels import GRID_M, GRID_S, ORIENTATIONS, Kernels
    from framework.plan.profile import machine_profile

    grid = tuple((m, s, 2 * m * s * s / 1e12) for m in GRID_M for s in GRID_S)
    kernels = Kernels(dict.fromkeys(ORIENTATIONS, grid), 2e10, 1e-9, 1e10)
    steps = {}
    for name, extra in (("bf16", []), ("float8", ["converters=[float8]"])):
        cfg = compose([*SMALL, "parallel=none", "plan.profile=config", *extra])
        profile = dataclasses.replace(machine_profile(cfg, 1, "config"), kernels=kernels)
        steps[name] = predict(cfg, 1, profile)["step_time_s"]
    assert steps["float8"] > steps["bf16"]


def test_a_converter_without_a_price_is_planned_as_costing_nothing_and_the_forecast_says_so():
    cfg = compose([*SMALL, "parallel=none", "converters=[freeze]"])
    note = predict(cfg, 1)["not_predicted"]["converters.freeze"]
    assert "declares no planner_price; planned as if it cost nothing" in note
