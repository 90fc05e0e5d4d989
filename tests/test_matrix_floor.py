"""The matrix's rule itself (tests/matrix_run.py), on run folders written here: a cell passes
within FLOOR_MULTIPLE x its model's measured noise floor and fails past it, a floor that measured
0 counts as float32's unit roundoff, and the floor is the worst of its reordered runs. Synchronised
BatchNorm's order, as the floor of a model with batch statistics takes it, is BatchNorm's result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.matrix import FLOOR_AT_LEAST, FLOOR_MULTIPLE, STEPS, full_cells
from tests.matrix_run import deviation, outcome, statistics_in_halves

CELL = next(c for c in full_cells() if c.id == "gpt|ddp|plain (fp32)")
ONE_PROCESS = {step: 3.0 - 0.1 * step for step in range(1, STEPS + 1)}


def run_folder(folder: Path, losses: dict[int, float]) -> Path:
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"status": "ok"}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n" for s, v in losses.items()))
    (folder / "done").write_text(json.dumps({"kernels": {"aten": "DEFAULT"}}))
    return folder


@pytest.mark.parametrize("times", [0.5, 19.0, 21.0, 1000.0])
def test_a_cell_passes_within_its_multiple_of_the_floor_and_fails_past_it(tmp_path, times):
    floor = 1e-6
    off = ONE_PROCESS | {3: ONE_PROCESS[3] * (1 + times * floor)}  # one step off by `times` floors
    kind, detail, figures = outcome(CELL, run_folder(tmp_path / "cell", off), run_folder(tmp_path / "ref", ONE_PROCESS),
                                    floor)  # fmt: skip
    assert kind == ("parity" if times <= FLOOR_MULTIPLE else "FAILED"), detail
    assert figures["ratio"] == pytest.approx(times, rel=1e-3) and figures["floor"] == floor


def test_a_floor_that_measured_nothing_is_the_unit_roundoff(tmp_path):
    """Two orders that happened to round alike measure 0: the bound is then 20 ulp, not 0."""
    off = ONE_PROCESS | {2: ONE_PROCESS[2] * (1 + 5 * FLOOR_AT_LEAST)}
    kind, _, figures = outcome(CELL, run_folder(tmp_path / "cell", off), run_folder(tmp_path / "ref", ONE_PROCESS), 0.0)
    assert kind == "parity" and figures["ratio"] == pytest.approx(5, rel=1e-2)
    far = ONE_PROCESS | {2: ONE_PROCESS[2] * (1 + 50 * FLOOR_AT_LEAST)}
    assert outcome(CELL, run_folder(tmp_path / "far", far), tmp_path / "ref", 0.0)[0] == "FAILED"


def test_a_cell_that_logged_other_steps_or_failed_is_failed(tmp_path):
    short = {s: v for s, v in ONE_PROCESS.items() if s < STEPS}
    ref = run_folder(tmp_path / "ref", ONE_PROCESS)
    assert outcome(CELL, run_folder(tmp_path / "short", short), ref, 1e-6)[0] == "FAILED"
    failed = run_folder(tmp_path / "failed", ONE_PROCESS)
    (failed / "summary.json").write_text(json.dumps({"status": "failed", "error": "boom"}))
    assert outcome(CELL, failed, ref, 1e-6)[:2] == ("FAILED", "status failed: boom")


def test_deviation_is_the_worst_relative_step():
    got = {1: 2.0, 2: 1.0 + 4e-6, 3: 0.5 - 1e-6}
    assert deviation(got, {1: 2.0, 2: 1.0, 3: 0.5}, [1, 2, 3]) == pytest.approx(4e-6)


def test_batch_statistics_in_halves_are_batch_norms_own():
    """The BatchNorm floor's order (two halves' statistics combined by count) is the same math
    as one batch's: equal within float32 rounding, not another model."""
    torch.manual_seed(0)
    x, weight, bias = torch.randn(8, 3, 4, 4) * 3 + 1, torch.rand(3), torch.randn(3)
    mean, var = torch.zeros(3), torch.ones(3)
    want = F.batch_norm(x, mean.clone(), var.clone(), weight, bias, training=True)
    with statistics_in_halves():
        got = F.batch_norm(x, mean, var, weight, bias, training=True)
    assert torch.allclose(got, want, rtol=0, atol=1e-5) and not torch.equal(mean, torch.zeros(3))
