"""Fine-tuning's first step: a pretrained model's loss on the researcher's data before any
training here (`python -m framework.evaluate model=llama model.pretrained=DIR ...`, no checkpoint),
equal to transformers' loss on the same windows, as one process and under FSDP."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")

from tests.helpers import ROOT  # noqa: E402
from tests.test_llama import hf_model  # noqa: E402

SEQ = 32


def transformers_loss(hf, data: bytes) -> float:
    """The mean next-token loss over consecutive windows of SEQ + 1 bytes at 0, SEQ, 2 SEQ, ..."""
    windows = torch.tensor([list(data[i : i + SEQ + 1]) for i in range(0, len(data) - SEQ, SEQ)])
    with torch.no_grad():
        logits = hf(windows[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten()).item()


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    hf = hf_model(root / "hf", tie=False)
    text = root / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 7)  # 665 bytes: 20 windows of 32 and a dropped tail
    overrides = ["model=llama", f"model.pretrained={root / 'hf'}", "data=text", f"data.path={text}",
                 f"data.seq_len={SEQ}", "data.batch_size=4"]  # fmt: skip
    return hf, text, overrides


def test_a_pretrained_llama_is_evaluated_before_any_training_as_transformers_scores_it(pretrained):
    hf, text, overrides = pretrained
    proc = subprocess.run([sys.executable, "-m", "framework.evaluate", *overrides], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "as built (no checkpoint)" in proc.stdout and not (ROOT / "eval.json").exists()
    loss = float(re.search(r"^loss\s+([0-9.]+)$", proc.stdout, re.M).group(1))
    assert loss == pytest.approx(transformers_loss(hf, text.read_bytes()), abs=2e-6)  # printed to 6 places


def test_under_fsdp_the_pretrained_loss_is_the_same(pretrained):
    from framework.doors.evaluate import run

    hf, text, overrides = pretrained
    got = run(None, [*overrides, "parallel=fsdp", "launch.nproc_per_node=2"])
    assert got["checkpoint"] is None and got["parallel"] == "fsdp" and got["terms"] == 20 * SEQ
    assert got["loss"] == pytest.approx(transformers_loss(hf, text.read_bytes()), rel=1e-5)


def test_without_a_checkpoint_a_misspelt_key_is_one_line(capsys):
    from framework.doors.evaluate import main

    assert main(["model=llama", "model.pretraind=/nowhere"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.pretraind" in err[0], err


# ----------------------------------------------------------------------------- LoRA

# a tiny pretrained Llama (tests/test_llama.py's, 2 blocks of width 64, GQA) fine-tuned with
# adapters on q, v and the MLP's w2; fp32, 3 steps, a global batch of 4 sequences of 32 bytes
LORA = ["model=llama", "peft=lora", "peft.rank=4", "peft.alpha=8", "peft.targets=[wq,wv,w2]", "logger=none",
        "progress=false", "data.seq_len=32", "data.max_bytes=200000", "steps=3", "optim.lr=0.01"]  # fmt: skip
ONE = ["parallel=none", "data.batch_size=4"]
TP = ["parallel=tp", "launch.nproc_per_node=2", "data.batch_size=4"]
STRATEGIES = {
    "fsdp": ["parallel=fsdp", "launch.nproc_per_node=2", "data.batch_size=2"],
    "ddp": ["parallel=ddp", "launch.nproc_per_node=2", "data.batch_size=2"],
    "pp": ["parallel=pp", "launch.nproc_per_node=2", "data.batch_size=4", "parallel.n_microbatches=2"],
    "tp": TP,
}


@pytest.fixture(scope="module")
def lora_runs(pretrained, tmp_path_factory):
    """One process and fsdp x2 from the same pretrained folder, each saving and exporting."""
    from tests.helpers import train_cli

    root = tmp_path_factory.mktemp("lora")
    hf_folder = pretrained[2][1].split("=", 1)[1]
    runs = {}
    for name, overrides in (("one", ONE), ("fsdp", STRATEGIES["fsdp"])):
        run = train_cli([*LORA, f"model.pretrained={hf_folder}", *overrides, "checkpoint.every=3",
                         "checkpoint.export=true"], root / name)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        runs[name] = root / name
        (root / name / "console.txt").write_text(run.stdout)
    return hf_folder, runs


def test_the_console_says_what_trains_and_what_the_export_wrote(lora_runs):
    """The trainable parameters under LoRA (the adapters' own count), and the export's folders."""
    _, runs = lora_runs
    console = (runs["one"] / "console.txt").read_text()
    line = next(x for x in console.splitlines() if x.startswith("peft: LoRA rank"))
    from safetensors.torch import load_file

    adapter = load_file(runs["one"] / "adapter" / "adapter_model.safetensors")
    assert f": {sum(t.numel() for t in adapter.values()):,} trainable parameters of " in line, line
    assert f"export: {runs['one'] / 'hf'} (LoRA merged in; Hugging Face) and {runs['one'] / 'adapter'}" in console


def losses(run_dir) -> list[float]:
    from tests.helpers import read_metrics

    return [m["loss"] for m in read_metrics(run_dir)]


def adapted_model(hf_folder: str, run_dir):
    """Our Llama with the run's adapters, its last checkpoint's weights loaded."""
    from omegaconf import OmegaConf

    from framework.checkpoint.export import checkpoint_tensors, read_tensor
    from framework.peft import apply_peft
    from tests.test_llama import ours_from

    ckpt = str(sorted((run_dir / "checkpoints").glob("step-*"))[-1])
    model = ours_from(hf_folder)
    peft = OmegaConf.create({"name": "lora", "rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": ["wq", "wv", "w2"]})
    apply_peft(model, peft, "layers", 0)
    state = {n: read_tensor(ckpt, n, *meta) for n, meta in checkpoint_tensors(ckpt).items()}
    model.load_state_dict(state)
    return model.eval(), state


def test_lora_under_fsdp_equals_one_process_trains_only_the_adapters_and_keeps_the_base(lora_runs):
    from tests.helpers import read_summary
    from tests.test_llama import ours_from

    hf_folder, runs = lora_runs
    one, fsdp = losses(runs["one"]), losses(runs["fsdp"])
    assert one[-1] < one[0] and fsdp == pytest.approx(one, rel=1e-5, abs=0)
    base = ours_from(hf_folder).state_dict()
    _, state = adapted_model(hf_folder, runs["fsdp"])
    adapters = {n: t for n, t in state.items() if ".lora_" in n}
    assert len(adapters) == 2 * 3 * 2  # A and B of wq, wv, w2 in each of 2 blocks
    assert all(torch.equal(state[n], t) for n, t in base.items())  # the base bitwise unchanged
    assert any(t.abs().sum() > 0 for n, t in adapters.items() if ".lora_B." in n)  # B left zero: it trained
    # AdamW's two moments (fp32) of the adapters alone, and a step counter each, split over 2 ranks
    trained = sum(t.numel() for t in adapters.values())
    assert read_summary(runs["one"])["memory"]["optim_bytes"] == 2 * 4 * trained + 4 * len(adapters)
    plan = read_summary(runs["fsdp"])["plan"]["error"]
    assert plan["grad_bytes"] == plan["optim_bytes"] == plan["param_bytes"] == 0  # the planner knows


def test_the_exported_adapter_loads_in_peft_and_the_merged_model_in_transformers(lora_runs):
    peft = pytest.importorskip("peft")
    import transformers

    hf_folder, runs = lora_runs
    ours, _ = adapted_model(hf_folder, runs["fsdp"])
    tokens = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = ours(tokens)
        base = transformers.LlamaForCausalLM.from_pretrained(hf_folder).eval()
        adapted = peft.PeftModel.from_pretrained(base, str(runs["fsdp"] / "adapter")).eval()
        assert torch.allclose(adapted(tokens).logits, expected, atol=1e-5, rtol=0)
        merged = transformers.LlamaForCausalLM.from_pretrained(str(runs["fsdp"] / "hf")).eval()
        assert torch.allclose(merged(tokens).logits, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "pp", "tp"])
def test_lora_under_ddp_pp_and_tp_equals_one_process(lora_runs, strategy, tmp_path):
    """Under tp the adapters are placed with their layer: a column-wise layer's B split by output
    features (A whole), a row-wise layer's A split by input features (B whole, its output a
    partial sum reduced with the layer's). The default run meets tp x LoRA in the matrix, with sequence
    parallel too (tests/matrix.py PINNED: its frozen norms stay frozen)."""
    from tests.helpers import train_cli

    hf_folder, runs = lora_runs
    run = train_cli([*LORA, f"model.pretrained={hf_folder}", *STRATEGIES[strategy]], tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert losses(tmp_path) == pytest.approx(losses(runs["one"]), rel=1e-5, abs=0)


# ----------------------------------------------------------------------------- chat data

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": "Rome, since 1871."},
]


def chat_folder(folder) -> None:
    """A small byte-level BPE tokenizer with ChatML's special tokens, and its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    text = [m["content"] for m in CONVERSATION] * 20 + ["system user assistant the of is a capital"] * 20
    tok.train_from_iterator(text, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "chat_template": CHATML}
    (folder / "tokenizer_config.json").write_text(__import__("json").dumps(config))


def test_chat_data_puts_exactly_the_assistants_tokens_in_the_loss(tmp_path):
    """Token by token against transformers' own rendering: the ids are apply_chat_template's, and a
    position carries loss exactly where the token it predicts is in an assistant turn (the span
    between the conversation up to it with the generation prompt and the conversation through it)."""
    import json

    import transformers

    from framework.data.chat import ChatSequences
    from framework.loss import IGNORE_INDEX

    chat_folder(tmp_path / "tok")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    ids = _ids(hf, CONVERSATION, False)
    assistant = [False] * len(ids)
    for i, message in enumerate(CONVERSATION):
        if message["role"] == "assistant":
            start = len(_ids(hf, CONVERSATION[:i], True))
            for j in range(start, len(_ids(hf, CONVERSATION[: i + 1], False))):
                assistant[j] = True
    data = ChatSequences(str(tmp_path / "chat.jsonl"), str(tmp_path / "tok"), seq_len=len(ids) + 5)
    (inputs,), target = data[0]
    assert inputs[: len(ids)].tolist() == ids
    expected = [ids[j + 1] if assistant[j + 1] else IGNORE_INDEX for j in range(len(ids) - 1)]
    assert target[: len(ids) - 1].tolist() == expected and (target[len(ids) - 1 :] == IGNORE_INDEX).all()
    said = hf.decode([t for t in target.tolist() if t != IGNORE_INDEX])
    assert said == "Paris.<|im_end|>\nRome, since 1871.<|im_end|>\n", said
    assert data.tokens_in(data.collate([data[0]])) == sum(assistant[1:])


def _ids(hf, messages, prompt: bool) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def test_a_llama_trains_on_chat_data_counting_only_the_assistants_tokens(tmp_path):
    import json

    from tests.helpers import read_metrics, train_cli

    chat_folder(tmp_path / "tok")
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(16)))
    run = train_cli(["model=llama", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
                     "model.ffn_hidden=64", "data=chat", f"data.path={tmp_path / 'chat.jsonl'}",
                     f"data.tokenizer={tmp_path / 'tok'}", "data.seq_len=64", "data.batch_size=2", "parallel=none",
                     "steps=2", "logger=none", "progress=false"], tmp_path / "run")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2 and all(m["loss"] > 0 for m in metrics)
    missing = train_cli(["model=llama", "data=chat", f"data.path={tmp_path / 'none.jsonl'}",
                         f"data.tokenizer={tmp_path / 'tok'}", "logger=none"], tmp_path / "bad")  # fmt: skip
    assert missing.returncode == 2 and missing.stderr.strip().splitlines()[-1].startswith("error: data.path: no JSONL")


# ----------------------------------------------------------------------------- lm-evaluation-harness

QUESTIONS = [
    ("def main():\n    return", ["0", " banana split"], 0),
    ("import", [" os", "))))"], 0),
    ("for i in", [" range(10):", " the"], 0),
    ("class Foo", ["(object):", "!!!"], 1),
    ("x = [1, 2,", [" 3]", " zebra"], 1),
    ("if __name__ ==", [' "__main__":', " 42 42 42"], 0),
]


@pytest.mark.slow  # lm_eval's import and a training run: about a minute
def test_lm_eval_runs_a_local_task_on_a_checkpoint_as_a_hand_computation_scores_it(tmp_path):
    """`python -m framework.harness --model hydradist` (lm_eval's command line, the model
    registered) on a multiple-choice task read from a local JSONL file: its accuracy is the share
    of questions whose answer has the highest loglikelihood, each computed here by hand."""
    pytest.importorskip("lm_eval")
    import json

    from framework.doors.generate import open_lm
    from tests.helpers import train_cli

    run = train_cli(["experiment=smoke", "parallel=none", "steps=4", "checkpoint.every=4", "logger=none"],
                    tmp_path / "run")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    from tests.helpers import write_choice_task

    write_choice_task(tmp_path, "tiny_choice", QUESTIONS)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "framework.harness", "--model", "hydradist", "--model_args",
                           f"checkpoint={tmp_path / 'run'}", "--device", "cpu", "--tasks", "tiny_choice", "--include_path",
                           str(tmp_path / "tasks"), "--output_path", str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(next((tmp_path / "out").rglob("results*.json")).read_text())
    acc = results["results"]["tiny_choice"]["acc,none"]
    model = open_lm(str(tmp_path / "run"), [], "cpu")[0]

    def loglikelihood(context: str, continuation: str) -> float:
        """Bytes (the smoke run's tokenizer), the context cut from the left to the model's 32."""
        cont = list(continuation.encode())
        whole = (list(context.encode()) + cont)[-(model.block_size + 1) :]
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([whole[:-1]]))[0].float(), -1)
        first = len(whole) - 1 - len(cont)  # the position that predicts the continuation's first byte
        return sum(logprobs[first + i, t].item() for i, t in enumerate(cont))

    right = [max(range(len(c)), key=lambda i, q=q, c=c: loglikelihood(q, " " + c[i])) == a for q, c, a in QUESTIONS]
    assert acc == pytest.approx(sum(right) / len(right))
    # generate_until: greedy from the KV cache, cut at the first stop string
    from types import SimpleNamespace

    from framework.doors.generate import Sampling, generate
    from framework.doors.harness import HydradistLM

    lm = HydradistLM(str(tmp_path / "run"), device="cpu")
    said = lm.generate_until([SimpleNamespace(args=("def ", {"until": ["\n"], "max_gen_toks": 12}))])[0]
    greedy = generate(model, torch.tensor([list(b"def ")]), 12, Sampling(temperature=0))[0, 4:].tolist()
    assert said == bytes(greedy).decode("utf-8", errors="replace").split("\n", 1)[0]
