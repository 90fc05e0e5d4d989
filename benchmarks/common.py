"""Shared by the benchmark scripts: compose configs as train.py would and print tables."""

from __future__ import annotations

import io
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from framework.doors.compose import compose_run  # noqa: E402
from framework.run.sweep import run_configs  # noqa: E402


def on_cpu(overrides: list[str]) -> list[str]:
    """The benchmarks measure CPU runs (gloo), also on a machine with GPUs, where device=auto
    would pick CUDA: pinned unless the overrides choose a device (benchmarks/gpu.py does)."""
    return overrides if any(o.startswith("device=") for o in overrides) else [*overrides, "device=cpu"]


def config(overrides: list[str]) -> dict[str, Any]:
    """Compose and validate like `python train.py OVERRIDES`; a resolved dict."""
    return compose_run(on_cpu(["logger=none", "progress=false", *overrides]))


def run(rows: dict[str, list[str]], world: int, common: list[str]) -> dict[str, dict[str, Any]]:
    """Train every row's config back to back on `world` local workers; {row: summary}."""
    configs = {name: config([*common, f"launch.nproc_per_node={world}", *args]) for name, args in rows.items()}
    with tempfile.TemporaryDirectory() as out:
        return run_configs(configs, world, out)


def table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        if isinstance(v, int):
            return f"{v:,}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, command: str, header: str, text: str) -> Path:
    """docs/results/<name>.md: the table, the command that made it and the machine it ran on.
    HYDRADIST_RESULTS_DIR moves it (the tests set it, so a quick run never replaces a result)."""
    import platform

    import torch

    out = Path(os.environ.get("HYDRADIST_RESULTS_DIR", ROOT / "docs" / "results")) / f"{name}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"
    )
    parts = [f"# {name}", f"`{command}`", f"Machine: {machine}", header, text]
    out.write_text("\n\n".join(part for part in parts if part) + "\n")
    return out


class _Tee(io.TextIOBase):
    def __init__(self, *streams: TextIO):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


@contextmanager
def recorded(name: str) -> Iterator[None]:
    """What the benchmark prints inside goes to the console and to docs/results/<name>.md, under
    the command that ran it (this invocation) and the machine (write_result)."""
    buffer = io.StringIO()
    with redirect_stdout(_Tee(sys.stdout, buffer)):
        yield
    command = " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]])
    print(f"written: {write_result(name, command, '', buffer.getvalue().strip())}")
