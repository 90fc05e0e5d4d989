"""The planner against measurement, on this machine.

1. Accuracy: layouts at world sizes 2 and 4 (gpt 4 x 256, T=64, 8 samples per rank, fp32, bf16
   and checkpointing rows); each run checks its own prediction (summary.json `plan`): the
   relative error of parameter, gradient, optimizer, saved-activation and wire bytes, and calls.
2. The pick: every candidate `python -m framework.plan` ranks at world 2 (the default gpt, an
   ample budget), trained in one sweep; the planner's pick against the fastest measured.

    python benchmarks/plan.py
"""

from __future__ import annotations

from common import recorded, run, table

from framework.config import compose
from framework.plan import choose

MODEL = ["experiment=smoke", "model.n_layer=4", "model.n_embd=256", "model.n_head=4", "data.seq_len=64",
         "data.batch_size=8", "steps=4", "data.max_bytes=2000000"]  # fmt: skip
FIGURES = ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "wire_bytes", "comm_calls")

ACCURACY = {
    2: {
        "ddp": ["parallel=ddp"],
        "ddp bf16 checkpoint": ["parallel=ddp", "precision=bf16", "memory=checkpoint"],
        "fsdp": ["parallel=fsdp"],
        "fsdp(grad_op)": ["parallel=fsdp", "parallel.reshard_after_forward=false"],
        "fsdp bf16": ["parallel=fsdp", "precision=bf16"],
        "fsdp1": ["parallel=fsdp", "parallel.version=1"],
        "tp": ["parallel=tp"],
        "tp no sequence parallel": ["parallel=tp", "parallel.sequence_parallel=false"],
        "pp GPipe": ["parallel=pp", "parallel.schedule=GPipe"],
        "pp 1F1B": ["parallel=pp"],
        "pp Interleaved1F1B": ["parallel=pp", "parallel.schedule=Interleaved1F1B"],
        "pp InterleavedZeroBubble": ["parallel=pp", "parallel.schedule=InterleavedZeroBubble"],
        "pp ZBVZeroBubble": ["parallel=pp", "parallel.schedule=ZBVZeroBubble"],
    },
    4: {
        "ddp": ["parallel=ddp"],
        "fsdp checkpoint": ["parallel=fsdp", "memory=checkpoint"],
        "hsdp 2x2": ["parallel=fsdp", "parallel.dp_replicate=2"],
        "tp": ["parallel=tp"],
        "pp 1F1B": ["parallel=pp"],
        "hybrid dp2 x tp2": ["parallel=hybrid", "parallel.tp=2", "parallel.pp=1"],
        "hybrid dp2 x pp2": ["parallel=hybrid", "parallel.tp=1", "parallel.pp=2"],
        "hybrid pp2 x tp2": ["parallel=hybrid", "parallel.tp=2", "parallel.pp=2"],
    },
}


def accuracy() -> None:
    rows = []
    for world, layouts in ACCURACY.items():
        for name, summary in run(layouts, world, MODEL).items():
            err = summary["plan"]["error"]
            rows.append([world, name, *(f"{err[f]:+.1%}" if err[f] is not None else "-" for f in FIGURES)])
    print(table(["world", "layout", "params", "grads", "optim", "activations", "wire bytes", "calls"], rows))


def pick(world: int = 2) -> None:
    base = ["experiment=smoke", "model.n_layer=4", "model.n_embd=128", "model.n_head=4", "data.seq_len=128",
            "data.batch_size=8", "data.max_bytes=2000000"]  # fmt: skip
    best, ranked, _ = choose(compose(base), world)  # probes this machine's link once (cached)
    rows = {r.prediction["layout"]: [*base, "steps=12", *r.candidate.overrides] for r in ranked if r.fits}
    measured = run(rows, world, [])
    fastest = max(measured.values(), key=lambda s: s["throughput"]["tokens_per_s"])
    out = []
    for i, r in enumerate(ranked, start=1):
        s = measured[r.prediction["layout"]]
        out.append([i, r.prediction["layout"], r.prediction["step_time_s"] * 1000, s["step_time_s"] * 1000,
                    s["throughput"]["tokens_per_s"], s["throughput"]["tokens_per_s"] / fastest["throughput"]["tokens_per_s"]])  # fmt: skip
    print(table(["predicted rank", "layout", "predicted ms/step", "measured ms/step", "tokens/s", "vs fastest"], out))
    ratio = measured[best.prediction["layout"]]["throughput"]["tokens_per_s"] / fastest["throughput"]["tokens_per_s"]
    print(f"planner's pick: {best.prediction['layout']}; its tokens/s over the fastest measured: {ratio:.2f}")


if __name__ == "__main__":
    with recorded("plan"):
        accuracy()
        pick()
