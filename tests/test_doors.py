"""One way in (issue 53): `python -m framework.evaluate`, `.generate` and `.harness` read a
checkpoint or run folder (its saved config, the overrides on top) or train.py's model and data
overrides alone, through one function (framework/config/door.py) that composes and checks the
config before any model is built or any worker starts. Each is held to transformers on the same
weights: a tiny Hugging Face Llama written here, nothing downloaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from framework.config import ConfigError  # noqa: E402
from framework.config.door import resolve_input  # noqa: E402
from framework.loss import IGNORE_INDEX  # noqa: E402
from tests.helpers import ROOT, train_cli  # noqa: E402
from tests.test_finetune import CONVERSATION, chat_folder  # noqa: E402
from tests.test_front_doors import cli, one_line  # noqa: E402
from tests.test_llama import hf_model  # noqa: E402
from tests.test_tokens import prepare  # noqa: E402

SEQ = 32
PROMPT = "def main():"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A pretrained Llama (bytes, 257 ids), one whose vocabulary is a chat tokenizer's, a text
    file, JSON rows, byte token shards with a validation split, conversations, and a run
    fine-tuned from the Llama for 2 steps (checkpointed, exported to run/hf)."""
    root = tmp_path_factory.mktemp("doors")
    hf_model(root / "hf", tie=False)
    chat_folder(root / "tok")
    torch.manual_seed(1)
    vocab = len(transformers.AutoTokenizer.from_pretrained(str(root / "tok")))
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                                      intermediate_size=96, vocab_size=vocab, max_position_embeddings=256)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf_chat")
    (root / "text.txt").write_bytes(bytes(range(32, 127)) * 7)  # 665 bytes: 20 windows of 32
    rows = [{"text": f"row {i}: " + "the quick brown fox " * (1 + i % 3)} for i in range(12)]
    (root / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (root / "docs").mkdir()
    for i in range(4):
        (root / "docs" / f"{i}.txt").write_text(f"document {i}: " + "lorem ipsum dolor sit amet " * 8)
    assert prepare(root / "docs", root / "shards", "--val-fraction", "0.5", "--shard-mb", "0.0001") == 0
    (root / "chat.jsonl").write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(8)))
    run = train_cli(["model=llama", f"model.pretrained={root / 'hf'}", "data=text", f"data.path={root / 'text.txt'}",
                     f"data.seq_len={SEQ}", "data.batch_size=4", "data.val_fraction=0.2", "parallel=none", "steps=2",
                     "optim.lr=0.01", "checkpoint.every=2", "checkpoint.export=true", "progress=false"],
                    root / "run")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return root


def greedy(folder, prompt: bytes, n: int) -> list[int]:
    """transformers' own greedy `generate` on a folder: the new ids, up to the end-of-document id (256)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([list(prompt)]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt) :].tolist()  # fmt: skip
    return out[: out.index(256)] if 256 in out else out


def printed_ids(stdout: str) -> list[int]:
    """generate --print-ids: the ids' list is the line after the text."""
    return json.loads(stdout.strip().splitlines()[-1])


def test_generate_from_a_pretrained_folder_equals_transformers_greedy_generate(inputs, capsys):
    """`generate model=llama model.pretrained=DIR data=text` (it said `not an argument here`), as a
    user types it, and through `model=hf`: transformers' greedy tokens on the same folder."""
    from framework.doors.generate import main

    expected = greedy(inputs / "hf", PROMPT.encode(), 24)
    args = ["--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "24", "--print-ids"]
    proc = cli(["-m", "framework.generate", "model=llama", f"model.pretrained={inputs / 'hf'}", "data=text", *args],
               inputs)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert printed_ids(proc.stdout) == expected and proc.stdout.startswith(PROMPT)
    assert main(["model=hf", f"model.pretrained={inputs / 'hf'}", "data=text", *args]) == 0
    assert printed_ids(capsys.readouterr().out) == expected


def test_generate_on_a_checkpoint_equals_transformers_on_its_export(inputs, capsys):
    from framework.doors.generate import main

    args = ["--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "16", "--print-ids"]
    assert main([str(inputs / "run"), *args]) == 0
    assert printed_ids(capsys.readouterr().out) == greedy(inputs / "run" / "hf", PROMPT.encode(), 16)


def hand_loss(folder, dataset) -> tuple[float, int]:
    """transformers' mean next-token loss over every sample of `dataset` (its padding ignored)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    total, terms = 0.0, 0
    for i in range(len(dataset)):
        (tokens,), target = dataset[i]
        with torch.no_grad():
            logits = hf(tokens[None]).logits[0].float()
        total += torch.nn.functional.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum").item()
        terms += int((target != IGNORE_INDEX).sum())
    return total / terms, terms


# (data overrides, the pretrained folder) per data choice; RUN: the fine-tuned run, scored through its export
CHOICES = {
    "text file": (["data=text", "data.path={root}/text.txt", f"data.seq_len={SEQ}"], "hf"),
    "hf": (["data=hf", "data.path={root}/rows.jsonl", f"data.seq_len={SEQ}"], "hf"),
    "tokens": (["data=tokens", "data.path={root}/shards", f"data.seq_len={SEQ}"], "hf"),
    "chat": (["data=chat", "data.path={root}/chat.jsonl", "data.tokenizer={root}/tok", "data.seq_len=64"], "hf_chat"),
}
CASES = [(name, False) for name in CHOICES] + [(name, True) for name in ("text file", "hf", "tokens")] + [(None, True)]


@pytest.mark.parametrize("choice,checkpoint", CASES, ids=[f"{c or 'its split'}-{'run' if r else 'pretrained'}"
                                                          for c, r in CASES])  # fmt: skip
def test_evaluate_reads_every_lm_data_choice_as_transformers_scores_it(inputs, choice, checkpoint):
    """Every lm data choice, with or without a checkpoint (data=hf and data=chat ended in
    `ConfigKeyError: Key 'max_bytes'`: `data.path=` was read as a text file whatever the choice)."""
    from framework.data import build_dataset
    from framework.doors.evaluate import run

    data, folder = CHOICES[choice] if choice else ([], "hf")
    overrides = [o.format(root=inputs) for o in data] + ["data.batch_size=4"]
    if checkpoint:
        target, folder = str(inputs / "run"), inputs / "run" / "hf"
    else:
        target, folder = None, inputs / folder
        overrides = ["model=llama", f"model.pretrained={folder}", *overrides]
    door = resolve_input(target, overrides)
    assert door.whole_file == (choice == "text file") and door.cfg.data.name == (choice or "text file").split()[0]
    got = run(target, overrides)
    dataset = build_dataset(door.cfg.data, door.cfg.seed, "lm", "train" if door.whole_file else "val")
    loss, terms = hand_loss(folder, dataset)
    assert got["terms"] == terms and got["loss"] == pytest.approx(loss, rel=1e-5)


def test_evaluate_reads_no_training_data(inputs, tmp_path):
    """A training corpus smaller than one batch (here 40 bytes: one window of 32) was build_data's
    ValueError traceback: evaluation builds the model and reads only its own split."""
    from framework.doors.evaluate import run

    (tmp_path / "train.txt").write_text("x" * 40)
    val = (inputs / "text.txt").read_text()[:150]
    (tmp_path / "val.txt").write_text(val)
    overrides = ["model=llama", f"model.pretrained={inputs / 'hf'}", "data=text", f"data.path={tmp_path / 'train.txt'}",
                 f"data.val_path={tmp_path / 'val.txt'}", "data.batch_size=4"]  # fmt: skip
    got = run(None, overrides)
    seq_len = resolve_input(None, overrides).cfg.data.seq_len
    assert got["data"] == "the validation split" and got["terms"] == (len(val.encode()) - 1) // seq_len * seq_len


def test_evaluate_without_a_validation_split_says_so_in_one_line(inputs, tmp_path):
    """Before any worker starts (was a worker's ValueError traceback): the keys that make one."""
    pretrained = ["model=llama", f"model.pretrained={inputs / 'hf'}"]
    proc = cli(["-m", "framework.evaluate", *pretrained, "data=text", "parallel=ddp", "launch.nproc_per_node=2"],
               tmp_path)  # fmt: skip
    line = one_line(proc, "data.val_fraction: data=text holds no validation split out")
    assert "data.val_path=FILE" in line and "data.path=FILE" in line and os.listdir(tmp_path) == []
    assert prepare(inputs / "text.txt", tmp_path / "train_only") == 0
    for overrides, key in ((["data=varlen", "model=gpt"], "data.val_fraction"),
                           ([*pretrained, "data=tokens", f"data.path={tmp_path / 'train_only'}"], "data.path"),
                           ([*pretrained, "data=hf", f"data.path={inputs / 'rows.jsonl'}", "data.streaming=true"],
                            "data.val_path")):  # fmt: skip
        with pytest.raises(ConfigError) as err:
            from framework.doors.evaluate import run

            run(None, overrides)
        assert err.value.key == key, err.value


def test_bad_inputs_to_each_door_are_one_line_and_leave_nothing_behind(inputs, tmp_path, capsys):
    from framework.doors.evaluate import main as evaluate
    from framework.doors.generate import main as generate

    assert generate(["model=llama", f"model.pretrained={tmp_path / 'none'}", "--prompt", "x"]) == 2
    assert (
        evaluate(["model=llama", f"model.pretrained={inputs / 'hf'}", "data=hf", f"data.path={tmp_path}/no.jsonl"]) == 2
    )
    assert evaluate([str(tmp_path), "eval.steps=2"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split(":", 2)[1] for line in lines] == [" model.pretrained", " data.path", " checkpoint"], lines
    assert "checkpoint.every=N" in lines[2] and os.listdir(tmp_path) == []
    harness = ["-m", "framework.harness", "--model", "hydradist", "--tasks", "none"]
    proc = cli([*harness, "--model_args", f"model=llama,model.pretraind={inputs / 'hf'}"], tmp_path)
    one_line(proc, "model.pretraind: no such key; did you mean 'model.pretrained'?")
    proc = cli([*harness, "--model_args", f"checkpoint={tmp_path / 'none'}"], tmp_path)
    one_line(proc, "checkpoint: ")
    assert os.listdir(tmp_path) == []


def test_export_reads_a_run_folder_and_checks_its_overrides(inputs, tmp_path, capsys):
    """`python -m framework.export RUN_DIR OUT [key=value ...]` reads what every door reads: the
    run folder's best (else newest) checkpoint with its saved config (or `--config`), the overrides on top,
    checked as train.py checks them. The files equal those the run exported at its end, tensor for
    tensor; a bad override, or a bad value in `--config`, is one line naming the key, exit 2,
    nothing written."""
    import yaml

    from framework.checkpoint.store import find_config
    from framework.doors.export import main as export
    from models.llama_hf import iter_hf_tensors

    run, out = inputs / "run", tmp_path / "out"
    assert export([str(run), str(out), "seed=7"]) == 0
    assert capsys.readouterr().out.startswith(f"{out}: Hugging Face LlamaForCausalLM")
    exported, at_end = dict(iter_hf_tensors(str(out))), dict(iter_hf_tensors(str(run / "hf")))
    assert set(exported) == set(at_end) and all(torch.equal(exported[k], at_end[k]) for k in at_end)
    assert json.loads((out / "config.json").read_text()) == json.loads((run / "hf" / "config.json").read_text())
    saved = find_config(str(next((run / "checkpoints").glob("step-*"))))
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump({**saved, "optim": {**saved["optim"], "weight_decay": -1}}))
    for args, key in ((["schedule.min_lr_ratio=2"], "schedule.min_lr_ratio"), (["model.n_layrs=3"], "model.n_layrs"),
                      (["precision=bf17"], "precision"), (["--config", str(tmp_path / "bad.yaml")],
                      "optim.weight_decay")):  # fmt: skip
        assert export([str(run), str(tmp_path / "refused"), *args]) == 2, args
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {key}: ") and not captured.out, (args, lines)
    assert not (tmp_path / "refused").exists()


def test_export_reads_no_data_nor_callbacks_and_an_older_runs_config(inputs, tmp_path, capsys):
    """A run whose data file is gone since it trained, with a callback whose package is not
    installed here, exports (export reads no data, and a run's callbacks are not export's): the
    tensors the run exported at its end. An older run's config without a group or section (peft,
    plan) takes train.py's defaults for them; a `--config` file that is not YAML, or not a mapping,
    is one line naming --config, exit 2, nothing written."""
    import shutil

    import yaml

    from framework.checkpoint.store import CONFIG_FILE
    from framework.doors.export import main as export
    from models.llama_hf import iter_hf_tensors

    run, at_end = tmp_path / "moved", dict(iter_hf_tensors(str(inputs / "run" / "hf")))
    shutil.copytree(inputs / "run" / "checkpoints", run / "checkpoints")
    saved = json.loads((run / "checkpoints" / CONFIG_FILE).read_text())
    saved["data"]["path"] = str(tmp_path / "gone.txt")  # the run's data, moved away
    saved["callbacks"]["mine"] = {"_target_": "not_installed_here.Mine"}
    (run / "checkpoints" / CONFIG_FILE).write_text(json.dumps(saved))
    (tmp_path / "older.yaml").write_text(yaml.safe_dump({k: v for k, v in saved.items() if k not in ("peft", "plan")}))
    for args in ([], ["--config", str(tmp_path / "older.yaml")]):
        out = tmp_path / f"out{len(args)}"
        assert export([str(run), str(out), *args]) == 0, capsys.readouterr().err
        exported = dict(iter_hf_tensors(str(out)))
        assert set(exported) == set(at_end) and all(torch.equal(exported[k], at_end[k]) for k in at_end)
    (tmp_path / "bad.yaml").write_text("optim: [1, 2\n  lr: :\n")
    (tmp_path / "list.yaml").write_text("- parallel\n- ddp\n")
    capsys.readouterr()
    for name, says in (("bad.yaml", "does not read as YAML"), ("list.yaml", "holds a list, not a run's config")):
        assert export([str(run), str(tmp_path / "refused"), "--config", str(tmp_path / name)]) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --config: ") and says in lines[0], lines
    assert not (tmp_path / "refused").exists()


def hf_loglikelihood(hf, context: str, continuation: str) -> float:
    """transformers' log-probability of the continuation's bytes after the context's."""
    first, whole = len(context.encode()), list((context + continuation).encode())
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([whole[:-1]])).logits[0].float(), -1)
    return sum(logprobs[first - 1 + i, t].item() for i, t in enumerate(whole[first:]))


def test_the_harness_takes_model_overrides_on_the_machines_device(inputs):
    """`hydradist` given `model=llama,model.pretrained=DIR,...` (lm_eval types the values) builds
    the model on the config's device (the CPU where there is no GPU: lm_eval's default is CUDA)
    and scores a continuation as transformers does."""
    from framework.doors.harness import HydradistLM

    lm = HydradistLM(**{"model": "llama", "model.pretrained": str(inputs / "hf"), "data": "text", "seed": 3,
                        "batch_size": 1})  # fmt: skip
    assert lm._device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    [(score, _)] = lm.loglikelihood([SimpleNamespace(args=("def main", "():"))])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(inputs / "hf")).eval()
    assert score == pytest.approx(hf_loglikelihood(hf, "def main", "():"), abs=1e-4)


QUESTIONS = [("def main", ["():", "!!"], 0), ("import", [" os", "))"], 1), ("x = [1, 2,", [" 3]", " zebra"], 0)]


@pytest.mark.slow  # lm_eval indexes its tasks: about 20 s
def test_the_harness_command_runs_on_the_cpu_without_being_told(inputs, tmp_path):
    """No `--device` on a machine without a GPU: it raised `Found no NVIDIA driver` inside an
    InstantiationException (lm_eval's own default device is CUDA). Model overrides, no checkpoint:
    the accuracy is the share of questions whose answer transformers scores highest."""
    pytest.importorskip("lm_eval")
    from tests.helpers import write_choice_task

    write_choice_task(tmp_path, "tiny_doors", QUESTIONS)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "framework.harness", "--model", "hydradist", "--model_args",
                           f"model=llama,model.pretrained={inputs / 'hf'},data=text", "--tasks", "tiny_doors",
                           "--include_path", str(tmp_path / "tasks"), "--output_path", str(tmp_path / "out")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    acc = json.loads(next((tmp_path / "out").rglob("results*.json")).read_text())["results"]["tiny_doors"]["acc,none"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(inputs / "hf")).eval()
    right = [
        max(range(len(c)), key=lambda i, q=q, c=c: hf_loglikelihood(hf, q, " " + c[i])) == a for q, c, a in QUESTIONS
    ]
    assert acc == pytest.approx(sum(right) / len(right))


OWN = ["model=custom", "model._target_=tiny.TinyLM", "+model.dim=8", "+model.n_layers=1"]  # tests/test_own_model.py's
# the data choices the lm test above leaves, each with a tiny model that trains on it
OTHERS = {
    "images": ["model=resnet", "data=images", "data.num_samples=32", "data.image_size=8", "data.batch_size=8"],
    "vectors": ["model=mlp", "data=vectors", "data.num_samples=64", "model.hidden=16", "data.batch_size=16"],
    "varlen": ["model=lstm", "model.hidden=16", "data=varlen", "data.num_samples=64", "data.max_len=16"],
    "custom": [*OWN, "data=custom", "data._target_=tinydata.Windows", "+data.samples=24", "data.batch_size=8"],
    "text_smoke": [*OWN, "data=text_smoke", "data.path={root}/small.txt", "data.batch_size=2"],
}
HELD_OUT = "data.val_fraction=0.25"


@pytest.fixture(scope="module")
def other_runs(tmp_path_factory):
    """A user's model and dataset modules (importable here and in the workers), and one 1-step run
    of each of OTHERS, evaluated before and after its step; one worker trains them all."""
    from framework.run.sweep import run_configs
    from tests.helpers import world_config
    from tests.test_own_model import TINY, TINY_DATA

    root = tmp_path_factory.mktemp("other_data")
    (root / "tiny.py").write_text(TINY)
    (root / "tinydata.py").write_text(TINY_DATA)
    (root / "small.txt").write_bytes(bytes(range(32, 127)) * 3)  # 285 bytes: 2 held-out windows of 32
    run = [HELD_OUT, "parallel=none", "logger=none", "progress=false", "steps=1", "checkpoint.every=1",
           "eval.every=1", "eval.at_start=true"]  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(root))
        patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
        configs = {name: world_config([*(o.format(root=root) for o in args), *run], 1) for name, args in OTHERS.items()}
        yield root, run_configs(configs, 1, str(root / "runs"))
    for name in ("tiny", "tinydata"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("choice", OTHERS)
def test_evaluate_reads_every_other_data_choice_as_its_run_evaluated_it(other_runs, choice, capsys):
    """images, vectors, varlen, a `_target_` dataset and text_smoke (a `_target_` model on the last
    two): as built, the loss (a classifier's accuracy, an lm's perplexity) the run's evaluation at
    step 0 gave; from its checkpoint, the one after its step (vectors under parallel=ddp: launched
    as train.py launches it; a single process ran in this one with no process group, a ValueError
    traceback: MASTER_ADDR). With nothing
    held out: one line naming data.val_fraction, exit 2, nothing written; a `_target_` dataset's
    split is then all of it."""
    from framework.doors.evaluate import main, run
    from tests.helpers import on_cpu

    root, summaries = other_runs
    history, folder = summaries[choice]["eval"]["history"], root / "runs" / choice
    if choice == "custom":
        assert run(str(folder), ["data.val_fraction=0"])["terms"] == 24 * 32
    else:
        before = sorted(os.listdir(folder))
        capsys.readouterr()
        assert main([str(folder), "data.val_fraction=0"]) == 2 and sorted(os.listdir(folder)) == before
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: data.val_fraction: "), lines
    as_built = run(None, on_cpu([*(o.format(root=root) for o in OTHERS[choice]), HELD_OUT]))
    trained = run(str(folder), ["parallel=ddp"] if choice == "vectors" else [])
    for got, expected in ((as_built, history[0]), (trained, history[-1])):
        expected = {k: v for k, v in expected.items() if k != "step"}
        assert {k: got[k] for k in expected} == pytest.approx(expected, rel=1e-6)
    assert json.loads((folder / "eval.json").read_text())["loss"] == trained["loss"]
