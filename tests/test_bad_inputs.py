"""One list of bad inputs, a case of each class the front doors promise to refuse, run against
every door that takes train.py's overrides: train.py, `python -m framework.evaluate`, `.generate`,
`.plan` and its dry run, and `.harness`; and the path classes against the doors that take paths
(`framework.export`, `framework.data.prepare`). Each is one line naming the key, exit 2, no
traceback, before any worker or role starts, and nothing left behind in the folder it ran from."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import ROOT
from tests.test_front_doors import cli

# id -> (overrides on experiment=smoke, the key the line names). Files are made by `inputs`.
BAD: dict[str, tuple[list[str], str]] = {
    "lora rank 0": (["peft=lora", "peft.rank=0"], "peft.rank"),
    "lora alpha below 0": (["peft=lora", "peft.alpha=-1"], "peft.alpha"),
    "moe top_k above experts": (["model=llama", "model.moe.experts=4", "model.moe.top_k=5"], "model.moe.top_k"),
    "hf data not there": (["data=hf", "data.path={missing}"], "data.path"),
    "hf data of no format": (["data=hf", "data.path={text}"], "data.format"),
    "parquet that is not": (["data=hf", "data.format=parquet", "data.path={not_parquet}"], "data.path"),
    "mixture source not there": (["data.sources=[{{path:{missing},weight:1}}]"], "data.sources[0].path"),
    "mixture weight below 0": (["data.sources=[{{path:{text},weight:-1}}]"], "data.sources[0]"),
    "batch schedule that does not split": (["data.batch_schedule=[[0,3]]", "parallel=ddp", "launch.nproc_per_node=2"],
                                           "data.batch_schedule"),
    "sequence schedule past seq_len": (["data.seq_len_schedule=[[0,4096]]"], "data.seq_len_schedule"),
    "unknown plan.gpu": (["plan.gpu=Z100"], "plan.gpu"),
    "negative warm-up": (["optim.warmup_steps=-1"], "optim.warmup_steps"),
    "text corpus not there": (["data.path={missing}"], "data.path"),
    "pretrained folder not there": (["model=llama", "model.pretrained={missing}"], "model.pretrained"),
    "tp that does not divide the heads": (["parallel=tp", "launch.nproc_per_node=3"], "parallel.tp"),
    "micro-batches below the stages": (["parallel=pp", "launch.nproc_per_node=2", "parallel.n_microbatches=1"],
                                       "parallel.n_microbatches"),
}  # fmt: skip
# a layout of its own: the plain planner ranks every layout (its dry run checks the one given)
LAYOUT = {"tp that does not divide the heads", "micro-batches below the stages", "batch schedule that does not split"}
# the doors that run one plain model on one process name the strategy first
ONE_PROCESS = {
    "tp that does not divide the heads",
    "micro-batches below the stages",
    "batch schedule that does not split",
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("inputs")
    (folder / "corpus.txt").write_text("a few words of text, again and again. " * 400)
    (folder / "table.parquet").write_text("this is text, not parquet\n")
    return {"missing": str(folder / "nothing-here"), "text": str(folder / "corpus.txt"),
            "not_parquet": str(folder / "table.parquet")}  # fmt: skip


def overrides_of(case: str, inputs: dict[str, str]) -> list[str]:
    return ["experiment=smoke", "logger=none", "device=cpu", *(o.format(**inputs) for o in BAD[case][0])]


def one_line(code: int | None, err: str, out: str, key: str | tuple[str, ...]) -> None:
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in out + err, (code, (out + err)[-3000:])
    keys = key if isinstance(key, tuple) else (key,)
    assert len(lines) == 1 and lines[0].startswith(tuple(f"error: {k}" for k in keys)), (key, err[-3000:])


def contents(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


# train.py, a process each (3 s of imports): a case of each class by default, all of them in `make test-all`
TRAIN_PY_DEFAULT = {"lora rank 0", "parquet that is not", "text corpus not there", "micro-batches below the stages"}


@pytest.mark.parametrize("case", [c if c in TRAIN_PY_DEFAULT else pytest.param(c, marks=pytest.mark.slow) for c in BAD])
def test_train_py_refuses_each_in_one_line_and_leaves_no_run_folder(tmp_path, inputs, case):
    proc = cli([str(ROOT / "train.py"), *overrides_of(case, inputs)], tmp_path)
    one_line(proc.returncode, proc.stderr, proc.stdout, BAD[case][1])
    assert contents(tmp_path) == set(), contents(tmp_path)  # no outputs/<date>/<time>/, no run.lock


def door_mains():
    """(name, main(argv) -> exit code, argv of the overrides) of each in-process door."""
    from framework.doors.evaluate import main as evaluate
    from framework.doors.generate import main as generate
    from framework.doors.harness import main as harness
    from framework.doors.plan import main as plan

    return {
        "evaluate": (evaluate, lambda o: o),
        "generate": (generate, lambda o: [*o, "--prompt", "x"]),
        "plan": (plan, lambda o: o),
        "plan dry run": (plan, lambda o: [*o, "plan.dry_run=true"]),
        "harness": (harness, lambda o: ["--model", "hydradist", "--model_args", ",".join(o), "--tasks", "none"]),
    }


@pytest.mark.parametrize("door", ["evaluate", "generate", "plan", "plan dry run", "harness"])
def test_every_other_door_refuses_each_in_one_line(tmp_path, inputs, monkeypatch, capsys, door):
    """The doors read overrides through framework/config/door.py (the planner through
    compose_checked): the same checks, the same lines. Generate runs one plain model on one
    process, so a multi-rank layout is refused by its `parallel` first; the harness takes the
    overrides as lm_eval's `--model_args` (a comma-separated list: a mixture's list is train.py's).
    The planner checks all but the layout, which it chooses; its dry run checks the layout given."""
    main, argv = door_mains()[door]
    monkeypatch.chdir(tmp_path)
    for case, (_, key) in BAD.items():
        overrides = overrides_of(case, inputs)
        if door == "harness" and any("," in o for o in overrides):
            continue
        if door == "generate" and case in ONE_PROCESS:
            key = ("parallel", key)  # its own check may come first
        if door == "plan" and case in LAYOUT:
            continue  # the planner ranks every layout itself: the one given is its dry run's to check
        try:
            code = main(argv(overrides))
        except SystemExit as stop:  # argparse's own exit
            code = stop.code
        captured = capsys.readouterr()
        one_line(code, captured.err, captured.out, key)
    assert contents(tmp_path) == set(), contents(tmp_path)


@pytest.mark.parametrize("kind", ["missing", "not a checkpoint"])
def test_export_and_prepare_refuse_a_path_in_one_line(tmp_path, inputs, capsys, kind):
    from framework.data.prepare import main as prepare
    from framework.doors.export import main as export

    path = inputs["missing"] if kind == "missing" else inputs["text"]
    assert export([path, str(tmp_path / "out")]) == 2
    one_line(2, capsys.readouterr().err, "", "CHECKPOINT")
    code = prepare([path if kind == "missing" else str(tmp_path), str(tmp_path / "shards"), "--no-progress"])
    captured = capsys.readouterr()
    one_line(code, captured.err, captured.out, "")
    assert not (tmp_path / "out").exists() and not (tmp_path / "shards").exists()
    assert os.path.isfile(inputs["text"])  # the input is read, never touched
