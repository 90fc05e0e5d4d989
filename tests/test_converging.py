"""The convergence benchmark's golden curves (benchmarks/converging.py, docs/results/converging.md):
the fsdp reference every family is held to, written by `python benchmarks/converging.py
--write-golden`. A change that moves the reference (the model's initialisation, the data's order,
the optimizer or its schedule, the loss) shows here as a drift from its golden curve, before a
300-step comparison against a moved reference could hide it."""

from __future__ import annotations

import json
import sys

import pytest

from tests.helpers import ROOT, read_metrics, train_cli

sys.path.insert(0, str(ROOT / "benchmarks"))
from converging import GOLDEN, RUNS, STEPS, corpus, overrides  # noqa: E402

CHECKED = 12  # the reference's first steps, on the schedule of the whole run
# measured over those 12 steps (benchmarks/converging.py's fsdp x2 llama, bf16): the same run
# summed in another order (ddp x2) drifts from the golden curve by 1.7e-4, on ATen's unvectorised
# kernels by 1.2e-5; a moved reference leaves it: seed 1 by 6.8e-3 (3.3e-3 at step 1), lr 2.5e-3
# for 3e-3 by 3.3e-2
DRIFT = 2e-3


@pytest.mark.parametrize("model", ["llama", "llama(moe)"])
def test_the_convergence_reference_follows_its_golden_curve(model, tmp_path):
    golden = json.loads(GOLDEN.read_text())["losses"][model]
    assert len(golden) == STEPS
    layout = next(lay for family, m, lay in RUNS if family == "fsdp" and m == model)
    args = [*overrides(model, layout, corpus(tmp_path / "grammar.txt"), CHECKED), f"schedule.steps={STEPS}"]
    proc = train_cli(args, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [m["loss"] for m in read_metrics(tmp_path / "run")]
    drift = [abs(g - w) / w for g, w in zip(got, golden, strict=False)]
    assert len(got) == CHECKED and max(drift) <= DRIFT, f"losses {got} vs golden {golden[:CHECKED]}"
