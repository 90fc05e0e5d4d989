"""How fast a second `train.py` into a live run's folder is refused (issue 25: within 10 s).

A first run trains into folder D; once it holds D/run.lock, a second `train.py` into D is timed
from its start to its exit (which must be 2, with the line naming the holder). Repeated
`--trials` times; the first run is stopped at the end.

    python benchmarks/run_lock.py               # 3 trials
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT, table, write_result

ENV = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}


def first_run(folder: Path) -> subprocess.Popen:
    args = [sys.executable, str(ROOT / "train.py"), "experiment=smoke", "steps=100000", f"hydra.run.dir={folder}"]
    proc = subprocess.Popen(args, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    lock = folder / "run.lock"
    while not (lock.exists() and lock.read_text().strip()):  # the holder writes itself in once it has the flock
        if proc.poll() is not None:
            raise SystemExit(f"the first run exited early ({proc.returncode})")
        time.sleep(0.2)
    return proc


def second_run(folder: Path) -> tuple[float, int, str]:
    args = [sys.executable, str(ROOT / "train.py"), "experiment=smoke", "steps=5", f"hydra.run.dir={folder}"]
    start = time.perf_counter()
    done = subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True)
    last = (done.stdout + done.stderr).strip().splitlines()[-1]
    return time.perf_counter() - start, done.returncode, last


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=3)
    opts = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "run"
        first = first_run(folder)
        holder = json.loads((folder / "run.lock").read_text())
        try:
            for trial in range(1, opts.trials + 1):
                seconds, code, last = second_run(folder)
                assert code == 2 and str(holder["pid"]) in last, (code, last)
                rows.append([trial, seconds, code])
        finally:
            first.terminate()
            first.wait()
    rows.append(["median", statistics.median(r[1] for r in rows), ""])
    text = table(["trial", "second run: start to exit (s)", "exit code"], rows)
    header = "A second `train.py experiment=smoke` into the folder of a live run, refused before any worker starts."
    print(text)
    write_result("run_lock", f"python benchmarks/run_lock.py --trials {opts.trials}", header, text)


if __name__ == "__main__":
    main()
