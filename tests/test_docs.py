"""Every doc's quick start runs here as written, step after step (issue 53): the commands of
docs/finetune.md, evaluation.md and sweeps.md (their ```bash blocks), data.md (its mixture command)
and moe.md (its expert-parallel commands), in the doc's order, from one folder a newcomer works in
(the docs' relative paths resolve there), so that a later command reads what an earlier one wrote:
the run, its checkpoints, the sweep; and docs/planner.md's quick start (its example table is
tests/test_plan.py's test_planner_md_example_prints_what_the_doc_shows).

A command is changed only as the tables below say. A command this file does not know how to run is
a failure, not a skip. Two cannot run here as written, and each runs the same tool on the same
folder instead (`run_tool`): TensorBoard's server and W&B's terminal UI. The default tier leaves
out the commands of LONG (composed as train.py composes them, where they are train.py's); the long
tier (-m slow) walks each of those docs whole."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from tests.helpers import ROOT, on_cpu  # noqa: E402
from tests.test_llama import hf_model  # noqa: E402
from tests.test_readme import sweep_jobs  # noqa: E402

DOCS = ROOT / "docs"

# The files the docs' commands name, written at the very paths they name (relative to the folder
# the commands run in), so `path/to/hf_folder`, `my.txt`, ... are typed as written.
FILES = {
    "path/to/hf_folder": "a tiny Hugging Face Llama: transformers' own save_pretrained (tests/test_llama.py hf_model)",
    "my.txt": "4 KB of text (data=text)",
    "some.txt": "2 KB of text (data=text)",
    "rows.jsonl": "12 JSON rows with a `text` column (data=hf)",
    "prompts.txt": "two prompts, one a line",
    "web.parquet": "40 rows with a `text` column (data=hf, parquet)",
    "code/": "a folder of two JSON-lines files with a `text` column (data=hf)",
}
# The docs' placeholders, and what stands for each here.
PLACEHOLDERS = {
    "outputs/RUN": "the run folder the doc's latest `python train.py` wrote (found by its summary.json)",
    "outputs/<run>": "multirun/ddp-vs-fsdp/0: the first job of the sweep the doc ran before (a run folder)",
    "...": "the arguments of the doc's previous command of the same program that this one does not set",
}
# Sizes. Values the docs write, scaled in place (the same step everywhere the doc names it) ...
SCALED = {"steps=200": "steps=8", "steps=400": "steps=16", "eval.every=50": "eval.every=2",
          "checkpoint.every=100": "checkpoint.every=2", "step-000100": "step-000002"}  # fmt: skip
TINY_GPT = ["model.n_layer=1", "model.n_head=2", "model.n_embd=32", "data.seq_len=32", "data.batch_size=4"]
# ... and overrides appended to each `python train.py` of a doc (a later override wins). Every
# train.py command is also pinned to the CPU (tests/helpers.py on_cpu), and framework.evaluate and
# .generate given `device=cpu` where a GPU is visible: the suite's runs are CPU runs. logger=none
# where the doc reads no tracker (W&B costs a run about 2.5 s of CPU).
APPENDED = {
    "finetune.md": ["steps=2", "logger=none"],  # the tiny Llama of FILES; checkpoint.every scaled to 2 above
    # the smoke gpt, on 40 KB of its corpus (2 KB held out: an evaluation reads 16 batches, not 78);
    # the first run's steps=200 scaled to 8 above, the search's 20 kept
    "evaluation.md": ["data.max_bytes=40000", "logger=none"],
    # logger=all: the tensorboard line's own condition ("with logger=tensorboard or logger=all"),
    # and the W&B folder `wandb leet` reads
    "sweeps.md": [*TINY_GPT, "data.max_bytes=50000", "steps=2", "logger=all"],
    "data.md": [*TINY_GPT, "steps=2", "logger=none"],
    "moe.md": ["steps=2", "logger=none"],
    # parallel=auto picks among 4 workers' layouts for the tiny gpt (the doc's model is the planner's)
    "planner.md": [*TINY_GPT, "steps=2", "logger=none"],
}
# The environment: W&B offline, no hub, and one OpenMP thread a process (the suite runs two test
# files at once on two cores: a one-process tool's two threads spinning against the other file's
# processes made 200 generated tokens take 11 s instead of 0.1 s).
ENV = {"WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
# train.py commands composed, validated and planned as train.py does before any worker starts (in
# this process, as tests/test_readme.py does), in both tiers: nothing later in the doc reads what
# they write, and the feature is trained elsewhere (named).
COMPOSED_ONLY = {
    "python train.py ... eval.every=50 eval.patience=3 eval.min_delta=0.001": "early stopping: tests/test_eval.py",
}
# What the long tier (-m slow) runs and the default tier leaves out, to keep this file within about
# a minute of the default suite: a whole doc, or one command (a train.py command is composed,
# validated and planned instead, as train.py does before its workers start). What each would cost
# here (CPU seconds), and where the default tier runs the same feature.
LONG = {
    "sweeps.md": "4 jobs of 2 workers with W&B and TensorBoard, their report, the rerun (~25 s); "
        "tests/test_sweeps.py runs this sweep, its report, TensorBoard's reader and a skip_done rerun",
    "python -m framework.evaluate outputs/RUN data.path=some.txt":
        "~4 s; a file scored whole: finetune.md's data.path=my.txt (default tier, no checkpoint)",
    "python -m framework.evaluate outputs/RUN parallel.name=ddp launch.nproc_per_node=2":
        "~5 s; evaluate under 2 workers: finetune.md's parallel=fsdp launch.nproc_per_node=2 (default tier)",
    "python -m framework.evaluate model=hf model.pretrained=path/to/hf_folder data=hf data.path=rows.jsonl":
        "~6.5 s; tests/test_doors.py evaluates a pretrained folder on data=hf rows",
    "python train.py hparams_search=lowest_val_loss experiment=smoke hydra.sweeper.n_trials=3":
        "3 trials of 2 workers (~14 s); tests/test_sweeps.py runs a 3-trial Optuna search",
    "python train.py model=llama model.flavor=debug_moe model.moe.balance=bias parallel=fsdp parallel.ep=2":
        "a routed Llama under 2 workers (~10 s); tests/test_moe.py trains ep x2",
    "python train.py model=llama model.flavor=debug_moe parallel=hybrid parallel.tp=1 parallel.pp=1 "
    "parallel.dp_replicate=2 parallel.dp_shard=2 parallel.ep=2 launch.nproc_per_node=4":
        "4 workers of a routed Llama on 2 cores (~20 s); tests/test_moe.py's long tier trains HSDP with ep",
    "python train.py parallel=auto launch.nproc_per_node=4":
        "the layout auto picks, trained by 4 workers on 2 cores (~15 s); tests/test_plan.py trains parallel=auto",
    "python train.py parallel=auto launch.nproc_per_node=4 plan.memory_budget_mb=1200": "the same, under a budget (~15 s)",
    "python -m framework.plan plan.dry_run=true plan.world_size=1024 model=llama model.flavor=70b "
    "model.vocab_size=128256 data.seq_len=8192 data.batch_size=8 parallel=hybrid parallel.tp=8 parallel.pp=8 "
    "parallel.dp_shard=16 parallel.n_microbatches=8 parallel.sequence_parallel=true precision=bf16 memory=checkpoint":
        "1,024 ranks' roles on meta tensors (~60 s); tests/test_dry_run.py runs a dry run at 8 ranks",
}  # fmt: skip


def quick_start(doc: str) -> list[str]:
    """The doc's commands in order, continuation lines joined, comments dropped: its ```bash and
    plain ``` blocks and its indented blocks, each line that starts with a command a newcomer runs."""
    text = (DOCS / doc).read_text()
    blocks = re.findall(r"```(?:bash)?\n(.*?)```", text, re.S) + re.findall(r"\n\n((?:    .*\n)+)", text)
    commands = []
    for block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line.startswith(("python ", "tensorboard ", "wandb ", "torchrun ")):
                commands.append(shlex.join(shlex.split(line, comments=True)))
    return commands


class Newcomer:
    """The folder a newcomer types the docs' commands in: the files of FILES, the run folder the
    latest train.py step wrote (RUN), and the commands run so far (each runs once: a command two
    docs share, or the default tier's steps of a doc the long tier walks again)."""

    def __init__(self, home: Path):
        self.home, self.run, self.ran = home, None, {}

    def expand(self, argv: list[str], earlier: list[list[str]]) -> list[str]:
        """`...` as the previous command of the same program's arguments this one does not set;
        the placeholders and sizes of the tables."""
        if "..." in argv:
            program = argv[:3] if argv[1] == "-m" else argv[:2]
            before = next(c for c in reversed(earlier) if c[: len(program)] == program)
            mine = {a.split("=", 1)[0] for a in argv}
            inherited = [a for a in before[len(program) :] if a.split("=", 1)[0] not in mine]
            at = argv.index("...")
            argv = [*argv[:at], *inherited, *argv[at + 1 :]]
        out = []
        for a in argv:
            for doc_value, here in SCALED.items():
                a = a.replace(doc_value, here)
            if self.run is not None:
                a = a.replace("outputs/RUN", self.run)
            out.append(a.replace("outputs/<run>", "multirun/ddp-vs-fsdp/0"))
        return out

    def shell(self, argv: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
        env |= ENV | {"PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])}
        return subprocess.run(argv, cwd=self.home, env=env, capture_output=True, text=True, timeout=timeout)

    def once(self, argv: list[str], start) -> subprocess.CompletedProcess:
        """`start()` the first time `argv` is typed here; a train.py command's RUN is its run folder again."""
        key = shlex.join(argv)
        if key not in self.ran:
            self.ran[key] = (start(), self.run)
        proc, run = self.ran[key]
        if argv[1] == "train.py":
            self.run = run
        return proc

    def train(self, args: list[str], doc: str) -> subprocess.CompletedProcess:
        """`python train.py ARGS` with the doc's appended sizes; the run folder it wrote is RUN after it."""

        def start():
            before = set(self.home.glob("outputs/**/summary.json"))
            cmd = [sys.executable, str(ROOT / "train.py"), *on_cpu([*args, *APPENDED[doc]])]
            proc = self.shell(cmd, timeout=600)
            assert proc.returncode == 0, (args, proc.stdout[-2000:], proc.stderr[-3000:])
            wrote = set(self.home.glob("outputs/**/summary.json")) - before  # none for a multirun (under multirun/)
            assert len(wrote) <= 1, wrote
            if wrote:
                self.run = str(wrote.pop().parent.relative_to(self.home))
            return proc

        return self.once(["python", "train.py", *args], start)

    def door(self, argv: list[str]) -> subprocess.CompletedProcess:
        """`python -m framework.X ...` as typed (device=cpu where a GPU is visible, before the flags)."""

        def start():
            pinned = ["device=cpu"] if torch.cuda.is_available() and argv[2] in ("framework.evaluate",
                                                                                  "framework.generate") else []  # fmt: skip
            at = next((i for i, a in enumerate(argv) if a.startswith("--")), len(argv))
            proc = self.shell([sys.executable, *argv[1:at], *pinned, *argv[at:]])
            assert proc.returncode == 0, (argv, proc.stdout[-2000:], proc.stderr[-3000:])
            said = (proc.stdout + proc.stderr).splitlines()
            assert not [line for line in said if "Traceback" in line or "Warning" in line], (argv, said[-20:])
            return proc

        return self.once(argv, start)


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory) -> Newcomer:
    """The folder the docs' commands run in, with the files of FILES at their paths."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    home = tmp_path_factory.mktemp("newcomer")
    hf_model(home / "path" / "to" / "hf_folder", tie=False)
    text = (ROOT / "framework" / "doors" / "evaluate.py").read_text()
    (home / "my.txt").write_text(text[:4096])
    (home / "some.txt").write_text(text[4096:6144])
    rows = [{"text": f"row {i}: " + "the quick brown fox jumps over the lazy dog " * (1 + i % 3)} for i in range(40)]
    (home / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:12]))
    (home / "prompts.txt").write_text("def \nimport \n")
    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), home / "web.parquet")
    (home / "code").mkdir()
    for i in range(2):
        lines = [{"text": f"def f{i}_{j}(x):\n    return x * {j}\n"} for j in range(20)]
        (home / "code" / f"part-{i}.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
    assert {p.removesuffix("/") for p in FILES} <= {str(p.relative_to(home)) for p in home.rglob("*")}
    return Newcomer(home)


def walk(doc: str, newcomer: Newcomer, monkeypatch, whole: bool) -> list[tuple[list[str], object]]:
    """Every command of `doc`'s quick start, in order: (the command as run, its process; the configs
    train.py would run for one composed; None for a door or tool of LONG the default tier leaves out)."""
    from framework.doors.compose import compose_run

    monkeypatch.chdir(newcomer.home)  # where a composed command's relative paths resolve
    newcomer.run = None
    earlier, done = [], []
    for line in quick_start(doc):
        argv = newcomer.expand(shlex.split(line), earlier)
        earlier.append(argv)
        left_out = (doc in LONG or line in LONG) and not whole
        if argv[:2] == ["python", "train.py"]:
            args = argv[2:]
            if line in COMPOSED_ONLY or left_out:
                done.append((argv, [compose_run(on_cpu([*job, *APPENDED[doc]])) for job in sweep_jobs(args)]))
            else:
                done.append((argv, newcomer.train(args, doc)))
        elif left_out:
            done.append((argv, None))
        elif argv[:2] == ["python", "-m"]:
            done.append((argv, newcomer.door(argv)))
        elif argv[0] in ("tensorboard", "wandb"):
            done.append((argv, newcomer.once(argv, lambda argv=argv: run_tool(argv, newcomer))))
        else:
            pytest.fail(f"{doc} runs a command this test does not know: {line}")
    return done


def run_tool(argv: list[str], newcomer: Newcomer) -> subprocess.CompletedProcess:
    """TensorBoard and W&B's LEET, which a test cannot look at (a web server; a terminal UI): the
    installed tool, in its printing mode, on the folder the doc names."""
    tool = Path(sys.executable).parent / argv[0]
    assert tool.exists(), f"{argv[0]} is not installed beside this Python (the docs say `make` installs it)"
    if argv[0] == "tensorboard":  # the server reads the event files `--inspect` lists
        assert argv[1] == "--logdir" and len(argv) == 3, argv
        proc = newcomer.shell([str(tool), "--inspect", "--logdir", argv[2]])
        found = sorted(p.parent.name for p in (newcomer.home / argv[2]).glob("*/tensorboard"))
        assert proc.returncode == 0 and found == ["0", "1", "2", "3"], (argv, found, proc.stderr[-2000:])
        assert all(f"{argv[2]}/{job}/tensorboard" in proc.stdout for job in found) and "train/loss" in proc.stdout
    else:  # `wandb leet DIR` shows the run that `wandb leet inspect --summary DIR` prints
        assert argv[1] == "leet" and len(argv) == 3, argv
        proc = newcomer.shell([str(tool), "leet", "inspect", "--summary", argv[2]])
        assert proc.returncode == 0 and "finished (exit code 0)" in proc.stdout, (argv, proc.stdout, proc.stderr)
        assert "parallel=ddp,precision=fp32" in proc.stdout.splitlines()[0], proc.stdout  # the sweep's job 0
    return proc


def by_door(done, name: str) -> list[tuple[list[str], subprocess.CompletedProcess | None]]:
    return [(argv, p) for argv, p in done if argv[:3] == ["python", "-m", name]]


def table_of(stdout: str) -> dict[str, str]:
    """framework.evaluate's printed table: {row name: value}."""
    return {line.split()[0]: line.split(None, 1)[1] for line in stdout.splitlines() if line.strip()}


def test_the_quick_starts_are_the_commands_this_file_runs():
    """What quick_start reads from each doc (a command moved into another kind of block would
    otherwise leave this file unnoticed), and the tables name only commands the docs hold."""
    counts = {doc: len(quick_start(doc)) for doc in APPENDED}
    assert counts == {"finetune.md": 7, "evaluation.md": 13, "sweeps.md": 5, "data.md": 1, "moe.md": 2,
                      "planner.md": 4}, counts  # fmt: skip
    every = {line for doc in APPENDED for line in quick_start(doc)}
    named = set(COMPOSED_ONLY) | set(LONG) - set(APPENDED)
    assert named <= every, named - every
    placeholders = {p for p in PLACEHOLDERS if any(p in line.split() or f"{p}/" in line for line in every)}
    assert placeholders == set(PLACEHOLDERS) and all(any(v in line for line in every) for v in SCALED)


def test_finetune_md_quick_start(newcomer, monkeypatch):
    """Evaluate and generate from the pretrained folder, LoRA with a checkpoint and the export, then
    generate from the run and export its checkpoint in both forms."""
    done = walk("finetune.md", newcomer, monkeypatch, whole=True)
    home, run = newcomer.home, newcomer.home / newcomer.run
    one, fsdp = (table_of(p.stdout) for _, p in by_door(done, "framework.evaluate"))
    assert one["checkpoint"] == "as built (no checkpoint)" and one["data"] == "data.path=my.txt", one
    assert float(one["loss"]) == pytest.approx(float(fsdp["loss"]), abs=1e-4) and one["tokens"] == fsdp["tokens"]
    for argv, proc in by_door(done, "framework.generate"):
        assert proc.stdout.startswith("def ") and len(proc.stdout) > len("def \n"), (argv, proc.stdout)
    said = next(p for argv, p in done if argv[1] == "train.py").stdout  # LoRA's trainable parameters, the export
    assert "peft: LoRA rank 16 (alpha 32) on ['wq', 'wk', 'wv', 'wo']: " in said and " trainable " in said, said
    assert f"{newcomer.run}/hf (LoRA merged in; Hugging Face) and " in said and "(the adapter, PEFT's)" in said, said
    assert (run / "checkpoints" / "step-000002" / ".metadata").is_file()
    assert (run / "hf" / "model.safetensors").is_file() and (run / "adapter" / "adapter_config.json").is_file()
    merged, adapter = (p.stdout.strip() for _, p in by_door(done, "framework.export"))
    assert merged.startswith("out_merged: Hugging Face LlamaForCausalLM"), merged
    assert adapter.startswith("out_adapter: a PEFT LoRA adapter of Hugging Face LlamaForCausalLM"), adapter
    assert (home / "out_merged" / "model.safetensors").is_file() and (home / "out_merged" / "config.json").is_file()
    assert (home / "out_adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((home / "out_adapter" / "adapter_config.json").read_text())["r"] == 16


def evaluation_md(newcomer, monkeypatch, whole: bool) -> None:
    """A run that evaluates and keeps its best checkpoint, early stopping (composed), a resume from
    the best to a later step, evaluate and generate on the run and on the pretrained folder, an
    Optuna search (the long tier's)."""
    done = walk("evaluation.md", newcomer, monkeypatch, whole)
    run = newcomer.home / newcomer.run
    assert "eval at step 8: val_loss " in done[0][1].stdout, done[0][1].stdout
    (patience,) = done[1][1]
    assert (patience["eval"]["patience"], patience["eval"]["min_delta"], patience["steps"]) == (3, 0.001, 8)
    resumed = done[2][1].stdout
    assert "resumed from step 8 (checkpoint " in resumed and "/checkpoints/best/step-000008)" in resumed, resumed
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 16 and summary["status"] == "ok" and summary["eval"]["evals"] == 4, summary["eval"]
    refused_at_best(run)
    evaluations = [p for _, p in by_door(done, "framework.evaluate")]
    assert len(evaluations) == 6 and {i for i, p in enumerate(evaluations) if p is None} == (
        set() if whole else {1, 2, 5}
    )
    on_run = [table_of(p.stdout) for p in evaluations[:3] if p is not None]  # its best checkpoint
    assert all(f"{newcomer.run}/checkpoints/best/step-" in t["checkpoint"] for t in on_run), on_run
    assert on_run[0]["data"] == "the validation split" and float(on_run[0]["loss"]) > 0, on_run
    last = json.loads((run / "eval.json").read_text())  # each writes eval.json beside the run; the last one's
    assert (last["parallel"], last["data"]) == ("ddp" if whole else "none", "the validation split"), last
    if whole:  # a file scored whole, the same loss under 2 workers, the pretrained folder on data=hf rows
        assert on_run[1]["data"] == "data.path=some.txt", on_run
        assert float(on_run[2]["loss"]) == pytest.approx(float(on_run[0]["loss"]), abs=1e-5), on_run
        assert on_run[2]["tokens"] == on_run[0]["tokens"], on_run
        assert table_of(evaluations[5].stdout)["checkpoint"] == "as built (no checkpoint)"
    generations = by_door(done, "framework.generate")
    assert generations[0][1].stdout.startswith("def ")
    said = generations[1][1].stdout.strip().splitlines()  # --print-ids: each prompt's text, then its ids
    assert said[0].startswith("def ") and isinstance(json.loads(said[-1]), list), said
    search = sorted(newcomer.home.glob("multirun/**/optimization_results.yaml"))
    if whole:
        assert len(search) == 1 and "best_params:" in search[0].read_text()
        assert len(list(search[0].parent.glob("*/summary.json"))) == 3
    else:
        (composed,) = done[-1][1]  # the preset composes: its search's base config
        assert (composed["optimize"], composed["eval"]["every"], composed["steps"]) == ("val_loss", 10, 20)


def refused_at_best(run: Path) -> None:
    """The table's `checkpoint.resume=best`: exit 2 when the best is at `steps` already (the
    resume line as the doc wrote it before, with no later step, was a worker's ValueError, and the
    finished run's summary.json then said failed). launch's check, before any worker starts."""
    from framework.checkpoint.store import best_root, latest, step_of
    from framework.config import ConfigError
    from framework.doors.launch import check_best_exists
    from tests.helpers import compose_config

    best = step_of(latest(best_root(str(run / "checkpoints"))))
    cfg = compose_config(["experiment=smoke", "checkpoint.resume=best", f"steps={best}"])
    with pytest.raises(ConfigError, match=rf"checkpoint.resume: best: .* is at step {best} and steps={best}: nothing"):
        check_best_exists(cfg, str(run))
    check_best_exists(compose_config(["experiment=smoke", "checkpoint.resume=best", f"steps={best + 1}"]), str(run))


def test_evaluation_md_quick_start(newcomer, monkeypatch):
    evaluation_md(newcomer, monkeypatch, whole=False)


@pytest.mark.slow  # the Optuna search of LONG, after the rest (run once in this module)
def test_evaluation_md_quick_start_whole(newcomer, monkeypatch):
    evaluation_md(newcomer, monkeypatch, whole=True)


def sweeps_md(newcomer, monkeypatch, whole: bool) -> None:
    """A 4-job sweep, its report, TensorBoard and W&B on its folders, and the sweep finished again
    with sweep.skip_done=true: every job skipped. The default tier composes the sweep's 4 jobs, twice."""
    done = walk("sweeps.md", newcomer, monkeypatch, whole)
    sweep = newcomer.home / "multirun" / "ddp-vs-fsdp"
    if not whole:
        first, rerun = done[0][1], done[-1][1]
        jobs = {(c["parallel"]["name"], c["precision"]["name"], c["sweep"]["skip_done"]) for c in first + rerun}
        assert jobs == {(p, q, skip) for p in ("ddp", "fsdp") for q in ("fp32", "bf16") for skip in (False, True)}
        assert [p for _, p in done[1:-1]] == [None, None, None] and not sweep.exists()
        return
    summaries = sorted(sweep.glob("*/summary.json"))
    assert len(summaries) == 4 and all(json.loads(p.read_text())["status"] == "ok" for p in summaries)
    report = (sweep / "report.md").read_text()
    assert len([line for line in report.splitlines() if line.startswith("| ") and "parallel=" in line]) >= 4
    assert {"loss.png", "throughput.png", "memory.png", "comm.png"} <= {p.name for p in sweep.glob("*.png")}
    rerun = done[-1][1]
    assert rerun.stdout.count("already finished (sweep.skip_done=true)") == 4, rerun.stdout


def test_sweeps_md_quick_start(newcomer, monkeypatch):
    sweeps_md(newcomer, monkeypatch, whole=False)


@pytest.mark.slow  # LONG: the whole quick start
def test_sweeps_md_quick_start_whole(newcomer, monkeypatch):
    sweeps_md(newcomer, monkeypatch, whole=True)


def test_data_md_mixture_trains(newcomer, monkeypatch):
    """data.md's mixture of a parquet file and a folder of JSON lines, at the paths it names."""
    walk("data.md", newcomer, monkeypatch, whole=True)
    summary = json.loads((newcomer.home / newcomer.run / "summary.json").read_text())
    assert summary["status"] == "ok" and set(summary["sources"]) == {"web", "code"}, summary["sources"]


def moe_md(newcomer, monkeypatch, whole: bool) -> None:
    done = walk("moe.md", newcomer, monkeypatch, whole)
    if whole:
        for argv, proc in done:
            assert "done: 2 steps" in proc.stdout, (argv, proc.stdout[-2000:])
    else:
        (fsdp,), (hybrid,) = (configs for _, configs in done)
        assert (fsdp["parallel"]["ep"], fsdp["model"]["moe"]["balance"]) == (2, "bias")
        assert (hybrid["parallel"]["ep"], hybrid["launch"]["nproc_per_node"]) == (2, 4)


def test_moe_md_commands_compose_and_plan(newcomer, monkeypatch):
    moe_md(newcomer, monkeypatch, whole=False)


@pytest.mark.slow  # LONG's two training runs
def test_moe_md_commands_train(newcomer, monkeypatch):
    moe_md(newcomer, monkeypatch, whole=True)


def planner_md(newcomer, monkeypatch, whole: bool) -> None:
    """The ranked table, parallel=auto's run of its top layout (and under a budget), the dry run at
    1,024 ranks. The default tier composes the two runs as train.py does, the planner choosing."""
    done = walk("planner.md", newcomer, monkeypatch, whole)
    ranked = done[0][1].stdout
    assert "parallel=auto would run: " in ranked and "\n| 1 " in ranked, ranked[-2000:]
    if not whole:
        for _, configs in done[1:3]:
            (config,) = configs
            assert config["parallel"]["name"] != "auto", config["parallel"]  # resolved before any worker
        assert done[2][1][0]["plan"]["memory_budget_mb"] == 1200 and done[3][1] is None
        return
    for argv, proc in done[1:3]:
        assert "done: 2 steps" in proc.stdout and "parallel=auto" in proc.stdout, (argv, proc.stdout[-2000:])
    assert "state bytes equal the planner's" in done[3][1].stdout, done[3][1].stdout[-2000:]


def test_planner_md_quick_start(newcomer, monkeypatch):
    planner_md(newcomer, monkeypatch, whole=False)


@pytest.mark.slow  # LONG: the runs and the 1,024-rank dry run
def test_planner_md_quick_start_whole(newcomer, monkeypatch):
    planner_md(newcomer, monkeypatch, whole=True)
