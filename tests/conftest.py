import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# benchmarks run by the tests write their tables here, not over docs/results
os.environ.setdefault("HYDRADIST_RESULTS_DIR", tempfile.mkdtemp(prefix="hydradist-results-"))


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need a CUDA device: skipped where none is visible (benchmarks/gpu.sh
    runs them on a GPU machine with `-m gpu`)."""
    import pytest
    import torch

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
    if path:
        with open(path, "a") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{report.duration:.3f}\t{report.outcome}\n")
