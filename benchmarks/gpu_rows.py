"""The rows of benchmarks/gpu.py: each runs on a CUDA GPU, or as its CPU stand-in (tiny shapes,
device=cpu) in the rehearsal, and returns (status, figures, data)."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 1e6

# The headline: ~1B parameters (byte vocabulary), bf16, compiled; the stand-ins' shapes are tiny.
LLAMA_1B = ["model=llama", "model.flavor=1b", "data=text", "data.seq_len=2048", "data.batch_size=8"]
GPT_1B = ["model=gpt", "data=text", "model.n_layer=20", "model.n_embd=2048", "model.n_head=16",
          "data.seq_len=1024", "data.batch_size=16"]  # fmt: skip
SMALL = ["model=gpt", "data=text", "model.n_layer=8", "model.n_embd=512", "model.n_head=8", "data.seq_len=512",
         "data.batch_size=16"]  # fmt: skip
TINY_LLAMA = ["model=llama", "model.flavor=debug", "model.n_layers=2", "model.dim=64", "model.n_heads=4",
              "model.n_kv_heads=2", "model.ffn_hidden=128", "data=text", "data.seq_len=64", "data.batch_size=4"]  # fmt: skip
TINY = ["model=gpt", "data=text", "model.n_layer=2", "model.n_embd=64", "model.n_head=4", "data.seq_len=64",
        "data.batch_size=4"]  # fmt: skip
PARITY = ["experiment=smoke", "model.n_layer=2", "model.n_embd=128", "model.n_head=4", "data.seq_len=128",
          "data.batch_size=8", "steps=10", "parallel=none", "precision=fp32", "precision.tf32=false"]  # fmt: skip


@dataclass
class Context:
    runs: Path  # the run folders (archived into OUT/runs.tar.gz)
    stand_in: bool
    deadline: float
    no_compile: str | None  # why compile=true cannot run here (no C compiler or Python.h)
    ceiling_tflops: float | None = None  # the probe's matmul rate
    compiled_tokens_per_s: float | None = None  # the headline Llama's, for eager vs compile

    @property
    def device(self) -> list[str]:
        return ["device=cpu", "backend=gloo"] if self.stand_in else ["device=cuda", "backend=nccl"]

    def shape(self, gpu: list[str], cpu: list[str]) -> list[str]:
        return [*(cpu if self.stand_in else gpu), *self.device]

    def compile(self) -> list[str]:
        return [] if self.no_compile else ["compile=true"]


@dataclass(frozen=True)
class Row:
    run: Callable[[Context, float], tuple[str, str, dict]]
    timeout_s: float  # its own limit; the time left of the budget may cut it shorter
    least_s: float = 20  # not started with less than this left


def machine() -> str:
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (CPU stand-ins)"
    return f"{gpu}, Python {platform.python_version()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}"


def train(ctx: Context, name: str, overrides: list[str], timeout: float) -> dict:
    """One train.py job in its own folder; its summary (status failed, with the error's last line)."""
    out = ctx.runs / name
    cmd = [sys.executable, str(ROOT / "train.py"), "logger=none", "progress=false", f"hydra.run.dir={out}",
           "launch.nproc_per_node=1", *overrides]  # fmt: skip
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        log, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as err:
        log, code = f"{err.stdout or ''}{err.stderr or ''}\ntimed out after {timeout:.0f} s", -1
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.log").write_text(log if isinstance(log, str) else str(log))
    path = out / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {"status": "failed"}
    if code != 0:
        lines = [x for x in str(log).strip().splitlines() if x.strip()]
        summary = {**summary, "status": "failed", "oom": "out of memory" in str(log).lower(),
                   "error": lines[-1][:240] if lines else f"exit {code}"}  # fmt: skip
    summary["wall_s"] = time.time() - t0
    metrics = out / "metrics.jsonl"
    summary["_metrics"] = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    return summary


def rate(s: dict) -> str:
    tput = s.get("throughput") or {}
    return (
        f"{tput['tokens_per_s']:,.0f} tokens/s"
        if tput.get("tokens_per_s")
        else f"{tput.get('samples_per_s', 0):,.1f} samples/s"
    )


def outcome(s: dict, *more: str) -> tuple[str, str, dict]:
    """A job's row: its rate, losses and `more`, or its error."""
    keep = {k: s.get(k) for k in ("throughput", "mfu", "hfu", "mfu_flag", "peak_tflops_per_device", "step_time_s",
                                   "compile_s", "memory", "plan", "final_loss", "first_loss")}  # fmt: skip
    if s.get("status") != "ok":
        return "failed", s.get("error", "no summary"), keep
    losses = f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}"
    return "ok", "; ".join([rate(s), losses, *[m for m in more if m]]), keep


def planner_beside(s: dict) -> str:
    plan = s.get("plan") or {}
    error = plan.get("error") if isinstance(plan.get("error"), dict) else {}
    parts = [f"planner's {label} {error[k]:+.0%}" for k, label in (("step_time_s", "step time"), ("peak_bytes", "peak"))
             if error.get(k) is not None]  # fmt: skip
    return ", ".join(parts)


# --------------------------------------------------------------------------- the probe


def probe(ctx: Context, timeout: float) -> tuple[str, str, dict]:
    """The measured ceilings: a large matmul and a device copy (CUDA events; the CPU's clock)."""
    import torch

    data = {"machine": machine(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "nvidia_smi": nvidia_smi()}  # fmt: skip
    for name in ("hydra", "omegaconf", "transformers"):
        try:
            data[name] = __import__(name).__version__
        except ImportError:
            data[name] = None
    device = "cpu" if ctx.stand_in else "cuda"
    n, dtype = (1024, torch.float32) if ctx.stand_in else (8192, torch.bfloat16)
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    seconds = timed(lambda: a @ b, device, reps=3 if ctx.stand_in else 10)
    data["matmul_tflops"] = 2 * n**3 / seconds / 1e12
    nbytes = 2**26 if ctx.stand_in else 2**32
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    data["copy_gb_per_s"] = 2 * nbytes / timed(lambda: dst.copy_(src), device, reps=5) / 1e9  # read + written
    ctx.ceiling_tflops = data["matmul_tflops"]
    what = f"{n}^3 {str(dtype).removeprefix('torch.')} matmul {data['matmul_tflops']:,.2f} TFLOP/s"
    return "ok", f"{what}; copy {data['copy_gb_per_s']:,.0f} GB/s; {data['machine']}", data


def timed(fn: Callable, device: str, reps: int) -> float:
    """Seconds per call after warm-up: CUDA events on a GPU, the host clock on a CPU."""
    import torch

    for _ in range(2):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def nvidia_smi() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    query = "--query-gpu=name,driver_version,memory.total,clocks.max.sm"
    proc = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    return proc.stdout.strip() or proc.stderr.strip()


# --------------------------------------------------------------------------- training rows


def headline_job(ctx: Context, model: str) -> list[str]:
    """The headline's train.py overrides (the float8 rows run the Llama's again, its linears in float8)."""
    gpu, cpu = (LLAMA_1B, TINY_LLAMA) if model == "llama" else (GPT_1B, TINY)
    ceiling = [f"metrics.ceiling_tflops={ctx.ceiling_tflops:.6g}"] if ctx.ceiling_tflops else []
    return [*ctx.shape(gpu, cpu), "parallel=none", "precision=bf16", *ctx.compile(), "metrics.sample_every=0",
            f"steps={8 if ctx.stand_in else 20}", "metrics.log_every=5", *ceiling]  # fmt: skip


def headline(model: str) -> Callable[[Context, float], tuple[str, str, dict]]:
    def run(ctx: Context, timeout: float) -> tuple[str, str, dict]:
        s = train(ctx, f"headline_{model}", headline_job(ctx, model), timeout)
        if model == "llama" and s.get("status") == "ok":
            ctx.compiled_tokens_per_s = (s.get("throughput") or {}).get("tokens_per_s")
        return outcome(s, mfu_text(s, ctx.ceiling_tflops), planner_beside(s),
                       f"compile {s['compile_s']:.0f} s" if s.get("compile_s") else "")  # fmt: skip

    return run


def mfu_text(s: dict, ceiling: float | None) -> str:
    if s.get("mfu_flag"):
        return f"MFU withheld: {s['mfu_flag']}"
    mfu, peak = s.get("mfu"), s.get("peak_tflops_per_device")
    if mfu is None or not peak:
        return "no MFU (no peak known)"
    text = f"MFU {mfu:.1%} of the peak {peak:,.4g} TFLOP/s"
    return text + (f", {mfu * peak / ceiling:.1%} of the measured ceiling" if ceiling else "")


def eager(ctx: Context, timeout: float) -> tuple[str, str, dict]:
    s = train(ctx, "eager_llama", [*ctx.shape(LLAMA_1B, TINY_LLAMA), "parallel=none", "precision=bf16",
                                   "metrics.sample_every=0", f"steps={6 if ctx.stand_in else 12}"], timeout)  # fmt: skip
    eager_rate = (s.get("throughput") or {}).get("tokens_per_s")
    ratio = (f"compiled/eager {ctx.compiled_tokens_per_s / eager_rate:.2f}x"
             if eager_rate and ctx.compiled_tokens_per_s and not ctx.no_compile else "no compiled run to compare")  # fmt: skip
    return outcome(s, ratio)


def precision(name: str) -> Callable[[Context, float], tuple[str, str, dict]]:
    choice = {"fp32+tf32": ["precision=fp32", "precision.tf32=true"], "bf16": ["precision=bf16"],
              "amp fp16": ["precision=amp"]}[name]  # fmt: skip

    def run(ctx: Context, timeout: float) -> tuple[str, str, dict]:
        s = train(ctx, f"precision_{name.replace(' ', '_').replace('+', '_')}",
                  [*ctx.shape(SMALL, TINY), "parallel=ddp", *choice, "steps=12", "metrics.sample_every=0"], timeout)  # fmt: skip
        scales = [m["loss_scale"] for m in s["_metrics"] if m.get("loss_scale")]
        scale = f"loss scale {scales[0]:.0f} -> {scales[-1]:.0f}" if scales else ""
        return outcome(s, scale if name == "amp fp16" else "", mfu_text(s, ctx.ceiling_tflops))

    return run


def offload(ctx: Context, timeout: float) -> tuple[str, str, dict]:
    """FSDP with CPU offload: the model state lives in host memory (its stand-in: FSDP alone, offload needs CUDA)."""
    memory = [] if ctx.stand_in else ["memory=offload"]
    s = train(ctx, "fsdp_offload", [*ctx.shape(SMALL, TINY), "parallel=fsdp", *memory, "steps=6",
                                    "metrics.sample_every=1"], timeout)  # fmt: skip
    mem = s.get("memory") or {}
    state = sum(mem.get(k) or 0 for k in ("param_bytes", "grad_bytes", "optim_bytes"))
    where = (f"model state {state / MB:,.1f} MB, {(mem.get('offloaded_bytes') or 0) / MB:,.1f} MB of it in host memory; "
             f"device peak {(mem.get('device_peak_bytes') or 0) / MB:,.0f} MB")  # fmt: skip
    return outcome(s, where, "stand-in: FSDP without offload (offload needs CUDA)" if ctx.stand_in else "")


def memory_breakdown(ctx: Context, timeout: float) -> tuple[str, str, dict]:
    s = train(ctx, "memory", [*ctx.shape(SMALL, TINY), "parallel=none", "steps=6", "metrics.sample_every=1"], timeout)
    mem, predicted = s.get("memory") or {}, ((s.get("plan") or {}).get("predicted") or {})
    peak = mem.get("device_peak_bytes") or mem.get("rss_peak_bytes") or 0
    held = sum(mem.get(k) or 0 for k in ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes"))
    planned = predicted.get("peak_bytes") or 0
    text = (f"peak {peak / MB:,.0f} MB ({'allocator' if mem.get('device_peak_bytes') else 'RSS'}): accounted "
            f"{held / MB:,.1f} MB, planner {planned / MB:,.1f} MB") if peak else "no peak recorded"  # fmt: skip
    return outcome(s, text, planner_beside(s))


def parity(ctx: Context, timeout: float) -> tuple[str, str, dict]:
    """CUDA fp32 without TF32 against the CPU run of the same config: per-step losses within 1e-3."""
    devices = ("cpu", "cpu") if ctx.stand_in else ("cuda", "cpu")
    runs = [train(ctx, f"parity_{i}_{d}", [*PARITY, f"device={d}"], timeout / 2) for i, d in enumerate(devices)]
    if bad := [r for r in runs if r.get("status") != "ok"]:
        return "failed", "; ".join(r.get("error", "failed") for r in bad), {}
    losses = [[m["loss"] for m in r["_metrics"]] for r in runs]
    gap = max(abs(a - b) for a, b in zip(*losses, strict=True))
    what = f"{devices[0]} vs {devices[1]}: {len(losses[0])} steps, max loss gap {gap:.2e} (allowed 1e-3)"
    return ("ok" if gap <= 1e-3 else "failed"), what, {"gap": gap}


def gpu_tests(ctx: Context, timeout: float) -> tuple[str, str, dict]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "tests/test_gpu.py"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    last = (proc.stdout.strip().splitlines() or ["no output"])[-1].strip("= ")
    return ("ok" if proc.returncode in (0, 5) else "failed"), f"pytest -m gpu: {last}", {"exit": proc.returncode}


CP = ["model=gpt", "data=text", "model.n_layer=8", "model.n_embd=512", "model.n_head=8", "data.seq_len=4096",
      "data.batch_size=4", "steps=10", "parallel=cp", "precision=bf16", "launch.nproc_per_node=2"]  # fmt: skip
HANG = ["experiment=smoke", "steps=20", "parallel=ddp", "launch.nproc_per_node=2", "backend.step_timeout_s=20"]


def two_gpus(ctx: Context) -> str | None:
    """Why a two-GPU row does not run here (None: it runs)."""
    import torch

    visible = 0 if ctx.stand_in else torch.cuda.device_count()
    return None if visible >= 2 else f"needs 2 GPUs, {visible} visible"


def cp_row(ctx: Context, timeout: float) -> tuple[str, str, dict]:
    """Our ring attention against torch's context_parallel, same config: per-step losses and tokens/s."""
    if why := two_gpus(ctx):
        return "skipped", why, {}
    runs = {
        i: train(ctx, f"cp_{i}", [*CP, *ctx.device, f"parallel.cp_impl={i}"], timeout / 2) for i in ("ring", "torch")
    }
    if bad := [f"{i}: {s.get('error')}" for i, s in runs.items() if s.get("status") != "ok"]:
        return "failed", "; ".join(bad), {}
    losses = {i: [m["loss"] for m in s["_metrics"]] for i, s in runs.items()}
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["ring"], losses["torch"], strict=True))
    speed = ", ".join(f"{i} {rate(s)}" for i, s in runs.items())
    return ("ok" if diff <= 1e-3 else "failed"), f"{speed}; losses within {diff:.1e} (<= 1e-3)", {"diff": diff}


def hang_row(ctx: Context, timeout: float) -> tuple[str, str, dict]:
    """Rank 1 stops before step 4 under NCCL: the watchdogs dump their flight recorders and the
    launcher names the collective and rank 1 as missing (framework.run.resilience.read_dumps)."""
    if why := two_gpus(ctx):
        return "skipped", why, {}
    out = ctx.runs / "hang"
    cmd = [sys.executable, str(ROOT / "train.py"), "logger=none", "progress=false", f"hydra.run.dir={out}", *HANG,
           *ctx.device]  # fmt: skip
    env = {**os.environ, "HYDRADIST_FAULT": "1:3:hang"}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return "failed", f"still running after {timeout:.0f} s: the hang was not ended", {}
    line = next((x for x in proc.stderr.splitlines() if "flight recorder:" in x), "")
    ok = proc.returncode != 0 and "ranks that never joined it: [1]" in line
    shown = line or (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return ("ok" if ok else "failed"), shown.removeprefix("error: ")[:240], {}


ROWS: dict[str, Row] = {
    "probe": Row(probe, 60),
    "headline llama 1B": Row(headline("llama"), 150, least_s=60),
    "headline gpt 1B": Row(headline("gpt"), 150, least_s=60),
    "eager vs compile": Row(eager, 90),
    "precision fp32+tf32": Row(precision("fp32+tf32"), 60),
    "precision bf16": Row(precision("bf16"), 60),
    "precision amp fp16": Row(precision("amp fp16"), 60),
    "fsdp cpu offload": Row(offload, 60),
    "memory breakdown": Row(memory_breakdown, 60),
    "parity": Row(parity, 90),
    "pytest -m gpu": Row(gpu_tests, 120),
    "nccl hang (2 GPUs)": Row(hang_row, 120, least_s=0),
    "cp ring vs torch (2 GPUs)": Row(cp_row, 120, least_s=0),
}
