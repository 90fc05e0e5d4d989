"""A chat fine-tune is usable afterwards: after `train.py model=llama model.pretrained=DIR data=chat
data.tokenizer=FOLDER checkpoint.export=true`, framework.generate, framework.evaluate and the
lm-evaluation-harness model read the run with its tokenizer, and the exported `hf/` folder carries
the tokenizer and its chat template, so that transformers alone chats with the model: the same
greedy tokens as framework.generate, the same scores as the harness. Nothing is downloaded."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from tests.helpers import ROOT, train_cli  # noqa: E402
from tests.test_finetune import CONVERSATION, chat_folder  # noqa: E402

QUESTION = CONVERSATION[:2]  # a system turn and a question: the assistant's turn comes next
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A tiny pretrained Llama of the chat tokenizer's vocabulary, fine-tuned on chat data for 3
    steps with data.tokenizer the tokenizer's folder, checkpointed at the end and exported."""
    root = tmp_path_factory.mktemp("chat")
    chat_folder(root / "tok")
    vocab = load_hf_tokenizer(root / "tok").vocab_size + 3  # the three special tokens
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=vocab,
                                      max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(root / "hf")
    (root / "chat.jsonl").write_text("\n".join(json.dumps({"messages": CONVERSATION}) for _ in range(16)))
    run = train_cli(["model=llama", f"model.pretrained={root / 'hf'}", "data=chat", f"data.path={root / 'chat.jsonl'}",
                     f"data.tokenizer={root / 'tok'}", "data.seq_len=64", "data.batch_size=2", "parallel=none",
                     "steps=3", "optim.lr=0.01", "checkpoint.every=3", "checkpoint.export=true", "progress=false"],
                    root / "run")  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return root


def load_hf_tokenizer(folder):
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def chat_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(out["input_ids"]) if hasattr(out, "keys") else list(out)


def front_door(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip


def test_the_export_carries_the_tokenizer_and_its_chat_template(chat_run):
    exported, given = load_hf_tokenizer(chat_run / "run" / "hf"), load_hf_tokenizer(chat_run / "tok")
    text = exported.apply_chat_template(CONVERSATION, tokenize=False)
    assert text == given.apply_chat_template(CONVERSATION, tokenize=False) and text.startswith("<|im_start|>system")
    assert chat_ids(exported, QUESTION) == chat_ids(given, QUESTION)
    # the end of an assistant's turn ends generation, in transformers as in framework.generate
    model_config = json.loads((chat_run / "run" / "hf" / "config.json").read_text())
    assert exported.eos_token == "<|im_end|>" and model_config["eos_token_id"] == exported.eos_token_id


def test_greedy_generate_of_a_chat_prompt_equals_transformers_on_the_export(chat_run):
    hf = chat_run / "run" / "hf"
    tokenizer = load_hf_tokenizer(hf)
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    proc = front_door("framework.generate", str(chat_run / "run"), "--prompt", prompt, "--temperature", "0",
                      "--print-ids", "--max-new-tokens", str(NEW_TOKENS))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    ours = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    ids = chat_ids(tokenizer, QUESTION)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False)
    theirs = out[0, len(ids) :].tolist()
    if theirs and theirs[-1] == tokenizer.eos_token_id:  # framework.generate stops there, unprinted
        theirs = theirs[:-1]
    assert ours == theirs and ours, (ours, theirs)


def test_evaluate_scores_the_run(chat_run):
    proc = front_door("framework.evaluate", str(chat_run / "run"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert float(re.search(r"^loss\s+([0-9.]+)$", proc.stdout, re.M).group(1)) > 0


def test_the_harness_scores_an_answer_as_transformers_does_on_the_export(chat_run):
    pytest.importorskip("lm_eval")
    from framework.doors.harness import HydradistLM

    hf = chat_run / "run" / "hf"
    tokenizer = load_hf_tokenizer(hf)
    context = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    [(score, _)] = HydradistLM(str(chat_run / "run"), device="cpu").loglikelihood(
        [SimpleNamespace(args=(context, "Paris."))]
    )
    first = tokenizer(context, add_special_tokens=False)["input_ids"]
    answer = tokenizer("Paris.", add_special_tokens=False)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([first + answer])).logits[0].float(), -1)
    expected = sum(logprobs[len(first) - 1 + i, t].item() for i, t in enumerate(answer))
    assert score == pytest.approx(expected, abs=1e-4)


# ----------------------------------------------------------------------------- tokenizer resolution


def test_a_tokenizer_is_a_tokenizer_json_or_its_folder(tmp_path):
    """data.tokenizer, for every data choice and every reader of a run: the folder data=chat takes,
    or the tokenizer.json in it; the end of document is the folder's declared eos_token."""
    from omegaconf import OmegaConf

    from framework.config import ConfigError
    from framework.data.chat import ChatSequences
    from framework.data.tokenizer import load_tokenizer
    from framework.data.tokens import data_problem
    from framework.doors.generate import run_tokenizer

    chat_folder(tmp_path / "tok")
    folder, file = load_tokenizer(str(tmp_path / "tok")), load_tokenizer(str(tmp_path / "tok" / "tokenizer.json"))
    assert folder.encode("What is the capital?") == file.encode("What is the capital?")
    assert folder.eos_id == file.eos_id == folder.tok.token_to_id("<|im_end|>")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CONVERSATION}))
    assert len(ChatSequences(str(tmp_path / "chat.jsonl"), str(tmp_path / "tok" / "tokenizer.json"), 64)) == 1
    assert data_problem(OmegaConf.create({"name": "text", "tokenizer": str(tmp_path / "tok")})) is None
    assert data_problem(OmegaConf.create({"name": "text", "tokenizer": str(tmp_path)}))[0] == "data.tokenizer"
    (tmp_path / "bare").mkdir()  # a tokenizer without a chat template cannot render conversations
    (tmp_path / "bare" / "tokenizer.json").write_bytes((tmp_path / "tok" / "tokenizer.json").read_bytes())
    chat = {"name": "chat", "path": str(tmp_path / "chat.jsonl"), "tokenizer": str(tmp_path / "bare")}
    key, message = data_problem(OmegaConf.create(chat))
    assert key == "data.tokenizer" and "no chat_template" in message
    with pytest.raises(ConfigError) as err:
        run_tokenizer(OmegaConf.create({"data": {"name": "chat", "tokenizer": str(tmp_path / "gone")}}))
    assert err.value.key == "data.tokenizer" and "gone" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("data", ["text", "tokens"])
def test_text_and_token_runs_export_a_tokenizer_transformers_loads(tmp_path, data):
    """data=text with a bare tokenizer.json (no tokenizer_config.json beside it) and data=tokens
    with bpe shards: the export's tokenizer encodes as the run's did."""
    from omegaconf import OmegaConf

    from framework.checkpoint.export import write_tokenizer
    from framework.data.prepare import main as prepare
    from framework.data.tokenizer import data_tokenizer

    chat_folder(tmp_path / "tok")
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "tokenizer.json").write_bytes((tmp_path / "tok" / "tokenizer.json").read_bytes())
    cfg = OmegaConf.create({"data": {"name": "text", "tokenizer": str(tmp_path / "bare" / "tokenizer.json")}})
    if data == "tokens":
        (tmp_path / "corpus.txt").write_text(" ".join(m["content"] for m in CONVERSATION) * 20)
        assert prepare([str(tmp_path / "corpus.txt"), str(tmp_path / "shards"), "--tokenizer", "bpe",
                        "--vocab-size", "300", "--workers", "1", "--no-progress"]) == 0  # fmt: skip
        cfg = OmegaConf.create({"data": {"name": "tokens", "path": str(tmp_path / "shards")}})
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ours = data_tokenizer(cfg.data)
    write_tokenizer(ours, str(tmp_path / "out"))
    theirs = load_hf_tokenizer(tmp_path / "out")
    text = "What is the capital of France? Rome, since 1871."
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert theirs.eos_token_id == ours.eos_id
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == ours.eos_id
