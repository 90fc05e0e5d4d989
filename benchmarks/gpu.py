"""The checks only a CUDA GPU can run, each a real `train.py` job, summarised in one table:

- NCCL with ddp and fsdp (one GPU: world size 1 still goes through the NCCL backend, and
  parallel=fsdp shards even on one rank);
- CUDA autocast float16 with its loss scaler (`precision=amp`);
- FSDP CPU offload (`memory=offload`);
- the accounted memory (state + saved activations) against `torch.cuda.max_memory_allocated`;
- `compile=true` against eager;
- bf16 MFU of a gpt of about 1B parameters (20 layers x 2048, T=1024), compiled, at the largest
  micro-batch that fits (tried from large to small);
- context parallel on 2 GPUs (NCCL, bf16, T=4096): our ring (`parallel.cp_impl=ring`) against
  torch's context_parallel (`cp_impl=torch`), losses within 1e-3 and tokens/s side by side
  (skipped with fewer than 2 GPUs).

`--dry-run` composes and validates every check's config with the CUDA parts swapped for CPU ones
(so the script keeps working where CI has no GPU) and runs one CPU smoke job through the same
summary-reading code.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import config, table  # noqa: E402

SMALL = ["model=gpt", "data=text", "model.n_layer=8", "model.n_embd=512", "model.n_head=8", "data.seq_len=512",
         "data.batch_size=16", "steps=30", "launch.nproc_per_node=1"]  # fmt: skip
BIG = ["model=gpt", "data=text", "model.n_layer=20", "model.n_embd=2048", "model.n_head=16", "data.seq_len=1024",
       "steps=15", "parallel=none", "precision=bf16", "compile=true", "metrics.sample_every=0"]  # fmt: skip

CHECKS: dict[str, list[str]] = {
    "nccl ddp": [*SMALL, "backend=nccl", "parallel=ddp"],
    "nccl fsdp": [*SMALL, "backend=nccl", "parallel=fsdp"],
    "cuda amp fp16 + scaler": [*SMALL, "backend=nccl", "parallel=ddp", "precision=amp"],
    "fsdp cpu offload": [*SMALL, "backend=nccl", "parallel=fsdp", "memory=offload"],
    "memory vs allocator": [*SMALL, "parallel=none", "metrics.sample_every=1", "steps=6"],
    "eager bf16": [*SMALL, "backend=nccl", "parallel=ddp", "precision=bf16"],
    "compile bf16": [*SMALL, "backend=nccl", "parallel=ddp", "precision=bf16", "compile=true"],
}
CP = ["model=gpt", "data=text", "model.n_layer=8", "model.n_embd=512", "model.n_head=8", "data.seq_len=4096",
      "data.batch_size=4", "steps=10", "parallel=cp", "precision=bf16", "launch.nproc_per_node=2"]  # fmt: skip
CP_IMPLS = ("ring", "torch")
BIG_BATCHES = (32, 24, 16, 12, 8, 4)
MB = 1e6


def train(overrides: list[str], out: Path, timeout: float) -> dict:
    """One train.py job; its summary (status failed with the error's last line when it fails)."""
    cmd = [sys.executable, str(ROOT / "train.py"), "logger=none", "progress=false", f"hydra.run.dir={out}", *overrides]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"timed out after {timeout:.0f} s"}
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"status": "failed"}
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        summary = {**summary, "status": "failed", "error": lines[-1][:200] if lines else f"exit {proc.returncode}"}
    summary["wall_s"] = time.time() - t0
    return summary


def figures(name: str, s: dict, metrics: list[dict]) -> str:
    """The figures that tell whether a check did what it should."""
    if s.get("status") != "ok":
        return s.get("error", "")
    tps = (s.get("throughput") or {}).get("tokens_per_s") or 0
    mem = s.get("memory") or {}
    parts = [f"{tps:,.0f} tokens/s", f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}"]
    if s.get("mfu") is not None:
        parts.append(f"MFU {s['mfu']:.1%}")
    if "amp" in name:
        scales = [m["loss_scale"] for m in metrics if m.get("loss_scale")]
        parts.append(f"loss scale {scales[0]:.0f} -> {scales[-1]:.0f}" if scales else "no loss scale")
    if "memory" in name and mem.get("device_peak_bytes"):
        held = sum(mem.get(k) or 0 for k in ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes"))
        parts.append(f"accounted {held / MB:,.0f} MB of allocator peak {mem['device_peak_bytes'] / MB:,.0f} MB"
                     f" ({held / mem['device_peak_bytes']:.0%})")  # fmt: skip
    if "offload" in name or "fsdp" in name:
        parts.append(
            f"params on device {(mem.get('param_bytes') or 0) / MB:,.0f} MB, peak {(mem.get('device_peak_bytes') or 0) / MB:,.0f} MB"
        )
    if s.get("compile_s") is not None:
        parts.append(f"compile {s['compile_s']:.0f} s")
    return "; ".join(parts)


def run_checks(out: Path, timeout: float) -> list[list]:
    import torch

    rows = []
    for name, overrides in CHECKS.items():
        s = train(overrides, out / name.replace(" ", "_"), timeout)
        metrics_path = out / name.replace(" ", "_") / "metrics.jsonl"
        metrics = [json.loads(x) for x in metrics_path.read_text().splitlines()] if metrics_path.exists() else []
        rows.append([name, s.get("status"), figures(name, s, metrics), round(s["wall_s"])])
        print(f"{name}: {rows[-1][1]} ({rows[-1][3]} s)", flush=True)
    for batch in BIG_BATCHES:  # the largest micro-batch that fits
        s = train([*BIG, f"data.batch_size={batch}"], out / f"big_{batch}", timeout)
        print(f"1B gpt batch {batch}: {s.get('status')} {s.get('error', '')}", flush=True)
        if s.get("status") == "ok":
            rows.append([f"gpt 1B bf16 compile, batch {batch}x1024", "ok", figures("big", s, []), round(s["wall_s"])])
            break
    else:
        rows.append(["gpt 1B bf16 compile", "failed", "no batch fitted", 0])
    rows.append(cp_row(out, timeout))
    print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}\n")
    return rows


def cp_row(out: Path, timeout: float) -> list:
    """Our ring against torch's context_parallel, same config: per-step losses and tokens/s."""
    import torch

    name = "cp=2 ring vs torch (bf16)"
    if torch.cuda.device_count() < 2:
        return [name, "skipped", f"needs 2 GPUs, {torch.cuda.device_count()} visible", 0]
    runs, losses = {}, {}
    for impl in CP_IMPLS:
        runs[impl] = train([*CP, "backend=nccl", f"parallel.cp_impl={impl}"], out / f"cp_{impl}", timeout)
        path = out / f"cp_{impl}" / "metrics.jsonl"
        losses[impl] = [json.loads(x)["loss"] for x in path.read_text().splitlines()] if path.exists() else []
    if any(s.get("status") != "ok" for s in runs.values()):
        return [name, "failed", "; ".join(f"{i}: {s.get('error', s.get('status'))}" for i, s in runs.items()), 0]
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["ring"], losses["torch"], strict=True))
    speed = ", ".join(f"{i} {runs[i]['throughput']['tokens_per_s']:,.0f} tokens/s" for i in CP_IMPLS)
    status = "ok" if diff <= 1e-3 else "failed"
    return [
        name,
        status,
        f"{speed}; losses within {diff:.1e} (<= 1e-3)",
        round(sum(s["wall_s"] for s in runs.values())),
    ]


def dry_run(out: Path) -> list[list]:
    rows = []
    cp_ring = [*CP, "parallel.cp_impl=ring"]  # torch's cp_impl is CUDA only: the ring stands in
    for name, overrides in [*CHECKS.items(), ("gpt 1B bf16 compile", [*BIG, f"data.batch_size={BIG_BATCHES[0]}"]),
                            ("cp=2 ring vs torch (bf16)", cp_ring)]:  # fmt: skip
        cpu = [o for o in overrides if o != "backend=nccl" and o != "memory=offload" and not o.startswith("launch.")]
        world = "launch.nproc_per_node=2" if "parallel=cp" in cpu else "launch.nproc_per_node=1"
        config([*cpu, "device=cpu", world])  # composes and validates, or raises
        rows.append([name, "dry run", "composed and validated (CPU stand-ins for CUDA parts)", 0])
    s = train(["experiment=smoke", "steps=4"], out / "cpu_smoke", 300)
    metrics = [json.loads(x) for x in (out / "cpu_smoke" / "metrics.jsonl").read_text().splitlines()]
    rows.append(["cpu smoke", s["status"], figures("cpu smoke", s, metrics), round(s["wall_s"])])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: compose every check, run a CPU smoke job")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per job")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    with tempfile.TemporaryDirectory() as tmp:
        if args.dry_run:
            rows = dry_run(Path(tmp))
        else:
            import torch

            if not torch.cuda.is_available():
                sys.exit("error: no CUDA device visible; run with --dry-run on a machine without a GPU")
            rows = run_checks(Path(tmp), args.timeout)
    print(table(["check", "status", "figures", "wall s"], rows))
    if any(r[1] not in ("ok", "dry run", "skipped") for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
