"""docs/results/matrix.md: the matrix as a user reads it (what composes with what; each refusal
with its one line). HYDRADIST_RESULTS_DIR moves it, as it moves the benchmarks' tables."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers import ROOT
from tests.matrix import GLOBAL_BATCH, STEPS, TOLERANCE, Cell

MARKS = {"parity": "✓", "refused": "✗", "FAILED": "FAILED"}


def write_table(cells: list[Cell], results: dict[str, tuple[str, str]], seconds: float, name: str = "matrix") -> Path:
    notes: dict[str, int] = {}
    plain = [c for c in cells if c.feature.name.startswith("plain")]
    lines = [
        "# Compatibility matrix",
        "",
        f"Written by `make matrix` (tests/test_matrix.py; {len(cells)} cells in {seconds / 60:.1f} min on this "
        "machine's CPUs, gloo). Axes generated from the config schema (tests/matrix.py). Each cell trains "
        f"{STEPS} steps at a global batch of {GLOBAL_BATCH}: ✓ the losses equal the single-process run's "
        f"(relative, every step: fp32 {TOLERANCE['fp32']:g}, bf16 {TOLERANCE['bf16']:g}, amp {TOLERANCE['amp']:g}); "
        "✗ n: refused before any worker starts, for reason n below; FAILED: neither (a bug); · not run.",
        "",
        "## Every model under every strategy (fp32)",
        "",
        *_grid(plain, results, notes, row=lambda c: c.strategy.name, col=lambda c: c.model.name),
    ]
    for model in dict.fromkeys(c.model.name for c in cells if not c.feature.name.startswith("plain")):
        mine = [c for c in cells if c.model.name == model]
        lines += ["", f"## Every feature under every strategy: {model}", ""]
        lines += _grid(mine, results, notes, row=lambda c: c.strategy.name, col=lambda c: c.feature.name)
    lines += ["", "## Reasons", ""] + [f"{n}. {text}" for text, n in notes.items()]
    out = Path(os.environ.get("HYDRADIST_RESULTS_DIR", ROOT / "docs" / "results")) / f"{name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out


def _grid(cells: list[Cell], results: dict, notes: dict[str, int], row, col) -> list[str]:
    from tests.matrix import features, models, strategies

    order = {v.name: i for axis in (models(), strategies(), features()) for i, v in enumerate(axis)}
    rows = sorted(dict.fromkeys(map(row, cells)), key=order.get)
    cols = sorted(dict.fromkeys(map(col, cells)), key=order.get)
    at = {(row(c), col(c)): c for c in cells}
    lines = ["| strategy | " + " | ".join(f"`{c}`" for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for r in rows:
        marks = []
        for c in cols:
            cell = at.get((r, c))
            kind, detail = results.get(cell.id, ("", "")) if cell else ("", "")
            mark = MARKS.get(kind, "·")
            if kind in ("refused", "FAILED"):
                mark += f" {notes.setdefault(detail.replace('|', '/'), len(notes) + 1)}"
            marks.append(mark)
        lines.append(f"| `{r}` | " + " | ".join(marks) + " |")
    return lines
