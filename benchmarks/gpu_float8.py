"""The float8 rows of benchmarks/gpu.py (converters=[float8], framework/converters/float8.py):
float8 linears against bf16 on the same job, in tokens/s and in the loss after 200 steps.

On a GPU of compute capability 8.9 or more (H100, H200) the float8 matmuls are torch._scaled_mm;
the CPU stand-ins emulate them (float8's numerics, not its speed), and each row says which ran.
torchao is the lent machine's or a carried wheel's (.whl/, `make gpu-wheels`); where neither has
it, each row says so in one line and is skipped: nothing is installed from an index.
"""

from __future__ import annotations

import importlib.util
import time

from gpu_rows import TINY_LLAMA, Context, Row, headline_job, outcome, train

FLOAT8 = ["converters=[float8]"]
SPEED_RECIPE = "tensorwise"  # torchtitan's float8 rows: one scale per tensor, the fastest recipe
LOSS_RECIPE = "rowwise"  # the convergence benchmark's float8 row (docs/results/converging.md)
# the loss row's Llama: small enough that a GPU trains its 200 steps in seconds, eager (float8's
# numerics do not depend on compile; the speed row compiles)
LOSS_LLAMA = ["model=llama", "model.dim=512", "model.n_layers=4", "model.n_heads=8", "model.n_kv_heads=4",
              "model.ffn_hidden=1536", "data=text", "data.seq_len=512", "data.batch_size=16"]  # fmt: skip
LOSS_STEPS, TAIL, WITHIN = 200, 20, 0.02  # the final loss: the mean of the last 20 steps, within 2% of bf16's
STAND_IN_STEPS = 40  # a CPU's emulated float8 takes a GPU's 200 steps' time for these


def torchao_absent() -> str | None:
    """Why the float8 rows cannot run here (None: torchao imports)."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao absent from this python and not carried (.whl/, make gpu-wheels): float8 rows skipped"
    return None


def how(s: dict) -> str:
    """How the float8 run's matmuls ran, from its summary (converters.float8)."""
    f8 = (s.get("converters") or {}).get("float8") or {}
    if not f8:
        return "no float8 summary"
    where = "emulated (float8's numerics, not its speed)" if f8.get("emulated") else "torch._scaled_mm"
    share = f", {f8['flops_share']:.0%} of the FLOPs in float8" if f8.get("flops_share") is not None else ""
    return f"{f8.get('recipe')}, {f8.get('linears')} linears: {where}{share}"


def tokens_per_s(s: dict) -> float | None:
    return (s.get("throughput") or {}).get("tokens_per_s")


def speed(ctx: Context, timeout: float) -> tuple[str, str, dict]:
    """The headline Llama again with its linears in float8: tokens/s against its bf16 run (the
    headline's own, compiled alike, where this call ran it; else a bf16 twin here)."""
    if why := torchao_absent():
        return "skipped", why, {}
    job = headline_job(ctx, "llama")
    if ctx.stand_in:  # the converter refuses compile for emulated float8 on a CPU: both runs eager
        job = [o for o in job if o != "compile=true"]
    t0, whose = time.time(), "the headline's run"
    base = None if ctx.stand_in else ctx.compiled_tokens_per_s  # the stand-in's headline was compiled
    if base is None:
        bf16 = train(ctx, "float8_speed_bf16", job, timeout / 2)
        if bf16.get("status") != "ok":
            return "failed", f"bf16: {bf16.get('error', 'no summary')}", {}
        base, whose = tokens_per_s(bf16), "its twin"
    left = timeout - (time.time() - t0)
    f8 = train(ctx, "float8_speed_float8", [*job, *FLOAT8, f"converters.float8.recipe={SPEED_RECIPE}"], left)
    got = tokens_per_s(f8)
    ratio = f"float8/bf16 {got / base:.2f}x (bf16 {base:,.0f} tokens/s, {whose})" if got and base else ""
    status, figures, data = outcome(f8, ratio, how(f8), "compiled" if "compile=true" in job else "eager")
    return status, figures, {**data, "bf16_tokens_per_s": base, "float8": (f8.get("converters") or {}).get("float8")}


def tail_mean(s: dict) -> float:
    losses = [m["loss"] for m in s["_metrics"]]
    return sum(losses[-TAIL:]) / len(losses[-TAIL:])


def loss(ctx: Context, timeout: float) -> tuple[str, str, dict]:
    """A small Llama for 200 steps in bf16 and with float8 linears, same seed and data: the final
    losses (20-step means) within 2% (the convergence benchmark's float8 bound)."""
    if why := torchao_absent():
        return "skipped", why, {}
    steps = STAND_IN_STEPS if ctx.stand_in else LOSS_STEPS
    job = [*ctx.shape(LOSS_LLAMA, TINY_LLAMA), "parallel=none", "precision=bf16", f"steps={steps}", "seed=0",
           "metrics.log_every=1", "metrics.sample_every=0"]  # fmt: skip
    runs = {"bf16": [], "float8": [*FLOAT8, f"converters.float8.recipe={LOSS_RECIPE}"]}
    got = {name: train(ctx, f"float8_loss_{name}", [*job, *extra], timeout / 2) for name, extra in runs.items()}
    if bad := [f"{n}: {s.get('error', 'no summary')}" for n, s in got.items() if s.get("status") != "ok"]:
        return "failed", "; ".join(bad), {}
    final = {name: tail_mean(s) for name, s in got.items()}
    gap = (final["float8"] - final["bf16"]) / final["bf16"]
    verdict = f"within {WITHIN:.0%}" if abs(gap) <= WITHIN else f"OVER {WITHIN:.0%}"
    figures = (f"after {steps} steps ({TAIL}-step means): float8 {final['float8']:.4f}, bf16 {final['bf16']:.4f}: "
               f"{gap:+.2%} ({verdict}); {how(got['float8'])}; eager")  # fmt: skip
    data = {"steps": steps, "final": final, "gap": gap, "float8": (got["float8"].get("converters") or {}).get("float8")}
    return ("ok" if abs(gap) <= WITHIN else "failed"), figures, data


ROWS: dict[str, Row] = {
    "float8 vs bf16 tokens/s": Row(speed, 150, least_s=60),
    "float8 vs bf16 loss (200 steps)": Row(loss, 120, least_s=30),
}
