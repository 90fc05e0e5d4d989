"""What checkpointing costs a run, what asynchronous saving gives back, and what verifying costs.

    python benchmarks/checkpoint.py            # both tables
    python benchmarks/checkpoint.py verify     # checkpoint.verify=full against off only

gpt (6 layers x 512, about 19M parameters; with AdamW about 0.3 GB of state) with DDP at world
size 2, 30 steps, a checkpoint every 5 steps (6 saves, to a temporary folder). For each way of
saving: the median step time, the seconds training waited per save (sync: the whole write; async:
copying the state aside, plus waiting for the previous save), and the run's training time with
those waits, against training without checkpoints.

`verify`: the same model, saving with `checkpoint.verify=full` (every rank digests the files it
wrote, xxh3, before the manifest and `.metadata`) against `off` (sizes only), then resuming from
such a checkpoint with full verification (every file's size and digest, split over the ranks)
against none. Rows alternate, REPEATS times each; the ratios are of medians, written to
docs/results/checkpoint_verify.md.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile

import torch
from common import ROOT, config, run, table

from framework.sweep import run_configs

COMMON = ["model=gpt", "data=text", "model.n_layer=6", "model.n_embd=512", "model.n_head=8", "data.seq_len=64",
          "data.batch_size=8", "steps=30", "metrics.sample_every=0", "parallel=ddp"]  # fmt: skip


def main() -> None:
    rows = {
        "no checkpoints": [],
        "sync (dcp.save)": ["checkpoint.every=5"],
        "async (dcp.async_save)": ["checkpoint.every=5", "checkpoint.async_save=true"],
    }
    summaries = run(rows, world=2, common=COMMON)
    base = summaries["no checkpoints"]["train_time_s"]
    out = []
    for name, s in summaries.items():
        saves, blocking = s["checkpoint"]["saves"], s["checkpoint"]["blocking_s"]
        total = s["train_time_s"] + blocking
        out.append([name, saves, s["step_time_s"] * 1000, blocking / saves if saves else None, total, total / base])
    print("checkpoint cost: gpt 19M params, ddp x2, 30 steps, a save every 5\n")
    print(table(["saving", "saves", "step ms (median)", "wait per save s", "train + waits s", "vs none"], out))


REPEATS = 3
SAVES = ["steps=10", "checkpoint.every=2"]  # 5 saves per run


def verify_table() -> tuple[str, float, float]:
    """(markdown table, save time ratio full/off, load time ratio full/off)."""
    with tempfile.TemporaryDirectory() as out:
        saving = {f"save {mode} #{i}": config([*COMMON, *SAVES, "launch.nproc_per_node=2", f"checkpoint.verify={mode}"])
                  for i in range(REPEATS) for mode in ("off", "full")}  # fmt: skip
        saved = run_configs(saving, 2, out)
        ckpt = os.path.join(out, f"save full #{REPEATS - 1}", "checkpoints", "step-000010")
        loading = {f"load {mode} #{i}": config([*COMMON, "steps=11", "launch.nproc_per_node=2",
                                                f"checkpoint.resume={ckpt}", f"checkpoint.verify={mode}"])
                   for i in range(REPEATS) for mode in ("off", "full")}  # fmt: skip
        loaded = run_configs(loading, 2, out)
    rows, ratios = [], []
    for what, summaries, key in (("save", saved, "blocking_s"), ("load", loaded, "load_s")):
        per = {mode: [s["checkpoint"][key] / (s["checkpoint"]["saves"] if what == "save" else 1)
                      for name, s in summaries.items() if f" {mode} #" in name] for mode in ("off", "full")}  # fmt: skip
        verify_s = statistics.median(s["checkpoint"]["verify_s"] for n, s in summaries.items() if " full #" in n)
        off, full = statistics.median(per["off"]), statistics.median(per["full"])
        ratios.append(full / off)
        rows.append([what, off, full, full / off, verify_s if what == "load" else None])
    header = ["", "verify=off s (median)", "verify=full s (median)", "full / off", "verify_s (load)"]
    return table(header, rows), ratios[0], ratios[1]


def machine() -> str:
    return (f"{platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, Linux {platform.release()}, "
            f"torch {torch.__version__}, Python {platform.python_version()}")  # fmt: skip


def write_verify_result() -> None:
    text, save_ratio, load_ratio = verify_table()
    title = (
        "checkpoint.verify=full against off: gpt 19M params, ddp x2, 5 saves per run (seconds per save), then a resume"
    )
    print(f"{title}\n\n{text}\n")
    doc = "\n".join([
        "# Checkpoint verification cost", "",
        "Made by `python benchmarks/checkpoint.py verify` (medians of "
        f"{REPEATS} alternating runs per row), on {machine()}.", "",
        f"{title}.", "", text, "",
        f"Save time ratio full/off: {save_ratio:.3f}; load time ratio full/off: {load_ratio:.3f} (the bar: <= 1.15).",
        "Save: every rank digests (xxh3_64) the files it just wrote, one pass over bytes still in the page cache.",
        "Load: `load_s` is verification plus DCP's load; verification reads every file once, split over the ranks.",
        "",
    ])  # fmt: skip
    path = ROOT / "docs" / "results" / "checkpoint_verify.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc)
    print(f"written: {path}")


if __name__ == "__main__":
    if sys.argv[1:] != ["verify"]:
        main()
    write_verify_result()
