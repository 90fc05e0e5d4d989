"""The LLM data path: prepare against tokenizers' own encode_batch, and the data=tokens loader
against what training consumes.

    python benchmarks/llm.py

(a) `framework.data.prepare` MB/s of input (tokenize + write shards) against
    `tokenizers.Tokenizer.encode_batch` alone on the same files with the same BPE, as a ratio.
(b) tokens/s the data=tokens DataLoader delivers alone (batch 8 x 128) against the tokens/s that
    `model=llama model.flavor=debug` trains at under ddp x2 (both ranks together): the loader must
    be at least 20x faster so it never stalls training.
Writes the tables to docs/results/llm.md.
"""

from __future__ import annotations

import os
import platform
import random
import tempfile
import time
from pathlib import Path

from common import ROOT, run, table


def corpus(folder: Path, n_docs: int = 200, chars: int = 40000) -> int:
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while données naïve café 日本語 models tokens\n".split(" ")
    pool = " ".join(rng.choice(words) for _ in range(50000))
    folder.mkdir(parents=True)
    total = 0
    for i in range(n_docs):
        start = rng.randrange(len(pool))
        text = (pool[start:] + pool)[: rng.randint(chars // 2, chars)]
        (folder / f"doc{i:04d}.txt").write_text(text)
        total += len(text.encode())
    return total


def prepare_table(tmp: Path) -> tuple[str, Path]:
    from framework.data.prepare import main as prepare
    from framework.data.tokenizer import HFTokenizer

    nbytes = corpus(tmp / "in")
    prepare(
        [
            str(tmp / "in"),
            str(tmp / "bpe"),
            "--tokenizer",
            "bpe",
            "--vocab-size",
            "4096",
            "--no-progress",
            "--workers",
            "1",
            "--shard-mb",
            "1",
        ]
    )  # fmt: skip: trains the BPE (not timed below)
    tok = HFTokenizer.from_file(str(tmp / "bpe" / "tokenizer.json"))
    texts = [p.read_text() for p in sorted((tmp / "in").iterdir())]
    t0 = time.perf_counter()
    tok.tok.encode_batch(texts, add_special_tokens=False)
    base = nbytes / 2**20 / (time.perf_counter() - t0)
    rows = [["tokenizers encode_batch (in memory, no output)", base, 1.0]]
    for workers in (1, 2):
        out = tmp / f"out{workers}"
        t0 = time.perf_counter()
        prepare([str(tmp / "in"), str(out), "--tokenizer", str(tmp / "bpe" / "tokenizer.json"), "--no-progress",
                 "--workers", str(workers), "--shard-mb", "1"])  # fmt: skip
        rate = nbytes / 2**20 / (time.perf_counter() - t0)
        rows.append([f"prepare --workers {workers} (tokenize + write shards)", rate, rate / base])
    text = f"(a) prepare vs encode_batch, {nbytes / 2**20:.1f} MB of text, a BPE of {tok.vocab_size} ids\n\n"
    return text + table(["", "MB/s", "vs encode_batch"], rows), tmp / "out1"


def loader_table(shards: Path) -> str:
    from torch.utils.data import DataLoader, RandomSampler

    from framework.data.tokens import TokenShards

    data = TokenShards(str(shards), 128)
    loader = DataLoader(data, batch_size=8, sampler=RandomSampler(data), collate_fn=data.collate)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < 3:
        for (x,), _ in loader:
            n += x.numel()
    loaded = n / (time.perf_counter() - t0)
    common = ["model=llama", "model.flavor=debug", "data=tokens", f"data.path={shards}", "data.seq_len=128",
              "data.batch_size=8", "steps=12", "metrics.sample_every=0"]  # fmt: skip
    trained = run({"ddp": ["parallel=ddp"]}, 2, common)["ddp"]["throughput"]["tokens_per_s"]
    rows = [["data=tokens loader alone (1 process, batch 8 x 128)", loaded, loaded / trained],
            ["llama debug training, ddp x2 (both ranks)", trained, 1.0]]  # fmt: skip
    return "(b) the loader against training\n\n" + table(["", "tokens/s", "vs training"], rows)


if __name__ == "__main__":
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        a, shards = prepare_table(Path(tmp))
        print(a)
        b = loader_table(shards)
        print("\n" + b)
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs ({platform.processor() or platform.system()})"
    out = ROOT / "docs" / "results" / "llm.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after (other jobs share the cores)"
    out.write_text(f"# LLM data path\n\n`python benchmarks/llm.py` on {machine}; {load}\n\n{a}\n\n{b}\n")
