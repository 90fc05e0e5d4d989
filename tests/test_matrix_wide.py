"""The covering subset of the compatibility matrix (tests/test_matrix.py): its four-process cells
(hybrid, each pair of mesh axes at 2), in a file of their own so that pytest-xdist runs them beside
the one- and two-process cells. The long tier (`make matrix-subset`, `make test-all`): four
processes on two cores made them the default suite's costliest minute and a half, and its other
tests train 4-rank hybrids (resumes to fsdp 2 x tp 2, MoE under tp x cp, cp 2 x fsdp 2)."""

from __future__ import annotations

import pytest

from tests.matrix import subset_cells
from tests.test_matrix import check, matrix  # noqa: F401  (the module-scoped fixture, run here for this module)

pytestmark = pytest.mark.slow
WIDE = [c for c in subset_cells() if c.strategy.world >= 4]


@pytest.mark.parametrize("cell", WIDE, ids=[c.id for c in WIDE])
def test_covering_subset(matrix, cell):  # noqa: F811
    """The covering subset's cells of four processes: parity or a one-line refusal."""
    check(matrix, cell)
