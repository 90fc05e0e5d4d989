"""Every command in the README's ```bash blocks is run here, and those of docs/own_model.md (the
README's own-model example, moved there to keep the README a first page: issue 66), so a command
that breaks fails a test. The first run and the tools that read it (evaluate, generate, report,
the planner) run for real; the other train.py commands are composed, planned and validated as
train.py would before starting workers (a full run of each would take minutes); `--help` and
`--cfg` run as written. A command this file does not know how to run is a failure, not a skip."""

from __future__ import annotations

import itertools
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, on_cpu, train_cli, write_tiny_llama_config

README = (ROOT / "README.md").read_text()
# the README's own model and data: the model file, its YAML and the commands that train it
OWN_MODEL = (ROOT / "docs" / "own_model.md").read_text()
FIRST_RUN = ["experiment=smoke"]
# a first page, as nanoGPT's and torchtitan's are (issue 66): what it is, the two commands, a first
# run, the groups, where to go next; method notes and measured tables live in docs/
README_MAX_LINES = 200


def bash_commands(text: str = README + OWN_MODEL) -> list[list[str]]:
    """Each command line of the bash blocks of `text` (the README's and its own-model page's), as
    argv (comments and #SBATCH lines dropped)."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                commands.append(argv)
    return commands


def train_args(argv: list[str]) -> list[str] | None:
    """The overrides of a `python train.py` / `torchrun ... train.py` / `srun python train.py` line."""
    argv = [a for a in argv if not re.match(r"^[A-Z_]+=", a)]  # PYTHONPATH=. and the like
    return argv[argv.index("train.py") + 1 :] if "train.py" in argv else None


def sweep_jobs(args: list[str]) -> list[list[str]]:
    """A multirun's jobs: every combination of its comma-separated choices."""
    if "-m" not in args:
        return [args]
    args = [a for a in args if a != "-m"]
    options = [[f"{a.split('=', 1)[0]}={v}" for v in a.split("=", 1)[1].split(",")] if "," in a else [a] for a in args]
    return [list(job) for job in itertools.product(*options)]


@pytest.fixture(scope="module")
def user_files(tmp_path_factory):
    """Where a user would have put the own-model page's files: tiny.py, my_conf/model/tiny.yaml, a
    Hugging Face config folder; paths of its commands mapped onto them."""
    home = tmp_path_factory.mktemp("user")
    blocks = {b.split("\n", 1)[0]: b.split("\n", 1)[1] for b in OWN_MODEL.split("```")[1::2]}
    assert {"python", "yaml", "bash"} <= set(blocks), list(blocks)
    (home / "tiny.py").write_text(blocks["python"])
    (home / "my_conf" / "model").mkdir(parents=True)
    (home / "my_conf" / "model" / "tiny.yaml").write_text(blocks["yaml"])
    (home / "README.md").write_text(README)
    write_tiny_llama_config(home / "llama")
    sys.path.insert(0, str(home))
    sys.modules.pop("tiny", None)  # another test's tiny.py (tests/test_own_model.py) is not the README's
    yield {"$PWD": str(home), "path/to/llama": str(home / "llama"), "=README.md": f"={home / 'README.md'}"}
    sys.path.remove(str(home))
    sys.modules.pop("tiny", None)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The README's first run, as written, with a checkpoint and a held-out split for the tools that read them."""
    sweep = tmp_path_factory.mktemp("first")
    proc = train_cli([*FIRST_RUN, "checkpoint.every=8", "data.val_fraction=0.05"], sweep / "run", wandb=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep, proc


def test_the_readme_has_its_sections_in_order_and_stays_short():
    titles = re.findall(r"^## (\d+)\. ", README, re.M)
    assert titles == [str(n) for n in range(1, 12)]
    assert len(README.splitlines()) <= README_MAX_LINES, len(README.splitlines())
    assert "## 11. Where to go next" in README


def test_the_readme_and_its_pages_link_to_what_is_there():
    """The README's links (its "where to go next" above all) and those of the pages that took its
    sections (own model, troubleshooting; the planner's accuracy and Megatron comparison) resolve."""
    pages = {"README.md": README, **{f"docs/{n}": (ROOT / "docs" / n).read_text()
                                     for n in ("own_model.md", "troubleshooting.md", "planner.md")}}  # fmt: skip
    broken = [(page, link) for page, text in pages.items()
              for link in re.findall(r"\]\(([^)#\s]+)\)", text)
              if "://" not in link and not ((ROOT / page).parent / link).exists()]  # fmt: skip
    assert not broken, broken
    linked = set(re.findall(r"\]\(docs/([\w.]+\.md)\)", README))
    assert {"own_model.md", "troubleshooting.md", "planner.md", "layout.md"} <= linked, linked


def test_the_first_run_prints_what_the_readme_shows(first_run):
    _, proc = first_run
    shown = README.split("It prints:\n\n```\n", 1)[1].split("```", 1)[0].splitlines()
    printed = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(printed) == len(shown), proc.stdout
    for ours, theirs in zip(printed, shown, strict=True):  # same lines, up to the figures and paths
        assert re.split(r"[\d/]", ours, maxsplit=1)[0] == re.split(r"[\d/]", theirs, maxsplit=1)[0], (ours, theirs)
    assert printed[0] == shown[0]  # the corpus is this Python's: the same figure


def test_the_strategy_examples_are_the_ones_checked_for_warnings():
    """Section 5's commands are those tests/test_cli.py runs and holds free of warnings."""
    from tests.test_cli import README_STRATEGIES

    section = README.split("## 5. Choosing a strategy", 1)[1].split("\n## ", 1)[0]
    examples = [train_args(shlex.split(line, comments=True)) for line in section.splitlines()
                if line.startswith("python train.py parallel=") and "parallel=auto" not in line]  # fmt: skip
    assert len(examples) >= 5 and all(args in README_STRATEGIES for args in examples), examples


def test_the_shown_config_error_is_what_train_py_says():
    if torch.cuda.is_available():
        pytest.skip("backend=nccl is accepted where CUDA is")
    from framework.config import ConfigError
    from framework.doors.compose import compose_run

    shown = README.split("$ python train.py backend=nccl\n", 1)[1].splitlines()[0]
    with pytest.raises(ConfigError) as err:
        compose_run(on_cpu(["backend=nccl"]))
    assert shown == f"error: {err.value}"


def run_tool(argv: list[str], first_run) -> None:
    """`python -m framework.X ...` for real, on the first run's folder where it names a run."""
    sweep, _ = first_run
    args = [str(sweep / "run") if a == "outputs/RUN" else str(sweep) if a.startswith("multirun/") else a for a in argv]
    proc = subprocess.run([sys.executable, *args[1:], "device=cpu"] if args[2] == "framework.evaluate" else
                          [sys.executable, *args[1:]], cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, (argv, proc.stderr[-3000:])
    noise = [line for line in (proc.stdout + proc.stderr).splitlines()  # a warning, a library's progress bar
             if "Warning" in line or "WARNING" in line or "Writing model shards" in line]  # fmt: skip
    assert not noise, (argv, noise[:5])
    if args[2] == "framework.report":
        assert (sweep / "report.md").exists()
    if args[2] == "framework.evaluate":
        assert (sweep / "run" / "eval.json").exists()


def test_every_readme_command_runs(first_run, user_files):
    from framework.doors.compose import compose_run

    composed, ran = 0, []
    for argv in bash_commands():
        argv = [_substitute(a, user_files) for a in argv]
        if argv[0] == "make":
            makefile = (ROOT / "Makefile").read_text()
            assert all(re.search(rf"^{t}:", makefile, re.M) for t in argv[1:]), argv
            continue
        if argv[:2] == ["python", "-m"]:
            run_tool(argv, first_run)
            ran.append(argv[2])
            continue
        args = train_args(argv)
        assert args is not None, f"the README runs a command this test does not know: {shlex.join(argv)}"
        if args == FIRST_RUN:
            continue  # run for real by the first_run fixture
        if "--help" in args or "--cfg" in args:
            proc = train_cli(args, wandb=True)
            assert proc.returncode == 0 and "parallel" in proc.stdout, (argv, proc.stderr[-2000:])
            continue
        for job in sweep_jobs(args):
            compose_run(on_cpu([a for a in job if not a.startswith(("hydra.run.", "hydra.sweep."))]))
            composed += 1
    assert composed >= 15 and {"framework.plan", "framework.evaluate", "framework.generate"} <= set(ran)


def own_model_commands(user_files) -> dict[str, list[str]]:
    """docs/own_model.md's train.py lines of its TinyLM by their strategy, with the user's paths in."""
    out = {}
    for argv in bash_commands(OWN_MODEL):
        args = train_args(argv)
        if args is not None and "model=hf" not in args:
            out |= {a: [_substitute(b, user_files) for b in args] for a in args if a.startswith("parallel=")}
    return out


@pytest.mark.parametrize("strategy", ["parallel=fsdp", "parallel=tp"])
def test_the_own_model_examples_train_and_warn_of_nothing(user_files, tmp_path, strategy):
    """The own-model page's TinyLM trains, as written, under fsdp (its Linear head returns a view, which
    FSDP2 would warn may give wrong gradients) and tp (its plan has no sequence-parallel entries:
    auto turns it off, in one line, rather than refusing the run)."""
    args = own_model_commands(user_files)[strategy]
    env = {"PYTHONPATH": os.pathsep.join([user_files["$PWD"], *os.environ.get("PYTHONPATH", "").split(os.pathsep)])}
    proc = train_cli([*args, "steps=2", "logger=none", "progress=false"], tmp_path / "run", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert not [line for line in out.splitlines() if "Warning" in line or "WARNING" in line], out[-3000:]
    note = "parallel.sequence_parallel: off (TinyLM's plan has no sequence-parallel entries)"
    assert (note in proc.stdout.splitlines()) == (strategy == "parallel=tp") and note in OWN_MODEL, proc.stdout


def test_tp_runs_sequence_parallel_where_the_plan_has_it(user_files, capsys):
    """parallel.sequence_parallel is auto: on for gpt and llama, off for plans without its entries
    (TinyLM's, a Hugging Face Llama's), resolved to a bool before any worker; an explicit true is refused."""
    from framework.config import ConfigError
    from framework.doors.compose import compose_run

    resolved = {}
    for name, model in {"gpt": [], "llama": ["model=llama"], "TinyLM": ["model=custom", "model._target_=tiny.TinyLM"],
                        "hf": ["model=hf", f"model.config={user_files['path/to/llama']}"]}.items():  # fmt: skip
        resolved[name] = compose_run(on_cpu(["parallel=tp", *model]))["parallel"]["sequence_parallel"]
    assert resolved == {"gpt": True, "llama": True, "TinyLM": False, "hf": False}
    said = capsys.readouterr().out.splitlines()
    assert "parallel.sequence_parallel: off (TinyLM's plan has no sequence-parallel entries)" in said
    assert len([line for line in said if line.startswith("parallel.sequence_parallel: off")]) == 2, said
    with pytest.raises(ConfigError, match="parallel.sequence_parallel: TinyLM's plan has no sequence-parallel"):
        compose_run(
            on_cpu(["parallel=tp", "parallel.sequence_parallel=true", "model=custom", "model._target_=tiny.TinyLM"])
        )


def _substitute(arg: str, paths: dict[str, str]) -> str:
    for placeholder, real in paths.items():
        arg = arg.replace(placeholder, real)
    return arg
