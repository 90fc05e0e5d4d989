"""The compatibility matrix: every model under every strategy, every feature under every strategy
(on gpt and the tied Llama), with axes generated from the config schema (tests/matrix.py). Each
cell either trains with the single-process losses at the same global batch (parity) or is refused
by validation, before any worker starts, with one line naming the key; nothing else passes.

The default suite runs a covering subset (tests/matrix.py's subset_cells: every pair of a model, a
strategy family and a feature meets in some cell, and every strategy variant is in one): its one-
and two-process cells here, its four-process cells in tests/test_matrix_wide.py (two files:
pytest-xdist runs them side by side). `make matrix` (`-m matrix`) runs the full tables and
writes docs/results/matrix.md. The cells of a module run together (tests/matrix_run.py): groups of
workers of each world size, a fresh group every 40 configs.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.matrix import Cell, full_cells, subset_cells

os.environ.setdefault("HF_HUB_OFFLINE", "1")
FULL = full_cells()
NARROW = [c for c in subset_cells() if c.strategy.world < 4]


@pytest.fixture(scope="module")
def matrix(request, tmp_path_factory):
    """The outcome of every matrix cell this module collected (and kept), run in one go; the
    table is written where HYDRADIST_RESULTS_DIR says (make matrix, make matrix-subset)."""
    return run_module_cells(request, tmp_path_factory)


def run_module_cells(request, tmp_path_factory, start_method: str = "forkserver") -> dict:
    """Every cell the requesting module collected (and kept), run in one go (tests/matrix_run.py)."""
    from tests.matrix_run import run_cells
    from tests.matrix_table import write_table

    cells = {}
    for item in request.session.items:
        cell = getattr(item, "callspec", None) and item.callspec.params.get("cell")
        if item.module is request.module and isinstance(cell, Cell):
            cells[cell.id] = cell
    started = time.perf_counter()
    results = run_cells(list(cells.values()), tmp_path_factory.mktemp("matrix"), start_method)
    if "HYDRADIST_RESULTS_DIR" in os.environ:
        write_table(
            list(cells.values()), results, time.perf_counter() - started, request.module.__name__.split(".")[-1][5:]
        )
    return results


def check(matrix: dict, cell: Cell) -> None:
    kind, detail, _ = matrix[cell.id]
    assert kind in ("parity", "refused", "warm-up"), f"{cell.id}: {kind}: {detail}"


@pytest.mark.parametrize("cell", NARROW, ids=[c.id for c in NARROW])
def test_covering_subset(matrix, cell):
    """The covering subset's cells of one and two processes: parity or a one-line refusal."""
    check(matrix, cell)


@pytest.mark.matrix
@pytest.mark.parametrize("cell", FULL, ids=[c.id for c in FULL])
def test_full_matrix(matrix, cell):
    """Every cell of both tables: parity with one process, or a one-line refusal."""
    check(matrix, cell)


def test_the_subset_covers_every_pair_of_families_and_every_variant():
    from tests.matrix import family, features, models, strategies

    ms, ss, fs = models(), strategies(), features()
    cells = subset_cells()
    seen = set()
    for c in cells:
        seen |= {("ms", c.model, family(c.strategy)), ("mf", c.model, c.feature), ("sf", family(c.strategy), c.feature)}
    families = {family(s) for s in ss}
    assert len(seen) == len(ms) * len(families) + len(ms) * len(fs) + len(families) * len(fs)
    assert {c.strategy for c in cells} == set(ss)  # every variant of every family
    assert len(cells) < len(full_cells()) / 5  # the default suite's share: a covering, not the table


def test_each_refusal_states_its_kind():
    """The table's reasons say which kind each is: upstream (with its issue), hardware, cannot, or
    not built, read from the one line each refusal gives."""
    from tests.matrix_table import refusal_kind

    assert (
        refusal_kind("compile: ... a plain tensor (upstream: pytorch/pytorch#173123); set compile=false") == "upstream"
    )
    assert refusal_kind("memory: FSDP CPU offload ... needs CUDA; none here") == "hardware"
    assert refusal_kind("parallel.cp: context parallel is not combined with pipeline parallel") == "not built"
    assert refusal_kind("parallel.tp: tensor parallel needs the model's plan; MLP declares none") == "cannot"
    assert refusal_kind("FAILED: RuntimeError: The size of tensor a (16) must match ... yet") == "FAILED"  # no refusal
