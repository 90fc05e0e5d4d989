"""Float8 (converters=[float8], emulated on this CPU) under every layout, against one process's
float8 run, within the noise floor measured for float8 as the compatibility matrix measures every
arithmetic (one process's training summed in other orders: its samples reversed, its batch as two
accumulated halves); and the all-gather bytes of the float8 weights under FSDP2 against bf16's.

    python benchmarks/float8.py            # docs/results/float8.md
    python benchmarks/float8.py --quick    # tensorwise only, no hybrid (tests/test_float8.py's cells)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import recorded, table  # noqa: E402

from tests.matrix import FLOOR_MULTIPLE  # noqa: E402
from tests.test_float8 import HYBRID, STRATEGIES, cells  # noqa: E402

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def parity(recipes: tuple[str, ...], hybrid: bool, out: Path) -> list[list]:
    from tests.matrix_run import run_cells

    wanted = cells(recipes, STRATEGIES + ([HYBRID] if hybrid else []))
    results = run_cells(wanted, out)
    rows = []
    for cell in wanted:
        kind, detail, figures = results[cell.id]
        rows.append([cell.feature.name.split()[-1], cell.strategy.name, kind, figures.get("deviation"),
                     figures.get("floor"), figures.get("ratio"), "" if kind == "parity" else detail[:120]])  # fmt: skip
    return rows


def gathers(recipes: tuple[str, ...], out: Path) -> list[dict]:
    """The comm counter's all-gather payload a step, gpt under fsdp x2 in bf16: without float8,
    and with each recipe (one multirun)."""
    common = ["experiment=smoke", "steps=3", "parallel=fsdp", "precision=bf16", "progress=false", "logger=none",
              "device=cpu"]  # fmt: skip
    _train([*common, f"hydra.run.dir={out / 'bf16'}"])
    _train(["-m", *common, "converters=[float8]", f"converters.float8.recipe={','.join(recipes)}",
            f"hydra.sweep.dir={out / 'float8'}"])  # fmt: skip
    plain = json.loads((out / "bf16" / "summary.json").read_text())
    runs = [json.loads((d / "summary.json").read_text()) for d in (out / "float8").iterdir() if d.is_dir()]
    rows = []
    for f8 in sorted(runs, key=lambda s: recipes.index(s["converters"]["float8"]["recipe"])):
        got = {k: s["comm_by_op"]["all_gather"]["mean_bytes"] for k, s in (("bf16", plain), ("float8", f8))}
        converted = 2 * 2 * f8["converters"]["float8"]["elements"]  # two gathers a step of 2 bytes an element
        rows.append({"recipe": f8["converters"]["float8"]["recipe"], "bf16": got["bf16"], "float8": got["float8"],
                     "whole": got["float8"] / got["bf16"],
                     "converted": (converted - (got["bf16"] - got["float8"])) / converted,
                     "all_gather": f8["converters"]["float8"]["fsdp_float8_all_gather"]})  # fmt: skip
    return rows


def _train(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tensorwise only, without hybrid")
    args = parser.parse_args()
    recipes = RECIPES[:1] if args.quick else RECIPES
    with tempfile.TemporaryDirectory() as tmp:
        bytes_rows = gathers(recipes, Path(tmp) / "gathers")
        rows = parity(recipes, not args.quick, Path(tmp) / "cells")
    print(f"gpt (4 layers of width 32), {len(rows)} cells, 4 steps, global batch 8, fp32 with emulated float8; a "
          f"cell passes within {FLOOR_MULTIPLE}x its floor: the worst relative loss gap over the steps of one "
          "process's float8 run summed in other orders\n")  # fmt: skip
    print(table(["recipe", "layout", "outcome", "loss gap", "float8 floor", "gap / floor", "why"], rows))
    print("\ntensorwise's floor is float8's own: one scale per tensor, so a batch summed as two halves casts each "
          "half's activations and gradients with its own scale, as two data-parallel ranks do. The rowwise recipes "
          "scale each row (a token's) and their floor is float32's.")  # fmt: skip
    print("\nAll-gather payload a step (comm counter), gpt under fsdp x2, bf16, 3 steps: the whole step's, and "
          "that of the converted weights (their bf16 bytes less what float8 saved)\n")  # fmt: skip
    print(table(["recipe", "float8 all-gather", "bf16 bytes", "float8 bytes", "whole step", "converted weights"],
                [[b["recipe"], "yes" if b["all_gather"] else "no", b["bf16"], b["float8"], f"{b['whole']:.3f}x", f"{b['converted']:.3f}x"]
                 for b in bytes_rows]))  # fmt: skip
    print(
        "\nThe rowwise recipes gather their weights in bf16 (torchao's float8 all-gather takes one scale per "
        "tensor), so their bytes stay as bf16's. The embeddings, norms and the head stay in bf16 in every recipe."
    )


if __name__ == "__main__":
    with recorded("float8"):
        main()
