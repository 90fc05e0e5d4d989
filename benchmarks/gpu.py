"""The checks only a CUDA GPU can run, each a real job, summarised in one table (docs/results/gpu.md):

- first, the suite's config composition and the `gpu`-marked tests, on this machine (pytest);
- parity: CUDA fp32 (TF32 off) against the CPU run of the same config, losses within 1e-3;
- NCCL with ddp and fsdp (one GPU: world size 1 still goes through the NCCL backend, and
  parallel=fsdp shards even on one rank);
- CUDA autocast float16 with its loss scaler (`precision=amp`), bf16, fp32 on TF32;
- FSDP CPU offload (`memory=offload`): what stays on the device;
- the allocator's peak against the accounted memory and the planner's prediction, and every
  run's planner error on step time and peak (the GPU table of the planner's forecast);
- `compile=true` against eager (only where a C compiler and Python.h let Triton build);
- a rank that hangs under NCCL (2 GPUs): the launcher names the collective and the missing rank
  from the watchdogs' flight-recorder dumps;
- bf16 MFU of a gpt of about 1B parameters (20 layers x 2048, T=1024), compiled, at the largest
  micro-batch that fits: tried from large to small, stopping at the first failure that is not
  out-of-memory.

Every figure of MFU states its peak (bf16, TF32 or fp32: framework.measure.datasheet). The whole script
keeps to `--budget` seconds: rows that would start after it are skipped, saying so.
`--dry-run` composes and validates every check's config with the CUDA parts swapped for CPU ones,
says what would run and what would be skipped, and runs one CPU smoke job.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import config, table  # noqa: E402

SMALL = ["model=gpt", "data=text", "model.n_layer=8", "model.n_embd=512", "model.n_head=8", "data.seq_len=512",
         "data.batch_size=16", "steps=30", "launch.nproc_per_node=1", "device=cuda"]  # fmt: skip
PARITY = ["experiment=smoke", "model.n_layer=2", "model.n_embd=128", "model.n_head=4", "data.seq_len=128",
          "data.batch_size=8", "steps=10", "parallel=none", "precision=fp32", "precision.tf32=false"]  # fmt: skip
BIG = ["model=gpt", "data=text", "model.n_layer=20", "model.n_embd=2048", "model.n_head=16", "data.seq_len=1024",
       "steps=15", "parallel=none", "precision=bf16", "compile=true", "metrics.sample_every=0", "device=cuda"]  # fmt: skip

CHECKS: dict[str, list[str]] = {
    "nccl ddp fp32 (tf32)": [*SMALL, "backend=nccl", "parallel=ddp"],
    "nccl fsdp": [*SMALL, "backend=nccl", "parallel=fsdp"],
    "cuda amp fp16 + scaler": [*SMALL, "backend=nccl", "parallel=ddp", "precision=amp"],
    "fsdp cpu offload": [*SMALL, "backend=nccl", "parallel=fsdp", "memory=offload"],
    "memory vs allocator and planner": [*SMALL, "parallel=none", "metrics.sample_every=1", "steps=6"],
    "eager bf16": [*SMALL, "backend=nccl", "parallel=ddp", "precision=bf16"],
    "compile bf16": [*SMALL, "backend=nccl", "parallel=ddp", "precision=bf16", "compile=true"],
}
CP = ["model=gpt", "data=text", "model.n_layer=8", "model.n_embd=512", "model.n_head=8", "data.seq_len=4096",
      "data.batch_size=4", "steps=10", "parallel=cp", "precision=bf16", "launch.nproc_per_node=2"]  # fmt: skip
CP_IMPLS = ("ring", "torch")
TESTS = {  # name: pytest arguments (the first row: fails fast, before any GPU job)
    "config composition (pytest)": ["tests/test_config.py", "tests/test_gpu_ready.py", "-k", "compose or composes"],
    "gpu-marked tests (pytest -m gpu)": ["-m", "gpu", "tests/test_gpu.py"],
}
BIG_BATCHES = (32, 24, 16, 12, 8, 4)
MB = 1e6


def train(overrides: list[str], out: Path, timeout: float) -> dict:
    """One train.py job; its summary (status failed with the error's last line when it fails)."""
    cmd = [sys.executable, str(ROOT / "train.py"), "logger=none", "progress=false", f"hydra.run.dir={out}", *overrides]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "error": f"timed out after {timeout:.0f} s", "wall_s": time.time() - t0}
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"status": "failed"}
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        oom = "out of memory" in proc.stderr.lower()
        summary = {**summary, "status": "failed", "oom": oom,
                   "error": lines[-1][:200] if lines else f"exit {proc.returncode}"}  # fmt: skip
    summary["wall_s"] = time.time() - t0
    return summary


def metrics_of(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def peak_text(s: dict) -> str:
    peak, dtype = s.get("peak_tflops_per_device"), (s.get("choices") or {}).get("precision", "?")
    kind = {"amp": "fp16", "bf16": "bf16"}.get(dtype, "tf32" if s.get("tf32") else "fp32")
    return f"of the {kind} peak {peak:.3g} TFLOP/s" if peak else "no peak known"


def figures(name: str, s: dict, metrics: list[dict]) -> str:
    """The figures that tell whether a check did what it should."""
    if s.get("status") != "ok":
        return s.get("error", "")
    tps = (s.get("throughput") or {}).get("tokens_per_s") or 0
    mem = s.get("memory") or {}
    parts = [f"{tps:,.0f} tokens/s", f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}"]
    if s.get("mfu") is not None:
        parts.append(f"MFU {s['mfu']:.1%} {peak_text(s)}")
    if "amp" in name:
        scales = [m["loss_scale"] for m in metrics if m.get("loss_scale")]
        parts.append(f"loss scale {scales[0]:.0f} -> {scales[-1]:.0f}" if scales else "no loss scale")
    if "memory" in name and mem.get("device_peak_bytes"):
        peak = mem["device_peak_bytes"]
        held = sum(mem.get(k) or 0 for k in ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes"))
        predicted = (s.get("plan") or {}).get("predicted") or {}
        planned = predicted.get("peak_bytes") or sum(predicted.get(k) or 0 for k in
                                                     ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes"))  # fmt: skip
        parts.append(f"allocator peak {peak / MB:,.0f} MB: accounted {held / MB:,.0f} MB ({held / peak:.0%}), "
                     f"planner {planned / MB:,.0f} MB ({planned / peak:.0%})")  # fmt: skip
    if "offload" in name or "fsdp" in name:
        state = sum(mem.get(k) or 0 for k in ("param_bytes", "grad_bytes", "optim_bytes"))
        on_device = state - (mem.get("offloaded_bytes") or 0)
        parts.append(f"model state on device {on_device / MB:,.0f} of {state / MB:,.0f} MB, "
                     f"peak {(mem.get('device_peak_bytes') or 0) / MB:,.0f} MB")  # fmt: skip
    if s.get("compile_s") is not None:
        parts.append(f"compile {s['compile_s']:.0f} s")
    plan = s.get("plan") or {}
    error = plan.get("error") if isinstance(plan.get("error"), dict) else {}
    for figure, label in (("step_time_s", "step time"), ("peak_bytes", "peak")):
        if error.get(figure) is not None:  # the planner's forecast for this run, as summary.json checks it
            parts.append(f"planner's {label} {error[figure]:+.0%}")
    return "; ".join(parts)


def pytest_row(name: str, args: list[str], timeout: float) -> list:
    t0 = time.time()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [name, "failed", f"timed out after {timeout:.0f} s", round(time.time() - t0)]
    last = (proc.stdout.strip().splitlines() or ["no output"])[-1]
    return [name, "ok" if proc.returncode in (0, 5) else "failed", last.strip("= "), round(time.time() - t0)]


def parity_row(out: Path, timeout: float) -> list:
    """CUDA fp32 without TF32 against the CPU run of the same config: per-step losses."""
    t0 = time.time()
    runs = {d: train([*PARITY, f"device={d}"], out / f"parity_{d}", timeout) for d in ("cuda", "cpu")}
    if any(r.get("status") != "ok" for r in runs.values()):
        return ["parity cuda fp32 vs cpu", "failed", "; ".join(f"{d}: {r.get('error', 'ok')}" for d, r in runs.items()),
                round(time.time() - t0)]  # fmt: skip
    losses = {d: [m["loss"] for m in metrics_of(out / f"parity_{d}")] for d in runs}
    gap = max(abs(a - b) for a, b in zip(losses["cuda"], losses["cpu"], strict=True))
    status = "ok" if gap <= 1e-3 else "failed"
    return ["parity cuda fp32 vs cpu", status, f"{len(losses['cpu'])} steps, max loss gap {gap:.2e} (allowed 1e-3)",
            round(time.time() - t0)]  # fmt: skip


def big_row(out: Path, timeout: float, deadline: float) -> list:
    """The 1B gpt at the largest micro-batch that fits; any failure but out-of-memory ends the search."""
    for batch in BIG_BATCHES:
        if time.time() > deadline:
            return ["gpt 1B bf16 compile", "skipped", "time budget spent", 0]
        s = train([*BIG, f"data.batch_size={batch}"], out / f"big_{batch}", timeout)
        print(f"1B gpt batch {batch}: {s.get('status')} {s.get('error', '')}", flush=True)
        if s.get("status") == "ok":
            return [f"gpt 1B bf16 compile, batch {batch}x1024", "ok", figures("big", s, []), round(s["wall_s"])]
        if not s.get("oom"):
            return [f"gpt 1B bf16 compile, batch {batch}", "failed", s.get("error", ""), round(s["wall_s"])]
    return ["gpt 1B bf16 compile", "failed", "no batch fitted", 0]


def skipped(name: str, no_compile: str | None) -> str | None:
    """Why a check does not run on this machine (None: it runs)."""
    if no_compile and ("compile" in name or "1B" in name):
        return f"skipped: {no_compile}"
    return None


def run_checks(out: Path, timeout: float, no_compile: str | None, deadline: float) -> list[list]:
    rows = [pytest_row(name, args, 300) for name, args in TESTS.items()]
    if rows[0][1] != "ok":
        return rows  # the configs do not compose here: no GPU job would either
    rows.append(parity_row(out, timeout))
    for name, overrides in CHECKS.items():
        if (why := skipped(name, no_compile)) or time.time() > deadline:
            rows.append([name, "skipped", why or "time budget spent", 0])
            continue
        s = train(overrides, out / name.replace(" ", "_"), timeout)
        rows.append([name, s.get("status"), figures(name, s, metrics_of(out / name.replace(" ", "_"))),
                     round(s["wall_s"])])  # fmt: skip
        print(f"{name}: {rows[-1][1]} ({rows[-1][3]} s)", flush=True)
    why = skipped("1B", no_compile)
    rows.append(["gpt 1B bf16 compile", "skipped", why, 0] if why else big_row(out, timeout, deadline))
    rows.append(cp_row(out, timeout) if time.time() < deadline else ["cp=2 ring vs torch", "skipped", "time budget", 0])
    rows.append(hang_row(out, 120) if time.time() < deadline else ["nccl hang", "skipped", "time budget", 0])
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


HANG = ["experiment=smoke", "steps=20", "backend=nccl", "parallel=ddp", "launch.nproc_per_node=2", "device=cuda",
        "backend.step_timeout_s=20"]  # fmt: skip


def hang_row(out: Path, timeout: float) -> list:
    """Rank 1 stops before step 4 under NCCL: the watchdogs dump their flight recorders into the
    run dir (framework.run.resilience.flight_recorder_env) and the launcher names the collective
    and rank 1 as missing (read_dumps)."""
    import torch

    name = "nccl hang: collective and missing rank named"
    if torch.cuda.device_count() < 2:
        return [name, "skipped", f"needs 2 GPUs, {torch.cuda.device_count()} visible", 0]
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "logger=none",
        "progress=false",
        f"hydra.run.dir={out / 'hang'}",
        *HANG,
    ]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "HYDRADIST_FAULT": "1:3:hang"})  # fmt: skip
    except subprocess.TimeoutExpired:
        return [name, "failed", f"still running after {timeout:.0f} s: the hang was not ended", round(time.time() - t0)]
    line = next((x for x in proc.stderr.splitlines() if "flight recorder:" in x), "")
    ok = proc.returncode != 0 and "ranks that never joined it: [1]" in line
    shown = line or (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return [name, "ok" if ok else "failed", shown.removeprefix("error: ")[:200], round(time.time() - t0)]


def dry_run(out: Path, no_compile: str | None) -> list[list]:
    rows = [[name, "dry run", f"would run: pytest {' '.join(args)}", 0] for name, args in TESTS.items()]
    checks = [
        ("parity", PARITY),
        *CHECKS.items(),
        ("gpt 1B bf16 compile", [*BIG, "data.batch_size=4"]),
        ("nccl hang", HANG),
    ]
    for name, overrides in checks:
        cpu = [o for o in overrides if o not in ("backend=nccl", "memory=offload", "device=cuda")]
        config([*cpu, "device=cpu", "launch.nproc_per_node=1"])  # composes and validates, or raises
        rows.append([name, "dry run", skipped(name, no_compile) or "would run (composed with CPU stand-ins)", 0])
    s = train(["experiment=smoke", "steps=4", "device=cpu"], out / "cpu_smoke", 300)
    rows.append(["cpu smoke", s["status"], figures("cpu smoke", s, metrics_of(out / "cpu_smoke")), round(s["wall_s"])])
    return rows


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (
        f"{gpu}, {platform.processor() or platform.machine()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: compose every check, run a CPU smoke job")
    parser.add_argument("--timeout", type=float, default=240, help="seconds per job")
    parser.add_argument("--budget", type=float, default=540, help="seconds for the whole script")
    parser.add_argument("--no-compile", default=None, help="why compile rows cannot run here (set by gpu.sh)")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    deadline = time.time() + args.budget
    with tempfile.TemporaryDirectory() as tmp:
        if args.dry_run:
            rows = dry_run(Path(tmp), args.no_compile)
        else:
            import torch

            if not torch.cuda.is_available():
                sys.exit("error: no CUDA device visible; run with --dry-run on a machine without a GPU")
            rows = run_checks(Path(tmp), args.timeout, args.no_compile, deadline)
    text = table(["check", "status", "figures", "wall s"], rows)
    print(f"\n{machine()}\n\n{text}")
    if not args.dry_run:
        results = ROOT / "docs" / "results" / "gpu.md"
        results.parent.mkdir(parents=True, exist_ok=True)
        results.write_text(f"# GPU checks\n\n`bash benchmarks/gpu.sh` on {machine()}\n\n{text}\n")
    if any(r[1] not in ("ok", "dry run", "skipped") for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
