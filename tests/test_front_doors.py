"""Every front door checks its input as train.py does: bad input is one line naming the key, exit
code 2, no traceback, and nothing left behind (train.py, python -m framework.evaluate, .generate,
.plan); Ctrl-C during start-up is one line too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from framework.config import ConfigError, validate
from framework.config.overrides import first_problem
from tests.helpers import ROOT, compose_config

NO_FILE = "/nonexistent/corpus.bin"


def cli(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python ARGS` from `cwd`, as a user runs it (W&B offline)."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env |= {"WANDB_MODE": "offline", "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def one_line(proc: subprocess.CompletedProcess, start: str) -> str:
    """The one `error:` line a refused input prints: exit 2, no traceback."""
    lines, console = proc.stderr.strip().splitlines(), proc.stdout + proc.stderr
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in console, console[-3000:]
    assert lines[0].startswith(f"error: {start}"), lines[0]
    return lines[0]


def refused(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as err:
        validate(compose_config(overrides))
    return err.value


def test_a_missing_mandatory_value_is_named_and_leaves_no_run_folder(tmp_path):
    """data=tokens without data.path: omegaconf's MissingMandatoryValue was a traceback, and every
    refused config left an empty outputs/<date>/<time>/ with .hydra/ and run.lock."""
    kept = tmp_path / "kept"
    kept.mkdir()
    (kept / "notes.txt").write_text("mine")
    proc = cli([str(ROOT / "train.py"), "data=tokens", "logger=none", "device=cpu"], tmp_path)
    assert "data=tokens needs it" in one_line(proc, "data.path: ")
    assert not (tmp_path / "outputs").exists()  # made by this run, and removed
    proc = cli([str(ROOT / "train.py"), "data=tokens", "logger=none", "device=cpu", f"hydra.run.dir={kept}"], tmp_path)
    one_line(proc, "data.path: ")
    assert (kept / "notes.txt").read_text() == "mine"  # a folder that held something stays
    assert refused(["data=custom", "model=mlp"]).key == "data._target_"  # any ??? in the composed config


def test_a_preset_leaves_other_data_choices_alone():
    """experiment=smoke sets its data keys through a data choice of its own: another data= replaces it."""
    smoke = compose_config(["experiment=smoke"]).data
    assert (smoke.name, smoke.seq_len, smoke.max_bytes) == ("text", 32, 200000)
    validate(compose_config(["experiment=smoke", "data=images", "model=resnet"]))
    assert refused(["experiment=smoke", "data=images"]).key == "data"  # gpt on images: the pairing check's line


def test_a_presets_key_another_choice_lacks_is_one_line():
    line = first_problem(["experiment=resnet", "data=tokens"])
    assert line.startswith("data.image_size: experiment=resnet sets it, but data=tokens has no such key"), line
    line = first_problem(["experiment=gpt_varlen", "data=images"])
    assert line.startswith("data.source: experiment=gpt_varlen sets 'text'"), line


def test_a_key_spelt_out_suggests_its_abbreviation():
    assert first_problem(["optim.learning_rate=1e-3"]) == "optim.learning_rate: no such key; did you mean 'optim.lr'?"
    assert first_problem(["data.bs=4"]) == "data.bs: no such key; did you mean 'data.batch_size'?"
    assert first_problem(["model.n_layr=3"]) == "model.n_layr: no such key; did you mean 'model.n_layer'?"


def test_a_user_dataset_that_fails_to_build_names_its_error(tmp_path, monkeypatch):
    """A data._target_ whose constructor raises: Hydra's InstantiationException in every worker
    named no file; it is built once before any worker starts, its cause in one line."""
    (tmp_path / "frontdata.py").write_text(
        "class Bytes:\n    def __init__(self, file, **shape):\n        self.data = open(file, 'rb').read()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    err = refused(["data=custom", "data._target_=frontdata.Bytes", f"+data.file={NO_FILE}", "model=mlp",
                   "+data.dim=8", "+data.num_classes=2"])  # fmt: skip
    assert err.key == "data._target_", err
    assert str(err) == (f"data._target_: frontdata.Bytes(file='{NO_FILE}', dim=8, num_classes=2) failed: "
                        f"FileNotFoundError: [Errno 2] No such file or directory: '{NO_FILE}'")  # fmt: skip


@pytest.mark.parametrize("overrides", [["parallel=tp", "model=lstm"],
                                       ["parallel=pp", "model=lstm", "launch.nproc_per_node=2"]])  # fmt: skip
def test_a_model_is_paired_with_its_data_before_a_strategy_builds_it(overrides):
    """lstm's vocab_size is ${data.vocab_size}: the strategy's check resolved it before the pairing
    check said that lstm trains on data=varlen (an InterpolationKeyError traceback)."""
    err = refused(overrides)
    assert err.key == "data" and "trains on data=varlen" in str(err), err


def test_a_value_that_does_not_resolve_is_named():
    err = refused(["model=mlp", "data=custom", "data._target_=framework.data.datasets.SyntheticVectors"])
    assert err.key == "model.in_dim" and "data.dim" in str(err), err


@pytest.fixture
def saved_run(tmp_path):
    """A run folder whose checkpoint files are stand-ins: what the config checks read (they refuse
    before any weight is loaded)."""
    from framework.doors.compose import compose_run

    step = tmp_path / "checkpoints" / "step-000002"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "trainer.json").write_text(json.dumps({"step": 2}))
    config = compose_run(["experiment=smoke", "parallel=none", "device=cpu"])
    (tmp_path / "checkpoints" / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_evaluate_takes_group_choices_as_train_py_does(saved_run, capsys):
    """`python -m framework.evaluate RUN parallel=ddp` (a group's choice) was an AttributeError in
    validate: the saved config got the string 'ddp' for its parallel section."""
    from framework.config.door import resolve_input
    from framework.doors.evaluate import main

    cfg = resolve_input(str(saved_run / "checkpoints" / "step-000002"), ["parallel=ddp", "eval.steps=2"]).cfg
    assert (cfg.parallel.name, cfg.logger.name, cfg.eval.steps) == ("ddp", "none", 2)
    assert "bucket_cap_mb" in cfg.parallel  # ddp's own keys, as train.py composes them
    for args, line in ((["parallel=dddp"], "error: parallel: got 'dddp'; did you mean 'ddp'?"),
                       (["eval.stepz=2"], "error: eval.stepz: no such key; did you mean 'eval.steps'?"),
                       (["eval.steps=abc"], "error: eval.steps: got 'abc'")):  # fmt: skip
        assert main([str(saved_run), *args]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(line), err


def test_generate_takes_overrides_and_refuses_what_it_cannot_run_in_one_line(saved_run, capsys):
    """generate reads the run's config as evaluate does, overrides on top (it refused any before):
    a misspelt key and a strategy (one plain model on one process here) are one line, exit 2,
    before any weight is read; an unknown option too."""
    from framework.doors.generate import main

    for args, line in ((["parallel=ddp"], "error: parallel: the plain model runs on one process"),
                       (["eval.stepz=2"], "error: eval.stepz: no such key; did you mean 'eval.steps'?"),
                       ([], "error: CHECKPOINT: give a checkpoint or run folder, or the model's overrides")):  # fmt: skip
        assert main([*([str(saved_run)] if args else []), *args, "--prompt", "x"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(line), err
    with pytest.raises(SystemExit) as stop:
        main([str(saved_run), "--beams"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and err[0].startswith("error: --beams: not an argument"), err


def test_the_planner_checks_its_overrides_and_has_help(capsys):
    """`python -m framework.plan plan.dry_runn=true` printed Hydra's traceback; --help was an
    OverrideParseException. The misspelt key is named, and the key it misses suggested."""
    from framework.doors.plan import main

    assert main(["plan.dry_runn=true"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: plan.dry_runn: no such key; did you mean 'plan.dry_run'?"
    ]
    assert main(["--help"]) == 0
    assert "python -m framework.plan" in capsys.readouterr().out


def _loading(pid: int, library: str, deadline: float) -> None:
    """Wait until process `pid` has mapped a shared library whose path holds `library`, or the deadline."""
    maps = Path(f"/proc/{pid}/maps")
    while time.monotonic() < deadline and maps.exists():
        try:
            if library in maps.read_text():
                return
        except OSError:  # gone meanwhile
            return
        time.sleep(0.02)


def _forkserver_started(pid: int, deadline: float) -> None:
    """Wait until process `pid` has started the workers' forkserver (the launcher is starting the
    workers), or the deadline."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    while time.monotonic() < deadline and children.exists():
        for child in children.read_text().split():
            try:
                if b"forkserver" in Path(f"/proc/{child}/cmdline").read_bytes():
                    return
            except OSError:  # gone meanwhile
                pass
        time.sleep(0.02)


def test_ctrl_c_in_the_middle_of_an_import_arrives_once_it_is_done(tmp_path, monkeypatch):
    """Raised mid-import, a KeyboardInterrupt came out of a class body as a RuntimeError traceback
    (dataclasses' __set_name__), or from C++ torch calls back into as "terminate called": the
    start-up handler sends it again once the import is done."""
    from framework.machine import interrupt_outside_imports

    (tmp_path / "interrupted_module.py").write_text(
        "import dataclasses, signal\n"
        "signal.raise_signal(signal.SIGINT)\n"
        "@dataclasses.dataclass\n"
        "class Row:\n"
        "    x: int = dataclasses.field(default=1)\n"
        "DONE = True\n"
    )
    monkeypatch.syspath_prepend(tmp_path)
    previous = signal.signal(signal.SIGINT, interrupt_outside_imports)
    try:
        with pytest.raises(KeyboardInterrupt):
            import interrupted_module  # noqa: F401

            time.sleep(10)  # where it arrives
        assert sys.modules["interrupted_module"].DONE
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("when", ["importing", "starting workers"])
def test_ctrl_c_during_start_up_is_one_line(tmp_path, when):
    """Ctrl-C (SIGINT to the process group) while train.py imports, or while the launcher starts
    the workers: a KeyboardInterrupt traceback from wherever start-up was, or from the forkserver
    importing torch, or a worker unpickling a semaphore the exiting launcher had unlinked."""
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"} | {"WANDB_MODE": "offline"}
    args = [sys.executable, str(ROOT / "train.py"), "experiment=smoke", "logger=none", "parallel=ddp", "device=cpu",
            f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        if when == "importing":  # torch's library is loading: train.py's own code runs (however loaded the machine)
            _loading(proc.pid, "libtorch", time.monotonic() + 90)
        else:
            _forkserver_started(proc.pid, time.monotonic() + 90)
            time.sleep(1.0)  # the forkserver imports torch (seconds); the launcher waits on it to start a worker
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0, err[-3000:]
    assert "Traceback" not in out + err, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(("error: stopped by SIGINT", "preempted by SIGINT")), err[-3000:]


def test_the_launcher_checks_a_run_without_importing_what_only_workers_use(tmp_path):
    """What train.py does before its workers start (its imports, composing, `admit`) leaves
    torch._dynamo and Inductor unimported, and under fsdp DTensor and the pipelining package too:
    a second and a half of CPU in every launch otherwise (the workers' forkserver imports them
    once). Under compile too: compile_block imports Inductor's config when it compiles, and the
    checks read the degrees from framework.parallel.dims, whose package imports nothing. And
    train.py's own imports (framework.config, the components' checks) leave torch to the forkserver
    it starts beside the composing: imported first, it serialises a second of every launch."""
    script = (
        "import sys, train\n"
        "assert 'torch' not in sys.modules, 'train.py imports torch before its forkserver starts'\n"
        "HEAVY = ('torch._dynamo', 'torch._inductor', 'torch.distributed.tensor', 'torch.distributed.pipelining')\n"
        "from framework.doors.launch import admit\n"
        "from tests.helpers import compose_config\n"
        "cfg = compose_config(['parallel=fsdp', 'launch.nproc_per_node=2', 'compile=true', 'memory=checkpoint'])\n"
        f"admit(cfg, {str(tmp_path)!r}, {{}})\n"
        "print(sorted(m for m in sys.modules if m.startswith(HEAVY)))\n"
    )
    proc = cli(["-c", script], ROOT)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "[]", (
        proc.stdout[-2000:] + proc.stderr[-3000:]
    )
