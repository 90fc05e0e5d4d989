"""Mixture of experts: balancing and cost, side by side in one run (docs/results/moe.md).

    python benchmarks/moe.py

(a) Load balancing over 50 steps of the smoke data (a small Llama with 4 experts, top-2, dropless):
    the expert load imbalance (the most loaded expert's tokens over the mean, averaged over the
    blocks) at steps 1, 10, 25 and 50 with no balancing, the auxiliary loss (Switch/Mixtral) and
    DeepSeek-V3's loss-free bias balancing.
(b) MoE against dense at equal active parameters (4 experts of hidden H, top-2, against a dense
    MLP of hidden 2H; the router's small matrix aside): tokens/s and MFU on this machine, one
    process and ddp x2. The experts run one after another over their tokens (the plain reference
    layer: grouped-GEMM kernels are a GPU's).
(c) Expert parallel at 2 ranks: fsdp with every rank holding all 4 experts against parallel.ep=2
    (2 experts a rank, tokens exchanged by all-to-all), and tensor parallel (each rank runs the
    routed layers whole): tokens/s, the all-to-all calls and bytes a step (the mean rank's,
    summary.moe, beside the planner's forecast), the all-to-all share of step time, from a
    torch.profiler trace of 2 steady steps per rank (the time inside all_to_all_single, waits
    included, over the steps'), and the planner's step time beside the measured median.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from common import config, recorded, run, table

from framework.run.sweep import run_configs

SMALL = ["model=llama", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "data=text", "data.seq_len=64", "data.max_bytes=400000", "data.batch_size=8", "metrics.sample_every=0",
         "optim.lr=3e-3"]  # fmt: skip
MOE = ["model.moe.experts=4", "model.moe.top_k=2", "model.ffn_hidden=64"]


def balance_table() -> None:
    rows = {
        "none": [*MOE, "model.moe.balance=none"],
        "aux_loss (coef 0.01)": [*MOE, "model.moe.balance=aux_loss"],
        "bias (rate 1e-3)": [*MOE, "model.moe.balance=bias"],
        "bias (rate 1e-2)": [*MOE, "model.moe.balance=bias", "model.moe.bias_rate=0.01"],
    }
    configs = {name: config([*SMALL, "steps=50", "parallel=none", *args]) for name, args in rows.items()}
    with tempfile.TemporaryDirectory() as out_dir:
        got = run_configs(configs, 1, out_dir)
        runs = {name: [json.loads(line) for line in (Path(out_dir) / name / "metrics.jsonl").read_text().splitlines()]
                for name in rows}  # fmt: skip
    out = []
    for name, summary in got.items():
        at = {m["step"]: m["moe_load_imbalance"] for m in runs[name]}
        out.append([name, at[1], at[10], at[25], at[50], summary["moe"]["load_imbalance"], summary["final_loss"]])
    print("(a) expert load imbalance (max / mean tokens an expert got, mean over the 2 blocks), 4 experts, top-2\n")
    print(table(["balancing", "step 1", "step 10", "step 25", "step 50", "mean", "final loss"], out))


def cost_table() -> None:
    rows = {"dense (hidden 128)": ["model.ffn_hidden=128"], "moe (4 x 64, top-2)": MOE}
    out = []
    for world in (1, 2):
        got = run(rows, world, [*SMALL, "steps=20", "parallel=none" if world == 1 else "parallel=ddp"])
        base = got["dense (hidden 128)"]["throughput"]["tokens_per_s"]
        for name, s in got.items():
            rate = s["throughput"]["tokens_per_s"]
            out.append([name, world, s["flops_per_token"], rate, rate / base, s["mfu"]])
    print("\n(b) equal active parameters: tokens/s and MFU (FLOPs of the active experts)\n")
    print(table(["model", "ranks", "FLOPs/token", "tokens/s", "vs dense", "MFU"], out))


def a2a_share(trace_dir: Path) -> float:
    """Time in all_to_all_single over the profiled steps' time, averaged over the ranks' traces."""
    shares = []
    for trace in sorted(trace_dir.glob("rank*.trace.json")):
        events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("ph") == "X"]
        steps = sum(e["dur"] for e in events if e["name"].startswith("ProfilerStep"))
        a2a = sum(e["dur"] for e in events if e["name"].startswith("torch/distributed") and
                  e["name"].endswith(": all_to_all_single"))  # fmt: skip
        shares.append(a2a / steps)
    return sum(shares) / len(shares)


def ep_table() -> None:
    rows = {
        "fsdp, 4 experts a rank": ["parallel=fsdp"],
        "fsdp ep=2, 2 experts a rank": ["parallel=fsdp", "parallel.ep=2"],
        "tp=2, 4 experts a rank": ["parallel=tp", "parallel.sequence_parallel=false", "data.batch_size=16"],
    }
    common = [*SMALL, *MOE, "model.moe.balance=bias", "steps=20", "metrics.sample_every=1", "profile=true",
              "profiler.wait=8", "launch.nproc_per_node=2"]  # fmt: skip
    configs = {name: config([*common, *args]) for name, args in rows.items()}
    out = []
    with tempfile.TemporaryDirectory() as out_dir:
        got = run_configs(configs, 2, out_dir)
        base = got["fsdp, 4 experts a rank"]["throughput"]["tokens_per_s"]
        for name, s in got.items():
            calls = s["comm"]["by_op"].get("all_to_all", {}).get("calls", 0)
            rate, plan = s["throughput"]["tokens_per_s"], s["plan"]
            share = a2a_share(Path(out_dir) / name / "profile")
            step_ms = [1000 * plan[k]["step_time_s"] for k in ("predicted", "measured")]
            sent = s.get("comm_by_op", {}).get("all_to_all", {}).get("mean_bytes")
            a2a = [sent or 0, plan["predicted"]["all_to_all_bytes"] or 0]
            out.append([name, rate, rate / base, calls, *a2a, share, *step_ms])
    print("\n(c) expert parallel at 2 ranks (all-to-all per step: the mean rank's; its share of step time)\n")
    heads = ["layout", "tokens/s", "vs all experts", "a2a calls", "a2a bytes", "planned", "a2a share", "planned step ms",
             "measured step ms"]  # fmt: skip
    print(table(heads, out))


if __name__ == "__main__":
    with recorded("moe"):
        balance_table()
        cost_table()
        ep_table()
