"""What checkpointing costs a run, what asynchronous saving gives back, and what verifying costs.

    python benchmarks/checkpoint.py            # both tables
    python benchmarks/checkpoint.py verify     # checkpoint.verify=full against off only

gpt (6 layers x 512, about 19M parameters; with AdamW about 0.3 GB of state) with DDP at world
size 2, 30 steps, a checkpoint every 5 steps (6 saves, to a temporary folder). For each way of
saving: the median step time, the seconds training waited per save (sync: the whole write; async:
copying the state aside, plus waiting for the previous save), and the run's training time with
those waits, against training without checkpoints.

`verify`: the same model and optimizer state (DDP, 2 ranks), saved with `checkpoint.verify=full`
(every rank digests the files it wrote, xxh3, before the manifest and `.metadata`) against `off`
(sizes only), and loaded back through resume's verification (full: every file's size and digest,
split over the ranks; off: none) and the load. Both through the framework's own Checkpointer,
resume.choose and checkpoint.load, alternating REPEATS times; the ratios are of medians (the
slowest rank's time each), written to docs/results/checkpoint_verify.md.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
from common import ROOT, config, recorded, run, table

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


REPEATS = 7


def _time(fn, *args) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn(*args)
    dist.barrier()  # the slowest rank's time
    return time.perf_counter() - t0


def _verify_worker(out: str) -> dict[str, list[float]] | None:
    """On each of 2 ranks: the 19M gpt under DDP with AdamW state, saved and resumed through the
    framework's own Checkpointer, resume.choose (verification) and checkpoint.load, alternating
    verify=off and full REPEATS times."""
    from omegaconf import OmegaConf

    from framework.checkpoint import store as checkpoint
    from framework.checkpoint.integrity import file_entries
    from framework.dist import destroy_distributed, init_distributed
    from framework.run.trainer import build

    info = init_distributed("cpu", "gloo", timeout_s=600)
    try:
        cfg = OmegaConf.create(config([*COMMON, "launch.nproc_per_node=2"]))
        setup = build(cfg, info)
        model, optimizer = setup.par.module, setup.optimizer
        for p in model.parameters():  # AdamW state without a training step
            p.grad = torch.zeros_like(p)
        optimizer.step()
        times: dict[str, list[float]] = {f"{what} {mode}": [] for what in ("save", "load") for mode in ("off", "full")}
        for i in range(REPEATS):
            for mode in ("off", "full"):
                opts = SimpleNamespace(keep_last=0, async_save=False, verify=mode, on_error="stop")
                saver = checkpoint.Checkpointer(os.path.join(out, f"{mode}-{i}"), info.rank, opts)
                state = checkpoint.TrainerState(i, {}, {}, {}, {})
                times[f"save {mode}"].append(_time(saver.save, 1, model, optimizer, state, {}))
                load = OmegaConf.create({"checkpoint": {"resume": checkpoint.step_dir(saver.root, 1), "verify": mode}})
                times[f"load {mode}"].append(_time(_resume, load, info, model, optimizer))
        if info.is_main:  # the digest pass alone: every file of one checkpoint, one process
            folder = checkpoint.step_dir(os.path.join(out, f"full-{REPEATS - 1}"), 1)
            names = [n for n in os.listdir(folder) if n not in (".metadata", "manifest.json")]
            t0 = time.perf_counter()
            file_entries(folder, names, digests=True)
            times["digest"] = [time.perf_counter() - t0, sum(os.path.getsize(os.path.join(folder, n)) for n in names)]
        return times if info.is_main else None
    finally:
        destroy_distributed()


def _resume(cfg, info, model, optimizer) -> None:
    from framework.checkpoint import store as checkpoint
    from framework.checkpoint.resume import choose

    checkpoint.load(choose(cfg, "", info)[0], model, optimizer, info.rank)


def verify_table() -> tuple[str, float, float]:
    """(markdown table, save time ratio full/off, load time ratio full/off), of the fastest repeats:
    on a shared machine the other load only adds time, so the fastest is the least disturbed."""
    from framework.machine import launch_local

    with tempfile.TemporaryDirectory() as out:
        times = launch_local(2, _verify_worker, out)[0]
    rows, ratios = [], []
    for what in ("save", "load"):
        off, full = times[f"{what} off"], times[f"{what} full"]
        ratios.append(min(full) / min(off))
        rows.append([what, min(off), min(full), ratios[-1], statistics.median(full) / statistics.median(off),
                     " ".join(f"{t:.3g}" for t in off), " ".join(f"{t:.3g}" for t in full)])  # fmt: skip
    seconds, size = times["digest"]
    rows.append([f"digest pass alone ({size / 1e6:.0f} MB, one process)", None, seconds, seconds / rows[0][1],
                 None, "", ""])  # fmt: skip
    header = ["", "off s (fastest)", "full s (fastest)", "full / off (fastest)", "full / off (medians)",
              "off, each repeat s", "full, each repeat s"]  # fmt: skip
    return table(header, rows), ratios[0], ratios[1]


def machine() -> str:
    return (f"{platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, Linux {platform.release()}, "
            f"torch {torch.__version__}, Python {platform.python_version()}")  # fmt: skip


def write_verify_result() -> None:
    text, save_ratio, load_ratio = verify_table()
    title = "checkpoint.verify=full against off: gpt 19M params + AdamW state, ddp x2, seconds per save and per load"
    print(f"{title}\n\n{text}\n")
    doc = "\n".join([
        "# Checkpoint verification cost", "",
        f"Made by `python benchmarks/checkpoint.py verify` ({REPEATS} alternating repeats), on {machine()}.",
        "",
        f"{title}.", "", text, "",
        f"Save time ratio full/off: {save_ratio:.3f}; load time ratio full/off: {load_ratio:.3f} (fastest repeats; "
        "the bar: <= 1.15).",
        "Save: every rank digests (xxh3_64) the files it just wrote, one pass over bytes still in the page cache.",
        "Load: verification (resume.choose) plus DCP's load; verification reads every file once, split over the ranks.",
        "The last row is the digest pass by itself (its ratio: against the fastest save with verify=off): what full",
        "verification adds at most, free of the noise of a shared machine (`uptime` load average while it ran: "
        f"{os.getloadavg()[0]:.1f}).",
        "",
    ])  # fmt: skip
    path = ROOT / "docs" / "results" / "checkpoint_verify.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc)
    print(f"written: {path}")


if __name__ == "__main__":
    if sys.argv[1:] != ["verify"]:
        with recorded("checkpoint"):
            main()
    write_verify_result()
