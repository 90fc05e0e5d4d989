"""What happens to the bytes on disk: damaged checkpoints are detected and skipped, a save that
fails (a file size limit standing in for a full disk) stops cleanly or warns, and a run folder
has one writer. Real runs of train.py, real files, real processes; no file system is mocked."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, losses, read_metrics, read_summary, train_cli

SMOKE = ["experiment=smoke", "logger=none"]
RUN = [*SMOKE, "steps=10", "checkpoint.every=5"]  # 2 ranks (ddp): shards __0_0 and __1_0.distcp
SHARD = "checkpoints/step-000010/__1_0.distcp"


def dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess, int]:
    """An uninterrupted run saving at steps 5 and 10, started into a folder whose lock a dead
    process left behind (the lock tests read its output)."""
    run = tmp_path_factory.mktemp("integrity") / "reference"
    run.mkdir()
    pid = dead_pid()
    (run / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "job": f"local-{pid}"}))
    proc = train_cli(RUN, run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc, pid


def copy_run(reference, dest: Path, drop_newest: bool = False) -> Path:
    shutil.copytree(reference[0], dest)
    if drop_newest:  # as if the run had saved step 5 only
        shutil.rmtree(dest / "checkpoints" / "step-000010")
    return dest


def tree_digests(*paths: Path) -> dict[str, str]:
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()]
    return {str(f): hashlib.sha256(f.read_bytes()).hexdigest() for f in files}


def error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.strip()]


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 400] = bytes(b ^ 0xFF for b in data[middle : middle + 400])
    path.write_bytes(bytes(data))


DAMAGE = {"truncated": (truncate, "size"), "flipped": (flip, "xxh3_64 digest"), "missing": (Path.unlink, "missing")}


# ----------------------------------------------------------------------------- damaged checkpoints


# the default run keeps the flipped bytes (a digest mismatch); a cut or a missing shard: `make test-all`
@pytest.mark.parametrize("kind", [k if k == "flipped" else pytest.param(k, marks=pytest.mark.slow) for k in DAMAGE])
def test_a_damaged_newest_checkpoint_is_refused_by_name_and_auto_resumes_the_previous_bitwise(
    reference, tmp_path, kind
):
    """One shard of step 10 is cut in half, has 400 bytes flipped, or is gone. Named explicitly,
    the checkpoint is refused with one line naming the file, and nothing on disk changes;
    `resume=auto` skips it with one line and continues from step 5: the losses are the
    uninterrupted run's, bit for bit. The damaged folder is kept for inspection."""
    damage, why = DAMAGE[kind]
    run = copy_run(reference, tmp_path / "run")
    damage(run / SHARD)
    bad = run / "checkpoints" / "step-000010"
    before = tree_digests(bad)

    proc = train_cli([*RUN, "steps=12", f"checkpoint.resume={bad}"], tmp_path / "explicit")  # steps after it
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = error_lines(proc)
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint.resume="), proc.stderr[-3000:]
    assert f"{run / SHARD}: {why}" in lines[0]
    assert tree_digests(bad) == before and sorted(os.listdir(bad)) == sorted(Path(p).name for p in before)

    proc = train_cli([*RUN, "checkpoint.resume=auto"], run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("checkpoint.resume=auto: skipping")]
    assert len(skipped) == 1 and f"{run / SHARD}: {why}" in skipped[0], proc.stdout[-3000:]
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 11))
    assert losses(run) == losses(reference[0])  # bitwise, fp32
    kept = run / "checkpoints" / "superseded-step-000010"  # the new step-10 save did not overwrite it
    assert tree_digests(kept) == {p.replace(str(bad), str(kept)): d for p, d in before.items()}
    assert read_summary(run)["checkpoint"]["verify_s"] > 0
    assert "taking over" not in proc.stderr  # the reference run released its lock


def test_metadata_is_read_without_unpickling_anything_else(reference, tmp_path):
    """A `.metadata` that would run code when unpickled is reported unreadable, and the code
    never runs."""
    from framework.checkpoint.resume import verify
    from framework.dist import DistInfo

    ckpt = tmp_path / "step-000005"
    shutil.copytree(reference[0] / "checkpoints" / "step-000005", ckpt)
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    import pickle

    (ckpt / ".metadata").write_bytes(pickle.dumps(Payload()))
    import torch

    problem = verify(str(ckpt), "full", DistInfo(0, 1, 0, 1, torch.device("cpu"), None))
    assert problem is not None and problem.startswith(f"{ckpt / '.metadata'}: unreadable"), problem
    assert "posix.system" in problem and not marker.exists()


# ----------------------------------------------------------------------------- failed saves


def train_limited(args: list[str], run_dir: Path, max_file_bytes: int) -> subprocess.CompletedProcess:
    """train.py with RLIMIT_FSIZE on it and its workers: a write past the limit fails with EFBIG
    (Python ignores SIGXFSZ), as a write to a full disk fails with ENOSPC. The limit is above
    every run file and below a checkpoint shard."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"WANDB_MODE": "offline"}
    cmd = [sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run_dir}"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, preexec_fn=limit)


LIMIT = 100_000  # the smoke run's shards are about 300 kB; its other files a few kB


def test_a_failed_save_stops_with_one_line_and_the_previous_checkpoint_verifies_and_resumes(reference, tmp_path):
    from framework.checkpoint.integrity import verify_share

    run = copy_run(reference, tmp_path / "run", drop_newest=True)
    assert all(os.path.getsize(f) > LIMIT for f in (reference[0] / "checkpoints" / "step-000010").glob("*.distcp"))
    proc = train_limited([*RUN, "checkpoint.resume=auto"], run, LIMIT)
    assert proc.returncode == 1
    lines = error_lines(proc)
    assert len(lines) == 1, proc.stderr[-3000:]
    assert (
        f"saving checkpoint {run / 'checkpoints' / 'step-000010'} failed" in lines[0] and "File too large" in lines[0]
    )
    assert read_summary(run)["status"] == "failed"
    assert not (run / "checkpoints" / "step-000010").exists()  # removed: the space it held given back
    assert verify_share(str(run / "checkpoints" / "step-000005"), "full") is None

    proc = train_cli([*RUN, "checkpoint.resume=auto"], run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(run) == losses(reference[0])


def test_on_error_warn_trains_on_past_a_failed_save(reference, tmp_path):
    from framework.checkpoint.integrity import verify_share

    run = copy_run(reference, tmp_path / "run", drop_newest=True)
    proc = train_limited([*RUN, "steps=12", "checkpoint.resume=auto", "checkpoint.on_error=warn"], run, LIMIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: saving checkpoint")]
    assert len(warnings) == 2 and "step-000010" in warnings[0] and "step-000012" in warnings[1]  # retried
    summary = read_summary(run)
    assert summary["status"] == "ok" and summary["checkpoint"]["failed_saves"] == 2
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 13))
    assert verify_share(str(run / "checkpoints" / "step-000005"), "full") is None


# ----------------------------------------------------------------------------- one writer per folder


def test_a_second_run_into_a_live_folder_exits_2_naming_the_holder_and_changes_nothing(tmp_path):
    run = tmp_path / "live"
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"WANDB_MODE": "offline"}
    cmd = [sys.executable, str(ROOT / "train.py"), *SMOKE, "steps=100000", "checkpoint.every=3", f"hydra.run.dir={run}"]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "step-000003" / ".metadata").exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first run did not save"
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGSTOP)  # alive and holding the folder, but writing nothing meanwhile
        before = tree_digests(run / "metrics.jsonl", run / "checkpoints")
        started = time.monotonic()
        proc = train_cli([*SMOKE, "steps=4"], run)
        print(f"refused after {time.monotonic() - started:.1f} s")
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert "Traceback" not in proc.stderr
        lines = error_lines(proc)
        assert len(lines) == 1 and f"{run} is in use by another run" in lines[0], proc.stderr[-3000:]
        assert f"pid {first.pid}" in lines[0] and f"host {socket.gethostname()}" in lines[0]
        assert tree_digests(run / "metrics.jsonl", run / "checkpoints") == before
    finally:
        os.killpg(first.pid, signal.SIGCONT)
        first.send_signal(signal.SIGTERM)  # a preemption: it saves and exits
        try:
            first.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(first.pid, signal.SIGKILL)
            first.communicate()
    assert first.returncode == 143
    assert (run / "run.lock").read_text() == ""  # released


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_line(reference):
    run, proc, pid = reference
    lines = [line for line in proc.stderr.splitlines() if line.startswith("run folder lock: taking over")]
    assert len(lines) == 1 and f"pid {pid}" in lines[0] and "not running" in lines[0], proc.stderr[-3000:]
    assert (run / "run.lock").read_text() == ""


HOLD = """
import os, sys
from framework.doors.launch import hold_run_folder
from framework.checkpoint.runlock import FolderInUse
try:
    lock = hold_run_folder(sys.argv[1])
except FolderInUse as err:
    print("refused:", err, flush=True)
    sys.exit(2)
print("held", flush=True)
sys.stdin.read()  # hold until the test closes stdin
lock.release()
"""


def test_the_ranks_of_one_job_share_the_lock_and_another_job_is_refused(tmp_path):
    """As under torchrun: rank 0 takes the lock, rank 1 of the same job goes on, rank 0 of
    another job is refused naming the holder."""

    def rank(r: int, run_id: str) -> subprocess.Popen:
        env = os.environ | {"RANK": str(r), "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": run_id,
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999", "PYTHONPATH": str(ROOT)}  # fmt: skip
        return subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], env=env, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)  # fmt: skip

    holder = rank(0, "job-a")
    try:
        assert holder.stdout.readline().strip() == "held"
        peer = rank(1, "job-a")
        assert peer.stdout.readline().strip() == "held"
        peer.communicate("")
        other = rank(0, "job-b")
        out, _ = other.communicate("", timeout=60)
        assert other.returncode == 2 and f"pid {holder.pid}" in out and "torchrun-job-a" in out, out
    finally:
        holder.communicate("")
    assert holder.returncode == 0 and (tmp_path / "run.lock").read_text() == ""
