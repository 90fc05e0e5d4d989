import os
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# benchmarks run by the tests write their tables here, not over docs/results
os.environ.setdefault("HYDRADIST_RESULTS_DIR", tempfile.mkdtemp(prefix="hydradist-results-"))
# the suite under forced ATen kernels (ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU) compiles into a
# cache of its own, set before anything imports torch._dynamo (framework/machine.py)
from framework.machine import keyed_inductor_cache  # noqa: E402

keyed_inductor_cache()


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the suite also runs where xdist is not installed
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (make test): one pytest worker per two cores, at least two, and no more than the
    memory holds. Most tests start two to four ranks of their own, which keep a core each busy
    only part of the time (start-up, gloo waits), so two workers fill a 2-core machine: a third
    left it no faster (a clean-clone run of 2026-12-03 was slower with three)."""
    cores = os.cpu_count() or 1
    try:
        mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError):
        mem_gib = 16.0
    return max(1, min(max(2, cores // 2), int(mem_gib // 5), 8))


def _measured_file_seconds() -> dict[str, float]:
    """{test file: seconds} of the last recorded clean-clone suite (docs/results/suite.md)."""
    seconds = {}
    suite = Path(__file__).resolve().parents[1] / "docs" / "results" / "suite.md"
    try:
        for line in suite.read_text().splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) == 4 and cells[0].startswith("tests/") and cells[2].replace(".", "").isdigit():
                seconds[cells[0]] = float(cells[2])
    except OSError:
        pass
    return seconds


def _longest_files_first(items) -> None:
    """Order the files longest first (by the last measured suite; a new file counts as long), so
    that xdist's per-file scheduling (`--dist loadfile`) deals out the long files before the short
    ones and the workers finish together. Within a file the order is kept."""
    seconds = _measured_file_seconds()
    first_seen = {}
    for item in items:
        first_seen.setdefault(item.nodeid.split("::")[0], len(first_seen))
    unknown = max(seconds.values(), default=0.0)
    items.sort(key=lambda it: (-seconds.get(it.nodeid.split("::")[0], unknown), first_seen[it.nodeid.split("::")[0]]))


def pytest_collection_modifyitems(config, items):
    """Long files first (see _longest_files_first). Tests marked `gpu` need a CUDA device:
    skipped where none is visible (benchmarks/gpu.sh runs them on a GPU machine with `-m gpu`)."""
    import pytest
    import torch

    _longest_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (benchmarks/gpu.sh runs the gpu tests)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    """HYDRADIST_DURATIONS=FILE: each test's seconds (setup + call + teardown) appended as it
    finishes, so a long run's times can be read while it runs (benchmarks/suite.py reads them)."""
    path = os.environ.get("HYDRADIST_DURATIONS")
    if path and "PYTEST_XDIST_WORKER" not in os.environ:  # under xdist the controller records
        with open(path, "a") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.duration:.3f}\t{report.outcome}\n")
