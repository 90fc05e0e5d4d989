"""model=llama against Hugging Face's LlamaForCausalLM, checkpoints in and out in its format,
tokenizers, token shards and data=tokens. Tiny shapes, no download (HF_HUB_OFFLINE)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from models.llama import Llama  # noqa: E402
from models.llama_hf import iter_hf_tensors, to_hf  # noqa: E402
from tests.helpers import read_metrics, read_summary, train_cli  # noqa: E402

VOCAB = 257  # the bytes tokenizer's (256 bytes + end of document)


def hf_model(folder: Path, tie: bool, shard: bool = False, seed: int = 0):
    """A tiny random LlamaForCausalLM (GQA: 8 query heads on 2 key/value heads; llama3 rope
    scaling with a short original context, so most frequencies are scaled), saved to `folder`."""
    torch.manual_seed(seed)
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
        vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5, rope_scaling=rope,
        tie_word_embeddings=tie,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, max_shard_size="40KB" if shard else "2GB")
    return model


def ours_from(folder: Path) -> Llama:
    from framework.hf import load_pretrained

    model = Llama(hf_config=str(folder)).eval()
    assert load_pretrained(model, str(folder), torch.device("cpu"), model.from_hf_name) == []  # nothing missing
    return model


@pytest.mark.parametrize("tie,shard", [(False, False), (True, True)])
def test_logits_equal_hf_and_import_export_is_bitwise(tmp_path, tie, shard):
    hf = hf_model(tmp_path, tie, shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    ours = ours_from(tmp_path)
    tokens = torch.randint(0, VOCAB, (2, 48))
    with torch.no_grad():
        assert torch.allclose(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=0)
    back = to_hf(ours.state_dict(), ours.args)
    files = dict(iter_hf_tensors(str(tmp_path)))
    assert set(back) == set(files) - ({"lm_head.weight"} if tie else set())
    for name, tensor in files.items():
        if name in back:
            assert torch.equal(back[name], tensor), name


def test_pretrained_mismatch_names_what_differs(tmp_path):
    from framework.hf import load_pretrained

    hf_model(tmp_path, tie=False)
    deeper = Llama(hf_config=str(tmp_path), n_layers=3)
    assert "layers.2.attention.wq.weight" in load_pretrained(deeper, str(tmp_path), torch.device("cpu"),
                                                            deeper.from_hf_name)  # fmt: skip
    narrower = Llama(hf_config=str(tmp_path), ffn_hidden=80)
    with pytest.raises(ValueError) as err:
        load_pretrained(narrower, str(tmp_path), torch.device("cpu"), narrower.from_hf_name)
    message = str(err.value)  # the first that differs, by both names
    assert "mlp.down_proj.weight is [64, 96] in" in message and "feed_forward.w2.weight is [64, 80]" in message


def test_flavours_have_the_published_shapes():
    with torch.device("meta"):
        sizes = {f: sum(p.numel() for p in Llama(flavor=f).parameters()) for f in ("1b", "8b", "70b")}
    assert abs(sizes["1b"] - 1.236e9) / 1.236e9 < 0.01  # Llama 3.2 1B (tied)
    assert abs(sizes["8b"] - 8.03e9) / 8.03e9 < 0.01
    assert abs(sizes["70b"] - 70.6e9) / 70.6e9 < 0.01
    model = Llama(flavor="debug", vocab_size=VOCAB)
    flops = model.flops_per_token(64)
    assert flops > 6 * sum(p.numel() for n, p in model.named_parameters() if "embeddings" not in n)
    assert model.flops_per_token(64, recomputed_blocks=2) > flops


def test_meta_build_matches_eager_build():
    from framework.modules import materialize

    torch.manual_seed(3)
    eager = Llama(vocab_size=VOCAB, n_layers=2)
    with torch.device("meta"):
        meta = Llama(vocab_size=VOCAB, n_layers=2)
    materialize(meta, torch.device("cpu"), meta.init_rule, 3)
    for (name, a), (_, b) in zip(eager.state_dict().items(), meta.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with torch.device("meta"):
        tied = Llama(vocab_size=VOCAB, n_layers=1, tie_embeddings=True)
    materialize(tied, torch.device("cpu"), tied.init_rule, 3)
    assert tied.output.weight is tied.tok_embeddings.weight  # still one parameter after to_empty


# ----------------------------------------------------------------------------- through train.py

TINY = ["model=llama", "logger=none", "progress=false", "data.seq_len=32", "data.batch_size=2", "data.max_bytes=200000"]


def logits_of_checkpoint(run_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The framework's model at the run's last checkpoint (read back from DCP)."""
    from framework.export import checkpoint_tensors, read_tensor

    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    state = {n: read_tensor(str(ckpt), n, *meta) for n, meta in checkpoint_tensors(str(ckpt)).items()}
    model = Llama(hf_config=str(run_dir.parent / "hf")).eval()
    if model.args.tie_embeddings:
        state.setdefault("output.weight", state["tok_embeddings.weight"])
    model.load_state_dict(state)
    with torch.no_grad():
        return model(tokens)


@pytest.fixture(scope="module")
def pretrained_fsdp_run(tmp_path_factory):
    """Start from a tiny HF checkpoint, train 2 steps under fsdp x2, save, export."""
    root = tmp_path_factory.mktemp("llama_fsdp")
    hf = hf_model(root / "hf", tie=False)
    run = root / "run"
    r = train_cli([*TINY, "parallel=fsdp", "launch.nproc_per_node=2", f"model.pretrained={root / 'hf'}",
                   "steps=2", "checkpoint.every=2"], run)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    from framework.export import main as export_main

    assert export_main([str(ckpt), str(root / "out"), "--format", "hf"]) == 0
    return root, hf, run


def test_pretrained_run_holds_the_hf_weights(tmp_path):
    """model=llama model.pretrained=<folder>: with a zero learning rate the saved model is the
    Hugging Face one, logits equal within 1e-5 (tied variant: the export test covers untied)."""
    hf = hf_model(tmp_path / "hf", tie=True)
    run = tmp_path / "run"
    r = train_cli([*TINY, "parallel=none", f"model.pretrained={tmp_path / 'hf'}", "steps=1", "checkpoint.every=1",
                   "optim.lr=1e-30", "optim.grad_clip=0"], run)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_summary(run)["status"] == "ok"
    tokens = torch.randint(0, VOCAB, (2, 32))
    with torch.no_grad():
        assert torch.allclose(logits_of_checkpoint(run, tokens), hf(tokens).logits, atol=1e-5, rtol=0)
    # import then export (framework.export from the run's checkpoint): every tensor bitwise
    from framework.export import main as export_main

    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert export_main([str(ckpt), str(tmp_path / "out"), "--format", "hf"]) == 0
    exported, original = dict(iter_hf_tensors(str(tmp_path / "out"))), dict(iter_hf_tensors(str(tmp_path / "hf")))
    assert set(exported) == set(original) - {"lm_head.weight"}
    assert all(torch.equal(exported[k], original[k]) for k in exported)


def test_fsdp_export_loads_in_transformers_with_equal_logits(pretrained_fsdp_run):
    root, hf, run = pretrained_fsdp_run
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / "out").eval()
    tokens = torch.randint(0, VOCAB, (2, 32))
    with torch.no_grad():
        theirs = exported(tokens).logits
    assert torch.allclose(theirs, logits_of_checkpoint(run, tokens), atol=1e-5, rtol=0)
    with torch.no_grad():  # and training moved the weights away from the pretrained ones
        assert not torch.allclose(theirs, hf(tokens).logits, atol=1e-4)


# ----------------------------------------------------------------------------- tokenizers and shards


def prepare(*args: str) -> int:
    from framework.data.prepare import main

    return main([*map(str, args), "--no-progress"])


def text_folder(folder: Path, n_docs: int, chars_per_doc: int, seed: int = 0) -> list[str]:
    """n_docs files of random words (multi-byte characters among them), up to chars_per_doc each."""
    import random

    rng = random.Random(seed)
    words = "the quick brown fox jumps over a lazy dog; données, naïve café 日本語 ✓ tokens\n".split(" ")
    pool = " ".join(rng.choice(words) for _ in range(40000))
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for i in range(n_docs):
        n = rng.randint(chars_per_doc // 2, chars_per_doc)
        start = rng.randrange(len(pool))
        text = (pool[start:] + pool)[:n]
        (folder / f"doc{i:05d}.txt").write_text(text)
        docs.append(text)
    return docs


def decoded_docs(out: Path, tok=None) -> list[str]:
    """Every document of the shards, decoded."""
    import numpy as np

    from framework.data.tokenizer import tokenizer_of_shards

    tok = tok or tokenizer_of_shards(str(out))
    manifest = json.loads((out / "index.json").read_text())
    docs = []
    for s in manifest["shards"]:
        tokens = np.fromfile(out / s["file"], dtype=manifest["dtype"])
        ends = np.fromfile(out / s["file"].replace(".bin", ".idx"), dtype=np.uint64).tolist()
        for start, end in zip([0, *ends[:-1]], ends, strict=True):
            assert tokens[end - 1] == manifest["eos_id"]
            docs.append(tok.decode(tokens[start : end - 1].tolist()))
    return docs


def test_prepare_20mb_folder_decodes_to_the_input_and_reruns_the_same(tmp_path):
    docs = text_folder(tmp_path / "in", 400, 66000)
    assert sum(len(d.encode()) for d in docs) > 18e6
    out = tmp_path / "out"
    assert prepare(tmp_path / "in", out, "--shard-mb", "2", "--workers", "2") == 0
    assert decoded_docs(out) == docs
    before = {p.name: p.read_bytes() for p in out.glob("shard-*")}
    assert len(before) >= 16
    # interrupted: the manifest not yet written, two shards missing, one left half-written
    (out / "index.json").unlink()
    for name in ("shard-00003.bin", "shard-00003.idx", "shard-00007.idx"):
        (out / name).unlink()
    (out / "shard-00003.bin.tmp").write_bytes(b"\x01\x02")
    kept = (out / "shard-00000.bin").stat().st_mtime_ns
    assert prepare(tmp_path / "in", out, "--shard-mb", "2", "--workers", "1") == 0
    assert {p.name: p.read_bytes() for p in out.glob("shard-*") if not p.name.endswith(".tmp")} == before
    assert (out / "shard-00000.bin").stat().st_mtime_ns == kept  # finished shards were skipped


def test_bpe_and_tokenizer_json_round_trip_documents(tmp_path):
    docs = text_folder(tmp_path / "in", 40, 2400, seed=1)
    assert prepare(tmp_path / "in", tmp_path / "bpe", "--tokenizer", "bpe", "--vocab-size", "500",
                   "--shard-mb", "0.02", "--val-fraction", "0.2") == 0  # fmt: skip
    manifest = json.loads((tmp_path / "bpe" / "index.json").read_text())
    assert manifest["vocab_size"] <= 500 and manifest["tokens"] < sum(len(d.encode()) for d in docs) / 2
    assert {s["split"] for s in manifest["shards"]} == {"train", "val"}
    assert decoded_docs(tmp_path / "bpe") == docs
    # the trained tokenizer.json, given as a path: same ids, same text back
    path = tmp_path / "bpe" / "tokenizer.json"
    assert prepare(tmp_path / "in", tmp_path / "json", "--tokenizer", path, "--shard-mb", "0.02") == 0
    assert decoded_docs(tmp_path / "json") == docs
    a, b = (json.loads((tmp_path / d / "index.json").read_text())["tokens"] for d in ("bpe", "json"))
    assert a == b


def test_prepare_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert prepare(tmp_path / "empty", tmp_path / "o1") == 2
    (tmp_path / "d.jsonl").write_text('{"body": "x"}\n')
    assert prepare(tmp_path / "d.jsonl", tmp_path / "o2") == 2
    from tokenizers import Tokenizer, models

    big = Tokenizer(models.WordLevel({f"w{i}": i for i in range(70000)}, unk_token="w0"))
    big.save(str(tmp_path / "big.json"))
    (tmp_path / "t.txt").write_text("w1 w2")
    assert prepare(tmp_path / "t.txt", tmp_path / "o3", "--tokenizer", tmp_path / "big.json", "--dtype", "uint16") == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(lines) == 3
    assert "holds no non-empty file" in lines[0] and "no field 'text'" in lines[1] and "do not fit uint16" in lines[2]


def test_token_windows_are_the_shards_tokens(tmp_path):
    import numpy as np

    from framework.data.tokens import TokenShards

    text_folder(tmp_path / "in", 30, 1800, seed=2)
    assert prepare(tmp_path / "in", tmp_path / "out", "--shard-mb", "0.005") == 0
    data = TokenShards(str(tmp_path / "out"), 16, pack=True)
    manifest = data.manifest
    first = np.fromfile(tmp_path / "out" / manifest["shards"][0]["file"], dtype=manifest["dtype"])
    (x, docs), y = data[1]
    assert x.tolist() == first[16:32].tolist() and y[~(x == 256)].tolist() == first[17:33][~(x == 256).numpy()].tolist()
    assert (y[x == 256] == -100).all() and docs.tolist() == sorted(docs.tolist())
    assert len(data) == sum((s["tokens"] - 1) // 16 for s in manifest["shards"])


# ----------------------------------------------------------------------------- data=tokens in train.py

TINY_LLAMA = ["model=llama", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
              "model.ffn_hidden=64", "logger=none", "progress=false", "data.seq_len=16", "data.batch_size=2"]  # fmt: skip


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shards")
    text_folder(root / "in", 4, 180, seed=4)  # a few dozen windows of 16: an epoch in a few ddp x2 steps
    assert prepare(root / "in", root / "out", "--shard-mb", "0.0002") == 0
    return root / "out"


def test_llama_on_tokens_resumes_across_an_epoch_boundary_bitwise(tmp_path, shards):
    from framework.data.tokens import TokenShards

    per_epoch = len(TokenShards(str(shards), 16)) // 4  # steps of 2 ranks x 2 windows
    at = per_epoch + 1  # a checkpoint in the second epoch
    args = [*TINY_LLAMA, "data=tokens", f"data.path={shards}", "parallel=ddp", "launch.nproc_per_node=2",
            f"steps={at + 3}", f"checkpoint.every={at}", "optim.warmup_steps=2"]  # fmt: skip
    full = tmp_path / "full"
    proc = train_cli(args, full)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = full / "checkpoints" / f"step-{at:06d}"
    assert json.loads((ckpt / "trainer.json").read_text())["data"]["epoch"] == 1
    resumed = tmp_path / "resumed"
    proc = train_cli([*args, f"checkpoint.resume={ckpt}"], resumed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = {m["step"]: m["loss"] for m in read_metrics(full)}
    assert [(m["step"], m["loss"]) for m in read_metrics(resumed)] == [(s, want[s]) for s in range(at + 1, at + 4)]
    summary = read_summary(full)
    assert summary["choices"]["model"] == "llama" and summary["throughput"]["tokens_per_s"] > 0


def test_gpt_trains_on_tokens_and_a_small_vocabulary_is_a_config_error(tmp_path, shards):
    gpt = [
        "model=gpt",
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "logger=none",
        "progress=false",
        "data=tokens",
        f"data.path={shards}",
        "data.seq_len=16",
        "data.batch_size=2",
        "steps=2",
    ]
    proc = train_cli(gpt, tmp_path / "small")
    assert proc.returncode == 2 and "model.vocab_size: got 256; the data's tokenizer has 257 ids" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = train_cli([*gpt, "model.vocab_size=257", "parallel=none"], tmp_path / "gpt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(read_metrics(tmp_path / "gpt")) == 2


def random_shards(folder: Path, n_tokens: int, shard_tokens: int = 2**22) -> Path:
    """Shards of random byte ids (an end of document every 1000 tokens) and their manifest,
    written directly: the loader's memory, not prepare, is under test."""
    import numpy as np

    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    shards = []
    for i, start in enumerate(range(0, n_tokens, shard_tokens)):
        tokens = rng.integers(0, 256, min(shard_tokens, n_tokens - start), dtype=np.uint16)
        tokens[999::1000] = 256
        tokens.tofile(folder / f"shard-{i:05d}.bin")
        ends = np.append(np.arange(1000, len(tokens) + 1, 1000, dtype=np.uint64), np.uint64(len(tokens)))
        np.unique(ends).tofile(folder / f"shard-{i:05d}.idx")
        shards.append(
            {"file": f"shard-{i:05d}.bin", "tokens": len(tokens), "docs": len(np.unique(ends)), "split": "train"}
        )
    manifest = {"version": 1, "tokenizer": "bytes", "tokenizer_digest": "bytes-utf8-eos256", "vocab_size": 257,
                "eos_id": 256, "dtype": "uint16", "tokens": n_tokens, "docs": 0, "shards": shards}  # fmt: skip
    (folder / "index.json").write_text(json.dumps(manifest))
    return folder


def test_training_on_tokens_keeps_rss_flat_as_the_corpus_grows(tmp_path):
    """The loader never holds the corpus: a corpus 4x larger (96 MB more of tokens) costs next to
    nothing more in peak RSS (whole-corpus reading would add at least those 96 MB)."""
    import sys

    from framework.memory import peak_rss_of
    from tests.helpers import ROOT

    peaks = {}
    for n in (2**24, 2**26):  # 32 MB and 128 MB of uint16 tokens
        shards = random_shards(tmp_path / f"s{n}", n)
        cmd = [sys.executable, str(ROOT / "train.py"), *TINY_LLAMA, "data=tokens", f"data.path={shards}",
               "data.seq_len=1024", "parallel=none", "steps=3", f"hydra.run.dir={tmp_path / f'run{n}'}"]  # fmt: skip
        peaks[n] = peak_rss_of(cmd, cwd=ROOT, env={**os.environ, "WANDB_MODE": "offline"})
    assert peaks[2**26] - peaks[2**24] < 16 * 2**20, peaks


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("llama_ref") / "none"
    args = [a for a in TINY_LLAMA if not a.startswith("data.batch_size")]
    proc = train_cli([*args, "parallel=none", "data.batch_size=4", "steps=3", "optim.grad_clip=0"], run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [m["loss"] for m in read_metrics(run)]


# (strategy, ranks, micro-batch per data-parallel rank): a global batch of 4 in every case
LAYOUTS = [("ddp", 2, 2), ("fsdp", 2, 2), ("tp", 2, 4), ("pp", 2, 4), ("hybrid", 4, 2)]


@pytest.mark.parametrize("parallel,ranks,batch", LAYOUTS)
def test_llama_parity_across_strategies(tmp_path, llama_reference, parallel, ranks, batch):
    """fp32, the same global batch: every strategy gives the single process's losses (tp: GQA's
    key/value heads split too; pp: two stages of one layer; hybrid at 4: dp_shard 2 x tp 2)."""
    args = [a for a in TINY_LLAMA if not a.startswith("data.batch_size")]
    args += [f"parallel={parallel}", f"launch.nproc_per_node={ranks}", f"data.batch_size={batch}", "steps=3",
             "optim.grad_clip=0"]  # fmt: skip
    proc = train_cli(args, tmp_path / parallel)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = [m["loss"] for m in read_metrics(tmp_path / parallel)]
    assert llama_reference[-1] < llama_reference[0]  # it trains
    for step, (a, b) in enumerate(zip(got, llama_reference, strict=True), start=1):
        assert abs(a - b) / abs(b) <= 1e-4, f"step {step}: {parallel} {a} vs single-process {b}"
