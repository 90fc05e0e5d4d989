"""The checks only a CUDA GPU can run, as rows saved the moment each finishes (docs/gpu.md).

Rows, most valuable first (a call cut short keeps what it ran):
- probe: nvidia-smi, the versions, an 8192^3 bf16 matmul and a device copy timed with CUDA events:
  the measured ceilings every later MFU is judged against;
- the headline: a ~1B Llama and a ~1B gpt, bf16, compiled: tokens/s, MFU against the datasheet's
  peak and against the measured ceiling, the planner's forecast beside the measurement;
- eager against compile (the Llama), fp32 with TF32, bf16, amp fp16 with its loss scale;
- FSDP with CPU offload (functional, its model state where it lives), the memory breakdown against
  the allocator and the planner, CUDA against CPU parity (losses within 1e-3), `pytest -m gpu`;
- two-GPU rows (a NCCL hang named from the flight recorder, cp ring against torch's) say so and
  are skipped on one GPU;
- float8 (benchmarks/gpu_float8.py): the headline Llama's tokens/s with float8 linears against
  bf16, and a small Llama's loss after 200 steps against bf16's; skipped, saying so, without torchao.

Each row appends a JSON line to OUT/rows.jsonl and rewrites OUT/gpu.md; the run folders' summaries
and metrics go into OUT/runs.tar.gz. A row's timeout is the smaller of its own and the time left
of `--budget` (from the start); a failed row never stops the next. `--stand-in` runs every row's
CPU stand-in (tiny shapes, device=cpu): the rehearsal (benchmarks/gpu_rehearsal.sh).
`--render ROWS.jsonl` writes docs/results/gpu.md from the rows that came back.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import table  # noqa: E402
from gpu_float8 import ROWS as FLOAT8_ROWS  # noqa: E402
from gpu_rows import ROWS as CORE_ROWS  # noqa: E402
from gpu_rows import Context, machine  # noqa: E402

# the float8 rows last: they need torchao (carried in .whl/, else skipped saying so), and the
# two-GPU rows before them take no time on one GPU
ROWS = {**CORE_ROWS, **FLOAT8_ROWS}

HEADER = ["row", "status", "figures", "wall s"]


def markdown(rows: list[dict], where: str) -> str:
    cells = [[r["row"], r["status"], r["figures"], round(r["wall_s"])] for r in rows]
    return f"# GPU checks\n\n{where}\n\n{table(HEADER, cells)}\n"


class Sink:
    """Where rows go as they finish: OUT/rows.jsonl (appended), OUT/gpu.md and OUT/runs.tar.gz
    (rewritten). Both survive a command cut at its limit: only files under OUT come back."""

    def __init__(self, out: Path, where: str):
        self.out, self.where, self.rows = out, where, []
        out.mkdir(parents=True, exist_ok=True)
        (out / "rows.jsonl").write_text("")

    def add(self, row: dict, runs: Path) -> None:
        self.rows.append(row)
        with open(self.out / "rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        (self.out / "gpu.md").write_text(markdown(self.rows, self.where))
        archive(runs, self.out / "runs.tar.gz")
        print(f"[{row['status']}] {row['row']} ({row['wall_s']:.0f} s): {row['figures']}", flush=True)


def archive(runs: Path, path: Path) -> None:
    """The run folders' small files (summary, metrics, the job's log tail) in one archive."""
    import tarfile

    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for f in sorted(runs.rglob("*")):
            if f.is_file() and f.name in ("summary.json", "metrics.jsonl", "job.log") and f.stat().st_size < 2**22:
                tar.add(f, arcname=str(f.relative_to(runs)))
    tmp.replace(path)


def run_rows(ctx: Context, names: list[str], sink: Sink, fail_row: str | None) -> None:
    for name in names:
        spec = ROWS[name]
        left = ctx.deadline - time.time()
        t0 = time.time()
        if left < spec.least_s:
            row = {"row": name, "status": "skipped", "figures": f"time budget spent ({left:.0f} s left; "
                   f"`--rows {name}` runs it in a second call)", "data": {}}  # fmt: skip
        else:
            try:
                if name == fail_row:
                    raise RuntimeError("injected failure (--fail-row)")
                status, figures, data = spec.run(ctx, min(spec.timeout_s, left))
                row = {"row": name, "status": status, "figures": figures, "data": data}
            except Exception as err:  # a failed row never stops the next
                row = {"row": name, "status": "failed", "figures": f"{type(err).__name__}: {err}"[:300], "data": {}}
        sink.add({**row, "wall_s": time.time() - t0}, ctx.runs)


def render(paths: list[Path]) -> Path:
    """docs/results/gpu.md from the rows.jsonl files that came back from the lent machine, in
    order: a row of a later call (its second try) replaces the same row of an earlier one."""
    rows: dict[str, dict] = {}
    for path in paths:
        for row in [json.loads(line) for line in path.read_text().splitlines() if line.strip()]:
            if row["status"] != "skipped" or row["row"] not in rows:
                rows[row["row"]] = row
    probe = rows.get("probe", {"data": {}})
    where = f"`bash benchmarks/gpu.sh` (docs/gpu.md) on {probe['data'].get('machine', 'an unrecorded machine')}"
    path = Path(os.environ.get("HYDRADIST_RESULTS_DIR") or ROOT / "docs" / "results") / "gpu.md"
    path.write_text(markdown(list(rows.values()), where))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "gpu-out"),
                        help="where rows.jsonl, gpu.md and runs.tar.gz go (default: $OUT)")  # fmt: skip
    parser.add_argument("--stand-in", action="store_true", help="every row's CPU stand-in (the rehearsal)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"which rows, in order (default: {','.join(ROWS)})")
    parser.add_argument("--budget", type=float, default=None, help="seconds for every row (default 330; stand-in 540)")
    parser.add_argument("--fail-row", default=None, help="a row that fails at its start (tests the rows after it)")
    parser.add_argument("--no-compile", default=None, help="why compiled rows cannot run here (set by gpu.sh)")
    parser.add_argument("--render", type=Path, nargs="+", default=None,
                        help="write docs/results/gpu.md from these rows.jsonl (the calls' files, in order)")  # fmt: skip
    args = parser.parse_args()
    if args.render:
        sys.exit(print(f"written: {render(args.render)}"))
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    if unknown := [n for n in names if n not in ROWS]:
        sys.exit(f"error: --rows: unknown {', '.join(unknown)}; allowed: {', '.join(ROWS)}")
    import torch

    if not args.stand_in and not torch.cuda.is_available():
        sys.exit("error: no CUDA device visible; --stand-in runs the CPU stand-ins (benchmarks/gpu_rehearsal.sh)")
    budget = args.budget or (540 if args.stand_in else 330)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Context(Path(tmp), args.stand_in, time.time() + budget, args.no_compile)
        sink = Sink(args.out, f"`bash benchmarks/gpu.sh{' --stand-in' if args.stand_in else ''}` on {machine()}")
        run_rows(ctx, names, sink, args.fail_row)
    print(f"\n{markdown(sink.rows, sink.where)}\nwritten: {args.out}/rows.jsonl, gpu.md, runs.tar.gz")
    sys.exit(1 if any(r["status"] == "failed" for r in sink.rows) else 0)


if __name__ == "__main__":
    main()
