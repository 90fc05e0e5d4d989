"""The test suite's time, per file and in all, as `make test` runs it: docs/results/suite.md.

    python benchmarks/suite.py                   # runs the default suite (pytest), then writes the table
    python benchmarks/suite.py --read FILE --wall S   # the table from a run's recorded times (no run)

Each test's seconds (setup + call + teardown) come from tests/conftest.py's HYDRADIST_DURATIONS
record, written as each test finishes. A test over 60 s must say why it cannot share a run or be
smaller: LONG holds the reasons, and a long test without one is listed as such.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from common import ROOT, table, write_result

BUDGET_S = 20 * 60  # make test on a clean clone, 2 cores
LONG_S = 60
MAKE_TEST = ["-n", "auto", "--dist", "loadfile", "--no-loadscope-reorder"]  # the Makefile's `make test`
# a test over LONG_S (its node id, or the start of it): why it cannot share a run or be smaller
SHARED_MATRIX = (
    "the first test of the file runs the module's matrix cells in one go (groups of workers of each world "
    "size, tests/matrix_run.py), the shared run every other cell's test reads"
)
LONG: dict[str, str] = {
    "tests/test_moe.py::test_the_default_balance_trains_as_one_process_under_ddp_fsdp_ep_and_pp": "one process's "
    "reference and the four layouts the default balance must equal it in (ddp, fsdp, ep, pp), with the dense "
    "model's ddp and fsdp runs the collectives are counted against: seven launches of a 2-block MoE Llama, the "
    "smallest that routes",
    "tests/test_callbacks.py::test_a_users_callback_sees_every_step": "docs/callbacks.md's StopAt from a package "
    "outside the repository: a run and its resume from the run's checkpoint, under each layout the issue names",
    "tests/test_matrix.py::test_covering_subset": SHARED_MATRIX,
    "tests/test_matrix_wide.py::test_covering_subset": SHARED_MATRIX,
    "tests/test_data_scale.py::test_the_curriculum_takes_effect_at_its_steps": "the first test of the file's "
    "shared curriculum fixture: four launches (one process; ddp x2 with 2 loader workers each on a stream with "
    "length and batch ramps; a resume mid-ramp; a resume at 4 ranks) that four tests read",
    "tests/test_measure.py::test_the_peak_of_a_100m_gpt": "the peak's parts must stand out of the ~0.5 GB that "
    "importing torch holds: 100M parameters (1.6 GB of state under ddp) is the smallest model that shows the "
    "breakdown; ddp and fsdp are its two runs",
    "tests/test_reliability.py::test_sigterm_to_every_slurm_task": "three launches of train.py as srun tasks (an "
    "uninterrupted run, one stopped by SIGTERM mid-run, its requeue resumed): each a fresh interpreter, as on SLURM",
    "tests/test_sweeps.py::test_every_preset_trains_two_steps[resnet_ddp_amp]": "the preset as a user gets it "
    "(resnet18, 16 images per rank, float16 autocast, BatchNorm synchronised over 2 ranks): float16 convolutions "
    "take CPU's slow path (a step of 8 images of 8x8: 1.9 s, against 0.14 s in fp32); shrinking it would "
    "test another preset",
    "tests/test_reliability.py::test_resume_across_an_epoch_boundary_is_bitwise[amp_device_augment]": "two runs "
    "of resnet18 under ddp and amp (10 steps, and 4 resumed past an epoch boundary) with the loss scale and the "
    "device augmentation's generators in play: the smallest model the device-augmentation path serves",
    "tests/test_scale.py::test_fsdp_at_4_ranks_peaks": "peak RSS read from outside (/usr/bin/time) of two fresh "
    "launches of a 100M gpt, one process and fsdp over 4 ranks: the state must stand out of the ~0.5 GB each "
    "process holds for importing torch, and a peak from outside cannot be shared with another run",
    "tests/test_readme.py::test_every_readme_command_runs": "every command of the README's bash blocks: the tools "
    "that read the first run (evaluate, generate, report, the planner) run for real, each a fresh interpreter as "
    "a user types it; the train.py lines are composed and validated in this process",
    "tests/test_plan.py::test_auto_under_a_budget_below_ddp": "parallel=auto under a 1.5 GB budget at 4 ranks, "
    "which ddp's peak must exceed and the sharded layouts' fit: a 100M gpt is the smallest whose state stands out "
    "of the ~0.65 GB a process holds; three steps, as a pipeline's first also infers its stages' shapes",
    "tests/test_strategies.py::test_every_strategy_follows_the_single_process_trajectory_world_2": "17 layouts "
    "(fsdp1/2 and their accumulation, tp, every pp schedule) trained in one group of 2 workers, the one run every "
    "parity and planner assertion of the file reads: about 2 s a layout",
    "tests/test_reliability.py::test_a_signal_saves_exits_and_resume_auto_continues_bitwise": "three launches "
    "of train.py (uninterrupted, signalled at step 5, resumed): the signal reaches a launcher and its workers, "
    "each a fresh interpreter as a scheduler starts it; fsdp's save is sharded, so its case cannot share ddp's",
    "tests/test_integrity.py::test_a_damaged_newest_checkpoint": "each kind of damage launches train.py twice "
    "(the damaged checkpoint named, refused; resume=auto, which skips it and trains 5 steps), and the first case "
    "also makes the file's shared run (10 steps on 2 ranks, saving at 5 and 10) that every case copies",
    "tests/test_dry_run.py::test_the_dry_run_at_4_ranks": "the file's shared run: two configs trained for real "
    "on 4 gloo ranks in one group of workers (FSDP2 x tp with a padded shard, a pipeline over tp), which the dry "
    "run of each must equal; a real run is what the dry run is checked against",
    "tests/test_scale.py::test_two_torchrun_agents_form_one_run_as_two_nodes": "two torchrun agents meeting "
    "through c10d rendezvous, as two nodes, and the 2-worker train.py they must equal: three fresh launchers, "
    "the rendezvous being what is tested",
    "tests/test_sweeps.py::test_two_processes_started_as_slurm_tasks": "two fresh interpreters started as srun "
    "tasks (no launcher between), each importing torch and joining through SLURM's variables: under 20 s alone, "
    "longer when it overlaps another worker's multi-process test",
}


def why_long(name: str) -> str:
    return next((why for start, why in LONG.items() if name.startswith(start)), "(no reason recorded)")


def run_suite(record: Path, args: list[str]) -> tuple[float, int]:
    """(wall seconds, pytest's exit code) of the default suite, each test's time into `record`."""
    env = {**os.environ, "HYDRADIST_DURATIONS": str(record), "WANDB_MODE": "offline"}
    started = time.perf_counter()
    code = subprocess.call(
        [sys.executable, "-m", "pytest", *MAKE_TEST, "-q", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env
    )
    return time.perf_counter() - started, code


def read_record(record: Path) -> dict[str, float]:
    """{test id: seconds}, its setup, call and teardown summed."""
    tests: dict[str, float] = defaultdict(float)
    for line in record.read_text().splitlines():
        nodeid, _, seconds, _ = line.split("\t")
        tests[nodeid] += float(seconds)
    return tests


def report(tests: dict[str, float], wall: float, command: str) -> str:
    files: dict[str, list[float]] = defaultdict(list)
    for nodeid, seconds in tests.items():
        files[nodeid.split("::")[0]].append(seconds)
    rows = sorted(([f, len(t), sum(t), max(t)] for f, t in files.items()), key=lambda r: -r[2])
    long = sorted(((s, n) for n, s in tests.items() if s > LONG_S), reverse=True)
    verdict = "within" if wall <= BUDGET_S else "OVER"
    lines = [
        f"Whole suite: {wall / 60:.1f} min wall ({verdict} the {BUDGET_S // 60}-minute budget), "
        f"{len(tests)} tests, {sum(tests.values()) / 60:.1f} min in tests.",
        "",
        table(
            ["file", "tests", "seconds", "longest test s"], [[f, n, round(s, 1), round(m, 1)] for f, n, s, m in rows]
        ),
        "",
        f"Tests over {LONG_S} s, and why each cannot share a run or be smaller:",
        "",
        table(["test", "seconds", "why"], [[n, round(s, 1), why_long(n)] for s, n in long]),
    ]
    print("\n".join(lines))
    write_result("suite", command, "", "\n".join(lines))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--read", type=Path, help="a HYDRADIST_DURATIONS record of a run made elsewhere")
    p.add_argument("--wall", type=float, help="that run's wall seconds (with --read)")
    p.add_argument("--command", default="make test (clean clone)", help="what made the record, for the table")
    p.add_argument("pytest_args", nargs="*")
    a = p.parse_args()
    if a.read:
        report(read_record(a.read), a.wall or 0.0, a.command)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "durations.tsv"
        wall, code = run_suite(record, a.pytest_args)
        report(read_record(record), wall, "python benchmarks/suite.py")
    return code


if __name__ == "__main__":
    sys.exit(main())
