"""One list of bad inputs, a case of each class the front doors promise to refuse, run against
every door that takes train.py's overrides: train.py, `python -m framework.evaluate`, `.generate`,
`.plan` and its dry run, and `.harness`; and the path classes against the doors that take paths
(`framework.export`, `framework.data.prepare`, `framework.report`). Each is one line naming the
key, exit 2, no traceback, before any worker or role starts, and nothing left behind in the folder
it ran from. Every value out of its range is also held against the shared check itself
(`validate`, in process: what every door calls); export's overrides: tests/test_doors.py."""

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
    "negative warm-up": (["schedule.warmup_steps=-1"], "schedule.warmup_steps"),
    "lr floor above 1": (["schedule.min_lr_ratio=2"], "schedule.min_lr_ratio"),
    "moe aux weight below 0": (["model=llama", "model.moe.experts=4", "model.moe.top_k=2", "model.moe.aux_loss_coef=-1"],
                               "model.moe.aux_loss_coef"),
    "stream shuffle buffer 0": (["data=hf", "data.path={rows}", "data.streaming=true", "data.shuffle_buffer=0"],
                                "data.shuffle_buffer"),
    "memory budget below 0": (["plan.memory_budget_mb=-1"], "plan.memory_budget_mb"),
    "text corpus not there": (["data.path={missing}"], "data.path"),
    "pretrained folder not there": (["model=llama", "model.pretrained={missing}"], "model.pretrained"),
    "tp that does not divide the heads": (["parallel=tp", "launch.nproc_per_node=3"], "parallel.tp"),
    "micro-batches below the stages": (["parallel=pp", "launch.nproc_per_node=2", "parallel.n_microbatches=1"],
                                       "parallel.n_microbatches"),
    "key added that its group lacks": (["+checkpoint.evry=3"], "checkpoint.evry"),  # Hydra's + adds it regardless
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
    (folder / "rows.jsonl").write_text("".join(f'{{"text": "row {i}: a few words"}}\n' for i in range(64)))
    return {"missing": str(folder / "nothing-here"), "text": str(folder / "corpus.txt"),
            "not_parquet": str(folder / "table.parquet"), "rows": str(folder / "rows.jsonl")}  # fmt: skip


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
TRAIN_PY_DEFAULT = {"lora rank 0", "parquet that is not", "text corpus not there", "micro-batches below the stages",
                    "key added that its group lacks"}  # fmt: skip


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
        "harness": (harness, lambda o: ["--model", "hydradist", "--model_args", *o, "--tasks", "none"]),
    }


@pytest.mark.parametrize("door", ["evaluate", "generate", "plan", "plan dry run", "harness"])
def test_every_other_door_refuses_each_in_one_line(tmp_path, inputs, monkeypatch, capsys, door):
    """The doors read overrides through framework/config/door.py (the planner through
    compose_checked): the same checks, the same lines. Generate runs one plain model on one
    process, so a multi-rank layout is refused by its `parallel` first; the harness takes the
    overrides as lm_eval's `--model_args` (a comma-separated list: a mixture's list is train.py's).
    The planner checks all but the layout, which it chooses; its dry run checks the layout given.
    The harness gets each override as its own `--model_args` value, every case: a list's commas (a
    mixture, a schedule) stay inside its brackets (lm_eval splits at the commas outside them), and a
    mixture's braces come after another value (lm_eval reads a first value with a brace as JSON:
    test_the_harness_names_model_args_it_cannot_read)."""
    main, argv = door_mains()[door]
    monkeypatch.chdir(tmp_path)
    for case, (_, key) in BAD.items():
        overrides = overrides_of(case, inputs)
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


def test_the_harness_names_model_args_it_cannot_read(tmp_path, inputs, monkeypatch, capsys):
    """The comma-separated form takes a schedule's list (its commas inside brackets) as every other
    door does; a first --model_args value with a brace (a mixture's, not JSON) is one line saying
    how to give it, not lm_eval's traceback."""
    from framework.doors.harness import main as harness

    monkeypatch.chdir(tmp_path)
    for case, key in (
        ("sequence schedule past seq_len", "data.seq_len_schedule"),
        ("mixture source not there", "--model_args"),
    ):
        code = harness(["--model", "hydradist", "--model_args", ",".join(overrides_of(case, inputs)), "--tasks", "x"])
        captured = capsys.readouterr()
        one_line(code, captured.err, captured.out, key)
    assert "each override its own argument" in captured.err and contents(tmp_path) == set()


# values out of range (overrides on experiment=smoke, the key named, what the line says is allowed)
OUT_OF_RANGE = [
    (["schedule.min_lr_ratio=2"], "schedule.min_lr_ratio", "in [0, 1]"),
    (["schedule.min_lr_ratio=-0.1"], "schedule.min_lr_ratio", "in [0, 1]"),
    (["optim.weight_decay=-1"], "optim.weight_decay", ">= 0"),
    (["optim=sgd", "optim.weight_decay=-1"], "optim.weight_decay", ">= 0"),
    (["optim.grad_clip=-1"], "optim.grad_clip", ">= 0 (0: no clipping)"),
    (["schedule.steps=-5"], "schedule.steps", ">= 1, or 0 / null: the run's steps"),
    (["model=llama", "model.moe.experts=4", "model.moe.top_k=2", "model.moe.aux_loss_coef=-1"],
     "model.moe.aux_loss_coef", ">= 0"),
    (["model=llama", "model.moe.experts=4", "model.moe.top_k=2", "model.moe.balance=bias", "model.moe.bias_rate=-1"],
     "model.moe.bias_rate", ">= 0"),
    (["data=hf", "data.path={rows}", "data.streaming=true", "data.shuffle_buffer=0"], "data.shuffle_buffer", ">= 1"),
    (["data=hf", "data.path={rows}", "data.shuffle_buffer=-1"], "data.shuffle_buffer", ">= 1"),
    (["plan.memory_budget_mb=-1"], "plan.memory_budget_mb", "> 0 (MB per rank), or null"),
    (["plan.memory_budget_mb=0"], "plan.memory_budget_mb", "> 0"),
    (["optim.betas=[1.5,0.9]"], "optim.betas", "in [0, 1)"),
    (["optim=sgd", "optim.momentum=-1"], "optim.momentum", ">= 0"),
    (["precision=amp", "precision.init_scale=0"], "precision.init_scale", "> 0"),
    (["precision=amp", "precision.growth_interval=0"], "precision.growth_interval", ">= 1"),
    (["seed=-1"], "seed", ">= 0"),
    (["plan.world_size=0"], "plan.world_size", ">= 1, or null"),
    (["plan.world_size=8", "plan.nodes=3"], "plan.nodes", "split plan.world_size=8 evenly"),
    (["model.n_layer=0"], "model.n_layer", ">= 1"),
    (["model=llama", "model.head_dim=0"], "model.head_dim", ">= 1, or null"),
    (["model=llama", "model.sliding_window=-1"], "model.sliding_window", ">= 1, or null"),
]  # fmt: skip
# what these keys allow at their edges: 0 (no clipping, no decay, no balancing loss; schedule.steps: null's alias,
# as framework/schedules reads it), null (the default)
IN_RANGE = [["schedule.min_lr_ratio=0", "optim.weight_decay=0", "optim.grad_clip=0", "schedule.steps=null"],
            ["schedule.steps=0"],
            ["schedule.min_lr_ratio=1", "schedule.steps=1", "plan.memory_budget_mb=null"],
            ["model=llama", "model.moe.experts=4", "model.moe.top_k=2", "model.moe.aux_loss_coef=0",
             "model.moe.bias_rate=0"],
            ["data=hf", "data.path={rows}", "data.streaming=true", "data.shuffle_buffer=1"],
            ["optim.betas=[0,0.999]", "seed=0", "plan.world_size=8", "plan.nodes=2", "model.n_layer=1"],
            ["optim=sgd", "optim.momentum=0"]]  # fmt: skip


def test_the_shared_check_refuses_each_value_out_of_range_naming_the_key(inputs):
    """validate (what train.py and every door call) names the key and what it allows: one
    ConfigError each; the edges of each range pass."""
    from framework.config import ConfigError, validate
    from tests.helpers import compose_config

    def composed(overrides):
        return compose_config(["experiment=smoke", *(o.format(**inputs) for o in overrides)])

    for overrides, key, allowed in OUT_OF_RANGE:
        with pytest.raises(ConfigError) as err:
            validate(composed(overrides))
        assert err.value.key == key and allowed in str(err.value), (overrides, str(err.value))
    for overrides in IN_RANGE:
        validate(composed(overrides))


@pytest.mark.parametrize("kind", ["missing", "not a checkpoint"])
def test_export_and_prepare_refuse_a_path_in_one_line(tmp_path, inputs, capsys, kind):
    from framework.data.prepare import main as prepare
    from framework.doors.export import main as export

    path = inputs["missing"] if kind == "missing" else inputs["text"]
    assert export([path, str(tmp_path / "out")]) == 2
    one_line(2, capsys.readouterr().err, "", "checkpoint")  # as generate and evaluate name it
    (tmp_path / "empty").mkdir()
    code = prepare([path if kind == "missing" else str(tmp_path / "empty"), str(tmp_path / "shards"), "--no-progress"])
    captured = capsys.readouterr()
    one_line(code, captured.err, captured.out, "INPUT")
    assert "no file or folder" in captured.err if kind == "missing" else "holds no non-empty file" in captured.err
    assert not (tmp_path / "out").exists() and not (tmp_path / "shards").exists()
    assert os.path.isfile(inputs["text"])  # the input is read, never touched


@pytest.mark.parametrize("kind", ["empty", "missing", "a file"])
def test_report_refuses_a_folder_without_runs_and_writes_nothing(tmp_path, inputs, capsys, kind):
    """`python -m framework.report DIR`: a folder with no run in it (or none at all) is one line
    naming DIR, exit 2, before report.md or a plot is written."""
    from framework.doors.report import main as report

    folder = {"empty": tmp_path / "sweep", "missing": tmp_path / "nothing-here", "a file": Path(inputs["text"])}[kind]
    if kind == "empty":
        folder.mkdir()
        (folder / "0" / ".hydra").mkdir(parents=True)  # a job folder that never wrote its summary.json
    with pytest.raises(SystemExit) as stop:
        report([str(folder)])
    captured = capsys.readouterr()
    one_line(stop.value.code, captured.err, captured.out, "dir")
    assert contents(tmp_path) == ({"sweep", "sweep/0", "sweep/0/.hydra"} if kind == "empty" else set())


def test_report_writes_the_table_of_a_sweep(tmp_path, capsys):
    """The door itself on a sweep's folders (tests/test_sweeps.py's): report.md, its table printed."""
    from framework.doors.report import main as report
    from tests.test_sweeps import write_sweep

    write_sweep(tmp_path)
    report([str(tmp_path)])
    out = capsys.readouterr().out
    assert (tmp_path / "report.md").is_file() and out.rstrip().endswith(f"report: {tmp_path / 'report.md'}")
    assert out.startswith(f"# Sweep report: {tmp_path}") and out.count("\n| ") == 5, out[:2000]  # 4 runs, a header
    assert "**Fastest:** `parallel=ddp,precision=fp32`" in out and not (tmp_path / "wandb").exists()
