"""docs/results/matrix.md: the matrix as a user reads it (what composes with what; each refusal
with its one line). HYDRADIST_RESULTS_DIR moves it, as it moves the benchmarks' tables."""

from __future__ import annotations

import os
from pathlib import Path

from tests.helpers import ROOT
from tests.matrix import FLOOR_AT_LEAST, FLOOR_MULTIPLE, GLOBAL_BATCH, STEPS, Cell

MARKS = {"parity": "✓", "refused": "✗", "warm-up": "✓ w", "FAILED": "FAILED"}


def write_table(
    cells: list[Cell], results: dict[str, tuple[str, str, dict]], seconds: float, name: str = "matrix"
) -> Path:
    notes: dict[str, int] = {}
    plain = [c for c in cells if c.feature.name.startswith("plain")]
    lines = [
        "# Compatibility matrix",
        "",
        f"Written by `make matrix` (tests/test_matrix.py; {len(cells)} cells in {seconds / 60:.1f} min on this "
        "machine's CPUs, gloo). Axes generated from the config schema (tests/matrix.py). Each cell trains "
        f"{STEPS} steps at a global batch of {GLOBAL_BATCH}: ✓ r: the losses equal the single-process run's, "
        "their worst relative difference over the steps r times the noise floor of the model and precision "
        f"(below; parity: r at most {FLOOR_MULTIPLE}); "
        "✓ w: amp from its default first scale, the layout's first update skipped by its loss scaler (an "
        "overflow of its float16 range) where one process's was not (the losses part from there); "
        "✗ n: refused before any worker starts, for reason n below; FAILED: neither (a bug); · not run.",
        "",
        *_floors(cells, results),
        "",
        "## Every model under every strategy (fp32)",
        "",
        *_grid(plain, results, notes, row=lambda c: c.strategy.name, col=lambda c: c.model.name),
    ]
    for model in dict.fromkeys(c.model.name for c in cells if not c.feature.name.startswith("plain")):
        mine = [c for c in cells if c.model.name == model]
        lines += ["", f"## Every feature under every strategy: {model}", ""]
        lines += _grid(mine, results, notes, row=lambda c: c.strategy.name, col=lambda c: c.feature.name)
    lines += ["", "## Reasons", "", REASON_KINDS, ""]
    lines += [f"{n}. **{refusal_kind(text)}**: {text.removeprefix('FAILED: ')}" for text, n in notes.items()]
    out = Path(os.environ.get("HYDRADIST_RESULTS_DIR", ROOT / "docs" / "results")) / f"{name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out


REASON_KINDS = (
    "Each refusal's kind: **hardware** (it needs a device this machine lacks: CUDA), **upstream** (a "
    "limit of torch or another library, its issue named), **cannot** (the model or the data has "
    "nothing the strategy splits, or the combination means nothing), **not built** (an anchor trains "
    "it; this framework does not yet)."
)
# read from the one line a refusal gives (the first kind whose words it holds)
_KIND_WORDS = {
    "upstream": ("pytorch/pytorch#", "github.com/"),
    "hardware": ("CUDA", "GPU"),
    "not built": (
        "not built",
        "not supported",
        "not combined",
        "yet",
        "not compiled",
        "do not",
        "not with",
        "a direct child",
    ),
}


def refusal_kind(text: str) -> str:
    if text.startswith("FAILED: "):
        return "FAILED"
    return next((kind for kind, words in _KIND_WORDS.items() if any(w in text for w in words)), "cannot")


def _floors(cells: list[Cell], results: dict) -> list[str]:
    """The noise floors the cells were held to: per model and precision, the worst relative loss
    difference of one process's run summed in another order (tests/matrix.py, FLOOR_MULTIPLE)."""
    floors: dict[tuple[str, str], float] = {}
    for c in cells:
        figures = results.get(c.id, ("", "", {}))[2]
        if "floor" in figures:
            floors[(c.model.name, c.precision)] = figures["floor"]
    precisions = [p for p in ("fp32", "bf16", "amp") if any(k[1] == p for k in floors)]
    lines = [
        "Noise floors (one process's run with its batch's samples reversed, and as two accumulated "
        f"micro-batches where no layer reads the whole batch; never taken below {FLOOR_AT_LEAST:.1e}, "
        "float32's unit roundoff):",
        "",
        "| model | " + " | ".join(precisions) + " |",
        "|---" * (len(precisions) + 1) + "|",
    ]
    for model in dict.fromkeys(k[0] for k in floors):
        row = [f"{floors[(model, p)]:.1e}" if (model, p) in floors else "·" for p in precisions]
        lines.append(f"| `{model}` | " + " | ".join(row) + " |")
    return lines


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
            kind, detail, figures = results.get(cell.id, ("", "", {})) if cell else ("", "", {})
            mark = MARKS.get(kind, "·")
            if kind == "parity":
                mark += f" {figures['ratio']:.2g}"
            if kind in ("refused", "FAILED"):  # a failure's note says so (it is no refusal of any kind)
                text = ("FAILED: " if kind == "FAILED" else "") + detail.replace("|", "/")
                mark += f" {notes.setdefault(text, len(notes) + 1)}"
            marks.append(mark)
        lines.append(f"| `{r}` | " + " | ".join(marks) + " |")
    return lines
