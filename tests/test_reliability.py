"""What clusters do to runs: preemption, resumes across epochs and layouts, hung ranks,
non-finite losses. Faults are injected with HYDRADIST_FAULT="RANK:STEP[:KIND]"
(framework/run/resilience.py); everything else is a real run of train.py."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from tests.helpers import losses, read_metrics, read_summary, train_cli, world_config
from tests.test_images import make_image_folder

SMOKE = ["experiment=smoke", "logger=none", "device=cpu"]  # CPU runs, on a GPU machine too


@pytest.fixture
def marked(monkeypatch):
    """Every process of the runs started in this test carries a marker in its environment, so
    the test can tell whether any is left behind."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv("HYDRADIST_TEST_MARK", mark)
    return mark


def processes_with(mark: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if f"HYDRADIST_TEST_MARK={mark}".encode() in Path(f"/proc/{pid}/environ").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def assert_no_process_left(mark: str, wait_s: float = 5.0) -> None:
    """No process of the run remains (helpers such as multiprocessing's resource tracker get a
    moment to see their parent gone)."""
    deadline = time.monotonic() + wait_s
    while processes_with(mark) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_with(mark) == [], "processes of the run are left behind"


def assert_clean_exit(proc, mark: str) -> None:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "leaked semaphore" not in proc.stderr, proc.stderr[-3000:]
    assert_no_process_left(mark)


def checkpoint_meta(path: Path) -> dict:
    return json.loads((path / "trainer.json").read_text())


# ----------------------------------------------------------------------------- preemption


# the default run keeps ddp's SIGTERM; Ctrl-C on one process and fsdp's sharded save run in `make test-all`
@pytest.mark.parametrize(
    "parallel,sig",
    [pytest.param("none", "SIGINT", marks=pytest.mark.slow), ("ddp", "SIGTERM"),
     pytest.param("fsdp", "SIGTERM", marks=pytest.mark.slow)],
)  # fmt: skip
def test_a_signal_saves_exits_and_resume_auto_continues_bitwise(tmp_path, monkeypatch, marked, parallel, sig):
    """SIGTERM (SIGINT: Ctrl-C) reaches train.py at step 5 (sent by rank 0 to its launcher, as a
    scheduler would): every rank stops after the same step, saves, and the run exits 143 (130)
    with one line saying how to resume. `checkpoint.resume=auto` into the same run directory then
    gives the losses of an uninterrupted run, bit for bit."""
    args = [*SMOKE, f"parallel={parallel}", "steps=60", "schedule.warmup_steps=4"]
    clean = tmp_path / "clean"
    assert train_cli(args, clean).returncode == 0

    run = tmp_path / "run"
    monkeypatch.setenv("HYDRADIST_FAULT", f"0:5:{sig.lower()}")
    proc = train_cli(args, run)
    assert proc.returncode == {"SIGTERM": 143, "SIGINT": 130}[sig], proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("preempted")]
    assert len(lines) == 1 and f"hydra.run.dir={run} checkpoint.resume=auto" in lines[0], proc.stderr[-3000:]
    assert_clean_exit(proc, marked)
    summary = read_summary(run)
    assert summary["status"] == "preempted" and summary["signal"] == sig
    stopped = summary["step"]
    assert 5 <= stopped < 60 and Path(summary["checkpoint"]).name == f"step-{stopped:06d}"

    before = read_metrics_lines(run)
    assert len(before) == stopped

    monkeypatch.delenv("HYDRADIST_FAULT")
    proc = train_cli([*args, "checkpoint.resume=auto"], run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_resumed(proc, run, before, stopped)
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 61))
    assert losses(run) == losses(clean)  # bitwise, fp32


def assert_resumed(proc, run: Path, before: list[str], step: int) -> None:
    """The run loaded step-N and says so, and kept the metric lines of steps 1..N as written
    (a fresh start would rewrite them: their step times differ)."""
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("resumed from step")]
    assert said == [f"resumed from step {step} (checkpoint {run / 'checkpoints' / f'step-{step:06d}'})"], said
    assert read_metrics_lines(run)[:step] == before[:step]


def test_resume_auto_continues_from_the_newest_checkpoint_and_says_so(tmp_path):
    """The lean default-run check of `checkpoint.resume=auto`: one process, 6 steps with a
    checkpoint at 3 (the one at 6 removed), resumed into the same run directory."""
    args = [*SMOKE, "parallel=none", "steps=6", "checkpoint.every=3"]
    run = tmp_path / "run"
    assert train_cli(args, run).returncode == 0
    import shutil

    shutil.rmtree(run / "checkpoints" / "step-000006")
    before, first = read_metrics_lines(run), losses(run)
    proc = train_cli([*args, "checkpoint.resume=auto"], run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_resumed(proc, run, before, 3)
    assert [m["step"] for m in read_metrics(run)] == list(range(1, 7))
    assert losses(run) == first  # bitwise, fp32


@pytest.mark.slow  # the default run signals a launcher's workers (above) and forms a run of SLURM tasks (test_sweeps)
def test_sigterm_to_every_slurm_task_stops_the_run_together(tmp_path, marked):
    """As SLURM does before a time limit: SIGTERM to every task of `srun python train.py` (no
    torchrun in between). Both ranks stop after the same step and exit 143; the requeued job
    (same job id, same run directory) resumes with `checkpoint.resume=auto` and continues as an
    uninterrupted run does."""
    import signal

    from tests.helpers import free_port, slurm_tasks, task_outputs, wait_tasks

    def tasks(steps: int):
        args = [*SMOKE, f"steps={steps}", "schedule=constant", "schedule.warmup_steps=2",
                f"launch.master_port={free_port()}", "checkpoint.resume=auto"]  # fmt: skip
        return slurm_tasks(args, tmp_path, job="77")

    run = tmp_path / "outputs" / "jobs" / "slurm-77-0"
    procs = tasks(5000)
    deadline = time.monotonic() + 120
    while not ((run / "metrics.jsonl").exists() and len(read_metrics_lines(run)) >= 3):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the run did not start"
        time.sleep(0.05)
    for p in procs:
        p.send_signal(signal.SIGTERM)
    assert wait_tasks(procs, tmp_path, timeout=120) == [143, 143], task_outputs(tmp_path, 2)
    lines = [line for r in range(2) for line in (tmp_path / f"task{r}.log").read_text().splitlines()]
    assert sum(line.startswith("preempted") for line in lines) == 1  # rank 0's line
    stopped = read_summary(run)["step"]
    assert_no_process_left(marked)

    procs = tasks(stopped + 4)  # the requeued job
    assert wait_tasks(procs, tmp_path, timeout=300) == [0, 0], task_outputs(tmp_path, 2)
    local = tmp_path / "local"
    proc = train_cli([*SMOKE, f"steps={stopped + 4}", "schedule=constant", "schedule.warmup_steps=2"], local)
    assert proc.returncode == 0
    assert losses(run) == pytest.approx(losses(local), rel=1e-6)


def read_metrics_lines(run: Path) -> list[str]:
    return (run / "metrics.jsonl").read_text().splitlines()


# ----------------------------------------------------------------------------- complete state

TINY_GPT = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "progress=false", "logger=none"]
EPOCH_CASES = {
    # data small enough that an epoch ends within the first 6 steps
    "distributed": [*SMOKE, "data.max_bytes=1200", "model.dropout=0.1"],  # dropout: the RNG's state matters
    "rank_batch_sizes": [*SMOKE, "data.max_bytes=1200", "data.rank_batch_sizes=[3,5]"],
    "length_grouped": ["experiment=gpt_varlen", *TINY_GPT, "data.sampler=length_grouped",
                       "data.num_samples=40", "data.batch_size=4"],
    "token_budget": ["experiment=lstm_token_budget", "logger=none", "progress=false", "data.num_samples=64",
                     "data.max_tokens=256"],
    "amp_device_augment": ["experiment=resnet_ddp_amp", "logger=none", "progress=false", "data.source=folder",
                           "data.batch_size=2", "data.num_workers=0"],
}  # fmt: skip


SLOW = pytest.mark.slow  # covered by `make test-all`; the default run keeps one case of each kind
# token_budget's position across world sizes is tests/test_data_scale.py's (2 -> 4 ranks, every sample once)
SLOW_EPOCH_CASES = ("rank_batch_sizes", "length_grouped", "amp_device_augment", "token_budget")


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=SLOW) if c in SLOW_EPOCH_CASES else c for c in EPOCH_CASES],
)
def test_resume_across_an_epoch_boundary_is_bitwise(tmp_path, case):
    """A checkpoint taken after the first epoch ended resumes to the uninterrupted run's losses
    exactly: the data position (epoch, samples read), LR schedule, loss scaler and every rank's
    random generators (device-side augmentation's included) are all in the checkpoint."""
    args = [*EPOCH_CASES[case], "steps=10", "checkpoint.every=6", "schedule.warmup_steps=3"]
    if case == "amp_device_augment":
        args.append(f"data.root={make_image_folder(tmp_path / 'images')}")
    full = tmp_path / "full"
    proc = train_cli(args, full)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = full / "checkpoints" / "step-000006"
    assert checkpoint_meta(ckpt)["data"]["epoch"] >= 1, "the checkpoint should be past an epoch boundary"

    resumed = tmp_path / "resumed"
    proc = train_cli([*args, f"checkpoint.resume={ckpt}"], resumed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = {m["step"]: m for m in read_metrics(full)}
    got = read_metrics(resumed)
    assert [m["step"] for m in got] == [7, 8, 9, 10]
    for m in got:
        assert (m["loss"], m["lr"], m["loss_scale"]) == (want[m["step"]]["loss"], want[m["step"]]["lr"],
                                                         want[m["step"]]["loss_scale"])  # fmt: skip


@pytest.fixture(scope="module")
def saved_every_step(tmp_path_factory) -> Path:
    """6 smoke steps (ddp, 2 ranks), saved asynchronously after each, the newest two kept: the run
    the async-save test checks, and a clean run and a checkpoint for the tests below that read one
    (saving changes no loss; a process start each saved)."""
    args = [*SMOKE, "steps=6", "checkpoint.every=1", "checkpoint.keep_last=2", "checkpoint.async_save=true"]
    run = tmp_path_factory.mktemp("saved_every_step") / "run"
    proc = train_cli(args, run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_async_save_with_keep_last_keeps_the_newest_complete_checkpoints(tmp_path, saved_every_step):
    run = saved_every_step
    kept = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())  # config.json sits beside them
    assert kept == ["step-000005", "step-000006"]
    for name in kept:
        assert (run / "checkpoints" / name / ".metadata").exists()
    resumed = tmp_path / "resumed"
    proc = train_cli([*SMOKE, "steps=6", f"checkpoint.resume={run / 'checkpoints' / 'step-000005'}"], resumed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(resumed) == losses(run)[5:]


# ----------------------------------------------------------------------------- resharding


def _reshard(tmp_path: Path, saved: list[str], resumed: list[str]) -> tuple[list[float], list[float]]:
    """Train 8 steps under `saved`, checkpointing at 4; resume step 4 under `resumed`."""
    base = [*SMOKE, "steps=8", "schedule.warmup_steps=2"]
    first = tmp_path / "first"
    proc = train_cli([*base, *saved, "checkpoint.every=4"], first)
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = tmp_path / "second"
    proc = train_cli([*base, *resumed, f"checkpoint.resume={first / 'checkpoints' / 'step-000004'}"], second)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return losses(first)[4:], losses(second)


DDP2 = ["parallel=ddp", "launch.nproc_per_node=2", "data.batch_size=4"]
FSDP4 = ["parallel=fsdp", "launch.nproc_per_node=4", "data.batch_size=2"]


@pytest.mark.parametrize(
    "saved,resumed",
    [
        pytest.param(DDP2, FSDP4, marks=pytest.mark.slow),  # the default run keeps the 2-D reshard below
        pytest.param(FSDP4, DDP2, marks=pytest.mark.slow),
        # FSDP over 2 x tensor parallel over 2
        (DDP2, ["parallel=hybrid", "parallel.pp=1", "parallel.tp=2", "launch.nproc_per_node=4", "data.batch_size=4"]),
    ],
    ids=["ddp2-to-fsdp4", "fsdp4-to-ddp2", "ddp2-to-fsdp2xtp2"],
)
def test_a_checkpoint_resumes_under_another_strategy_and_world_size(tmp_path, saved, resumed):
    """Same global batch (8 samples): the model, optimizer and data position map exactly, so the
    trajectory continues as the uninterrupted run's."""
    want, got = _reshard(tmp_path, saved, resumed)
    assert got == pytest.approx(want, rel=1e-4)


def test_a_resume_on_data_of_another_size_is_a_clear_error(tmp_path, saved_every_step):
    """The position counts samples of an epoch's order, so another global batch or world size
    resumes (tests/test_data_scale.py); data of another size would not map: one line, before the
    first step. The checkpoint: smoke's ddp x2 (DDP2) after step 5 (saved_every_step)."""
    ckpt = saved_every_step / "checkpoints" / "step-000005"
    more = [*SMOKE, "steps=7", "parallel=fsdp", "data.max_bytes=100000"]
    proc = train_cli([*more, f"checkpoint.resume={ckpt}"], tmp_path / "x")
    assert proc.returncode != 0
    assert "samples an epoch; this run's data has" in proc.stderr and "does not map" in proc.stderr, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- hangs


def test_a_hung_rank_ends_every_process_with_the_collective_named(tmp_path, monkeypatch, marked):
    """Rank 1 stops participating before step 4. Rank 0's collective times out after
    backend.step_timeout_s; it names the collective and rank 1 as missing, and every process of
    the run is gone well within the timeout plus 30 s."""
    monkeypatch.setenv("HYDRADIST_FAULT", "1:3:hang")
    start = time.monotonic()
    proc = train_cli([*SMOKE, "steps=20", "backend.step_timeout_s=5"], tmp_path / "run", timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode == 1
    assert elapsed < 5 + 30 + 15  # the timeout, the margin, and the run's start-up
    assert "gloo:all_reduce" in proc.stderr and "ranks that never joined it: [1]" in proc.stderr, proc.stderr[-3000:]
    assert "step 4" in read_summary(tmp_path / "run")["error"]
    assert_clean_exit(proc, marked)


# ----------------------------------------------------------------------------- non-finite losses


def test_nonfinite_stop_names_the_step_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRADIST_FAULT", "1:4:nan")  # rank 1's loss of step 5 is NaN
    run = tmp_path / "run"
    proc = train_cli([*SMOKE, "steps=8", "checkpoint.every=2"], run)
    assert proc.returncode == 1
    assert "NonFiniteLoss: step 5: loss nan" in proc.stderr, proc.stderr[-3000:]
    assert "step-000004" in proc.stderr  # the last good checkpoint, named
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step-000002", "step-000004"]
    assert checkpoint_meta(run / "checkpoints" / "step-000004")["step"] == 4


def test_nonfinite_skip_leaves_the_step_out_and_counts_it(tmp_path, monkeypatch, saved_every_step):
    clean = saved_every_step  # the same 6 steps, saved along the way
    monkeypatch.setenv("HYDRADIST_FAULT", "1:3:nan")
    run = tmp_path / "run"
    proc = train_cli([*SMOKE, "steps=6", "nonfinite=skip"], run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(run)
    assert [m["skipped"] for m in metrics] == [False, False, False, True, False, False]
    assert metrics[3]["loss"] != metrics[3]["loss"]  # NaN: the step's loss, reported as it was
    assert read_summary(run)["nonfinite_skipped"] == 1
    # the skipped update left the weights alone: step 5 sees the weights of step 4's end, so its
    # loss is finite and close to the clean run's (which applied one more update)
    assert metrics[4]["loss"] == pytest.approx(losses(clean)[4], rel=0.05)


def test_a_skipped_step_leaves_parameters_and_optimizer_state_bitwise_unchanged(tmp_path, monkeypatch):
    """nonfinite=skip (one process, a NaN loss at step 4): the checkpoints after steps 3 and 4 hold
    the same parameters and optimizer state, bit for bit (an update with zeroed gradients would
    still move Adam's moments and step count; the LR schedule in param_groups moves on regardless)."""
    from framework.run.trainer import run

    monkeypatch.setenv("HYDRADIST_FAULT", "0:3:nan")
    cfg = world_config([*SMOKE, "parallel=none", "steps=5", "nonfinite=skip", "checkpoint.every=1"], 1)
    run(OmegaConf.create(cfg), str(tmp_path / "run"), {})
    assert [m["skipped"] for m in read_metrics(tmp_path / "run")] == [False, False, False, True, False]
    ckpts = tmp_path / "run" / "checkpoints"
    before, after = (checkpoint_tensors(ckpts / f"step-00000{k}", tmp_path / f"{k}.pt") for k in (3, 4))
    kept = [k for k in before if k.startswith(("model.", "optim.state."))]
    assert before.keys() == after.keys() and any(k.endswith(".exp_avg") for k in kept), list(before)[:20]
    for key in kept:
        assert torch.equal(before[key], after[key]), key
    five = checkpoint_tensors(ckpts / "step-000005", tmp_path / "5.pt")
    assert not all(torch.equal(after[k], five[k]) for k in kept)  # the next step does update


def checkpoint_tensors(path: Path, out: Path) -> dict:
    """A saved checkpoint's model and optimizer state, flattened to {dotted key: value}."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, out)

    def flat(tree, prefix=""):
        if isinstance(tree, dict):
            return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
        return {prefix.rstrip("."): tree}

    return flat(torch.load(out, weights_only=True))
