"""Token shards for corpora larger than memory: `python -m framework.data.prepare INPUT OUT`.

INPUT: a text file (one document), a folder of text files (one document each, sorted), or a JSONL
file or folder of them (one document per line, its `--field`, default `text`). OUT gets
- `shard-NNNNN.bin`: the tokens of a run of documents, each followed by the end-of-document id,
  as uint16 (vocabularies up to 65536) or uint32, read by `data=tokens` through np.memmap;
- `shard-NNNNN.idx`: uint64 end offsets of the shard's documents (its document boundaries);
- `index.json`: the manifest (tokenizer, its digest, vocabulary, dtype, per-shard counts and
  split), written last: a folder with index.json is complete;
- `tokenizer.json` (bpe or a given tokenizer.json);
- `settings.json`: what the shards are made with (the input's files, tokenizer, --vocab-size,
  --field, --shard-mb, --dtype), written before the first shard.

The input is cut into work units of about `--shard-mb` of input each (whole files, or line-aligned
byte ranges of a large JSONL file), one shard per unit, tokenized by `--workers` processes. A
shard is written under a temporary name and renamed when whole, so an interrupted run, rerun,
skips the finished shards and gives the same shards as an uninterrupted one. A rerun with other
settings (another --dtype, tokenizer or shard size, changed input) would read the old shards as
the new format, so it says what differs in one line and rebuilds: the folder's shards, manifest
and tokenizer are removed first, never mixed with new ones.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from framework.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

MANIFEST = "index.json"
SETTINGS = "settings.json"
FLAGS = {"input": "INPUT", "input_files": "INPUT's files", "tokenizer": "--tokenizer", "vocab_size": "--vocab-size",
         "field": "--field", "shard_mb": "--shard-mb", "dtype": "--dtype"}  # fmt: skip


class PrepareError(ValueError):
    pass


@dataclass(frozen=True)
class Unit:
    """One shard's input: whole files, or bytes [start, end) of one JSONL file."""

    files: tuple[str, ...]
    jsonl: bool
    start: int = 0
    end: int = -1

    @property
    def nbytes(self) -> int:
        return self.end - self.start if self.end >= 0 else sum(os.path.getsize(f) for f in self.files)


def input_files(path: str) -> tuple[list[str], bool]:
    root = Path(path)
    if not root.exists():
        raise PrepareError(f"INPUT: no file or folder at {path!r}")
    files = (
        [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    )
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise PrepareError(f"INPUT: {path!r} holds no non-empty file")
    jsonl = [f.suffix in (".jsonl", ".json") for f in files]
    if any(jsonl) and not all(jsonl):
        raise PrepareError(f"INPUT: {path!r} mixes JSONL and text files; give one kind")
    return [str(f) for f in files], all(jsonl)


def work_units(path: str, shard_bytes: int) -> list[Unit]:
    """The input cut into units of about `shard_bytes`, deterministically."""
    files, jsonl = input_files(path)
    units: list[Unit] = []
    group: list[str] = []
    size = 0
    for f in files:
        n = os.path.getsize(f)
        if jsonl and n > shard_bytes:  # a large JSONL file: line-aligned byte ranges
            units += [Unit((f,), True, s, e) for s, e in line_ranges(f, shard_bytes)]
            continue
        group.append(f)
        size += n
        if size >= shard_bytes:
            units.append(Unit(tuple(group), jsonl))
            group, size = [], 0
    if group:
        units.append(Unit(tuple(group), jsonl))
    return units


def line_ranges(path: str, chunk: int) -> list[tuple[int, int]]:
    size, ranges, start = os.path.getsize(path), [], 0
    with open(path, "rb") as f:
        while start < size:
            f.seek(min(start + chunk, size))
            f.readline()  # to the end of the line the cut falls in
            end = min(f.tell(), size)
            ranges.append((start, end))
            start = end
    return ranges


def documents(unit: Unit, field: str):
    """The texts of a unit, in order."""
    for f in unit.files:
        if not unit.jsonl:
            yield Path(f).read_bytes().decode("utf-8", errors="replace")
            continue
        with open(f, "rb") as fh:
            fh.seek(unit.start)
            data = fh.read(unit.end - unit.start if unit.end >= 0 else -1)
        for lineno, line in enumerate(data.splitlines(), 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if field not in record:
                raise PrepareError(f"--field: {f} line {lineno} (of its part) has no field {field!r}; "
                                   f"it has {', '.join(sorted(record)) or 'none'}")  # fmt: skip
            yield str(record[field])


_TOKENIZERS: dict[tuple[str, str], ByteTokenizer | HFTokenizer] = {}  # per worker process, loaded once


def _tokenizer(spec: str, out: str):
    key = (spec, os.path.abspath(out))
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = (
            ByteTokenizer() if spec == "bytes" else HFTokenizer.from_file(os.path.join(out, "tokenizer.json"))
        )
    return _TOKENIZERS[key]


def write_shard(index: int, unit: Unit, spec: str, out: str, field: str, dtype: str) -> dict:
    """Tokenize one unit into shard `index` (skipped when already whole). Runs in a worker."""
    bin_path, idx_path = shard_paths(out, index)
    if not (os.path.exists(bin_path) and os.path.exists(idx_path)):
        tok = _tokenizer(spec, out)
        texts = list(documents(unit, field))
        ids = tok.encode_batch(texts)
        lengths = np.array([len(d) + 1 for d in ids], dtype=np.uint64)
        ends = np.cumsum(lengths, dtype=np.uint64)
        flat = np.full(int(ends[-1]) if len(ends) else 0, tok.eos_id, dtype=np.dtype(dtype))
        for d, end in zip(ids, ends.tolist(), strict=True):
            flat[end - 1 - len(d) : end - 1] = d  # each document, then its end-of-document id
        for path, arr in ((bin_path, flat), (idx_path, ends)):
            tmp = path + ".tmp"
            arr.tofile(tmp)
            os.replace(tmp, path)  # whole or absent
    ends = np.fromfile(idx_path, dtype=np.uint64)
    tokens = int(ends[-1]) if len(ends) else 0
    return {"file": os.path.basename(bin_path), "tokens": tokens, "docs": len(ends), "input_bytes": unit.nbytes}


def shard_paths(out: str, index: int) -> tuple[str, str]:
    base = os.path.join(out, f"shard-{index:05d}")
    return base + ".bin", base + ".idx"


def tokenizer_for(spec: str, units: list[Unit], out: str, field: str, vocab_size: int):
    """Load or train the tokenizer; bpe and tokenizer.json files are saved into OUT (a rerun
    reuses the saved bpe, so its shards stay the same)."""
    saved = os.path.join(out, "tokenizer.json")
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "bpe":
        if not os.path.exists(saved):
            texts = (t for u in units for t in documents(u, field))
            train_bpe(texts, vocab_size).save(saved)
        return HFTokenizer.from_file(saved)
    tok = load_tokenizer(spec)
    tok.save(saved)  # with the end-of-document token it may have gained
    return HFTokenizer.from_file(saved)


def choose_dtype(vocab_size: int, requested: str) -> str:
    if requested == "auto":
        return "uint16" if vocab_size <= 2**16 else "uint32"
    limit = {"uint16": 2**16, "uint32": 2**32}.get(requested)
    if limit is None:
        raise PrepareError(f"--dtype: got {requested!r}; allowed: auto, uint16, uint32")
    if vocab_size > limit:
        raise PrepareError(f"--dtype: the tokenizer has {vocab_size} ids, which do not fit {requested}; use uint32")
    return requested


def settings_of(args: argparse.Namespace, units: list[Unit]) -> dict:
    """What the shards depend on: a rerun with the same settings may reuse finished shards."""
    files = hashlib.sha256()
    for u in units:
        for f in u.files:
            st = os.stat(f)
            files.update(f"{os.path.abspath(f)}:{u.start}:{u.end}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    tokenizer = args.tokenizer
    if tokenizer not in ("bytes", "bpe"):  # a tokenizer.json or its folder: their content, not their path
        tokenizer = tokenizer_content(tokenizer) or tokenizer
    return {"input": os.path.abspath(args.input), "input_files": files.hexdigest()[:16], "tokenizer": tokenizer,
            "vocab_size": args.vocab_size if args.tokenizer == "bpe" else None, "field": args.field,
            "shard_mb": args.shard_mb, "dtype": args.dtype}  # fmt: skip


def tokenizer_content(path: str) -> str | None:
    """The digest of what a tokenizer.json holds, or a folder's tokenizer.json and
    tokenizer_config.json (whose end-of-document token may be added to it); None if neither is there."""
    if os.path.isfile(path):
        return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()
    found = [Path(path, n) for n in ("tokenizer.json", "tokenizer_config.json") if Path(path, n).is_file()]
    digest = hashlib.sha256()
    for f in found:
        digest.update(f.name.encode() + b"\0" + f.read_bytes())
    return "sha256:" + digest.hexdigest() if found else None


def owned_files(out: str) -> list[Path]:
    """What prepare writes into OUT (and a rebuild removes): shards, manifest, tokenizer, settings."""
    names = (MANIFEST, MANIFEST + ".tmp", "tokenizer.json", SETTINGS)
    return [p for p in Path(out).iterdir() if p.name in names or p.name.startswith("shard-")]


def start_or_rebuild(out: str, settings: dict) -> None:
    """Record `settings` in OUT before any shard; a folder made with other settings is cleared first
    (one line says what differs), so old shards are never read as the new format."""
    path = Path(out, SETTINGS)
    old = json.loads(path.read_text()) if path.is_file() else None
    stale = owned_files(out)
    if old != settings and stale:
        differ = [k for k in settings if old and old.get(k) != settings[k]]
        differ = [k for k in differ if None not in (old[k], settings[k])] or differ  # bpe's vocab: with the tokenizer
        why = ", ".join(f"{FLAGS[k]} {old[k]} (now {settings[k]})" if k != "input_files" else f"{FLAGS[k]} changed"
                        for k in differ) or "settings it did not record"  # fmt: skip
        print(f"prepare: {out} holds shards made with {why}; rebuilding them", file=sys.stderr, flush=True)
        for p in stale:
            p.unlink()
    tmp = path.with_name(SETTINGS + ".tmp")
    tmp.write_text(json.dumps(settings, indent=1))
    os.replace(tmp, path)


def prepare(args: argparse.Namespace) -> dict:
    os.makedirs(args.out, exist_ok=True)
    units = work_units(args.input, int(args.shard_mb * 2**20))
    start_or_rebuild(args.out, settings_of(args, units))
    tok = tokenizer_for(args.tokenizer, units, args.out, args.field, args.vocab_size)
    dtype = choose_dtype(tok.vocab_size, args.dtype)
    spec = "bytes" if args.tokenizer == "bytes" else "json"
    shards = run_units(units, spec, args, dtype)
    if not any(s["tokens"] for s in shards):
        raise PrepareError(f"INPUT: {args.input!r} holds no text")
    n_val = min(len(shards) - 1, round(args.val_fraction * len(shards))) if args.val_fraction > 0 else 0
    if args.val_fraction > 0 and n_val < 1:
        raise PrepareError(f"--val-fraction: {len(shards)} shard(s) cannot be split; lower --shard-mb")
    for i, s in enumerate(shards):
        s["split"] = "val" if i >= len(shards) - n_val else "train"
    manifest = {
        "version": 1, "tokenizer": args.tokenizer if args.tokenizer in ("bytes", "bpe") else "tokenizer.json",
        "tokenizer_digest": tok.digest, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id, "dtype": dtype,
        "tokens": sum(s["tokens"] for s in shards), "docs": sum(s["docs"] for s in shards), "shards": shards,
    }  # fmt: skip
    tmp = os.path.join(args.out, MANIFEST + ".tmp")
    Path(tmp).write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, os.path.join(args.out, MANIFEST))
    return manifest


def run_units(units: list[Unit], spec: str, args: argparse.Namespace, dtype: str) -> list[dict]:
    """Every unit's shard, in order, `args.workers` at a time, with a progress bar of input bytes."""
    from tqdm import tqdm

    total = sum(u.nbytes for u in units)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="prepare", disable=not args.progress, file=sys.stderr)
    jobs = [(i, u, spec, args.out, args.field, dtype) for i, u in enumerate(units)]
    results: list[dict] = []
    if args.workers <= 1:
        for job in jobs:
            results.append(write_shard(*job))
            bar.update(job[1].nbytes)
    else:
        with ProcessPoolExecutor(args.workers, mp_context=get_context("spawn")) as pool:
            for r in pool.map(write_shard, *zip(*jobs, strict=True)):
                results.append(r)
                bar.update(r["input_bytes"])
    bar.close()
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m framework.data.prepare", description=__doc__.split("\n")[0])
    p.add_argument("input", help="text file, folder of text files, or JSONL file/folder")
    p.add_argument("out", help="output folder for the shards")
    p.add_argument("--tokenizer", default="bytes", help="bytes | bpe | path to a tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=4096, help="bpe: ids to train")
    p.add_argument("--field", default="text", help="JSONL: the field holding the text")
    p.add_argument("--shard-mb", type=float, default=64.0, help="input MB per shard")
    p.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 1)))
    p.add_argument("--val-fraction", type=float, default=0.0, help="share of shards kept for validation")
    p.add_argument("--dtype", default="auto", help="auto | uint16 | uint32")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    made = not os.path.exists(args.out)
    try:
        m = prepare(args)
    except (PrepareError, FileNotFoundError) as err:
        if made:  # a folder this run made is not left behind; one that was there keeps what it held
            shutil.rmtree(args.out, ignore_errors=True)
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.out}: {len(m['shards'])} shards, {m['docs']} documents, {m['tokens']} tokens ({m['dtype']}), "
          f"vocabulary {m['vocab_size']}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
