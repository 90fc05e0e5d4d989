"""Tokenizers, token shards (framework.data.prepare) and data=tokens: decoded shards equal the
input, reruns give the same shards, bad input is one line, training reads memory-mapped windows,
resumes bitwise across an epoch and keeps RSS flat as the corpus grows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")

from tests.helpers import read_metrics, read_summary, train_cli  # noqa: E402

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


@pytest.mark.slow  # an epoch-boundary resume is the default tier's in test_reliability; this is tokens' own
def test_llama_on_tokens_resumes_across_an_epoch_boundary_bitwise(tmp_path, shards):
    from framework.data.tokens import TokenShards

    per_epoch = len(TokenShards(str(shards), 16)) // 4  # steps of 2 ranks x 2 windows
    at = per_epoch + 1  # a checkpoint in the second epoch
    args = [*TINY_LLAMA, "data=tokens", f"data.path={shards}", "parallel=ddp", "launch.nproc_per_node=2",
            f"steps={at + 3}", f"checkpoint.every={at}", "schedule.warmup_steps=2"]  # fmt: skip
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

    from framework.measure.memory import peak_rss_of
    from tests.helpers import ROOT

    peaks = {}
    for n in (2**24, 2**26):  # 32 MB and 128 MB of uint16 tokens
        shards = random_shards(tmp_path / f"s{n}", n)
        cmd = [sys.executable, str(ROOT / "train.py"), *TINY_LLAMA, "data=tokens", f"data.path={shards}",
               "data.seq_len=1024", "parallel=none", "steps=3", f"hydra.run.dir={tmp_path / f'run{n}'}"]  # fmt: skip
        peaks[n] = peak_rss_of(cmd, cwd=ROOT, env={**os.environ, "WANDB_MODE": "offline"})
    assert peaks[2**26] - peaks[2**24] < 16 * 2**20, peaks
