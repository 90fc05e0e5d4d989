"""The planner against published H100 rows: torchtitan's Llama 3.1 tables on H100s at a 500 W
power limit (8B with FSDP on 8 and 128 GPUs, eager and compiled; 405B with FSDP x TP on 128 GPUs)
and the Llama 3 paper's 405B rows on 8,192 and 16,384 H100s (TP 8 x PP 16, and the 128K-context
row with CP 16), each planned with the GPU time model (`plan.gpu=H100 plan.gpu_power_w=<W>`) as
`python -m framework.plan ... plan.search=false` forecasts one layout. No worker starts.

    python benchmarks/plan_h100.py
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

from common import table, write_result

from framework.config import compose
from framework.config.model import model_dims_of
from framework.plan import predict
from framework.plan.activations import block_activation_bytes, in_flight, micro_batch
from framework.plan.gpu import SPECS
from framework.plan.model import layout_of, stage_rank
from framework.plan.predict import shapes_of
from framework.plan.profile import machine_profile
from framework.plan.timing import SPLIT

LLAMA = ["model=llama", "model.vocab_size=128256", "model.max_seq_len=131072", "precision=bf16", "device=cpu",
         "plan.gpu=H100", "plan.memory_budget_mb=98304"]  # fmt: skip
L8B = [*LLAMA, "model.flavor=8b"]
L405B = [*LLAMA, "model.flavor=70b", "model.dim=16384", "model.n_layers=126", "model.n_heads=128",
         "model.n_kv_heads=8", "model.ffn_hidden=53248"]  # fmt: skip
TITAN = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_405 = "torchtitan docs/performance.md (2024-12-03), Llama 3.1 405B table"
LLAMA3 = "Llama 3 paper (arXiv:2407.21783) Table 4, via glennklockwood.com/garden/llama-3.1 (SC'24 slide)"
# torchtitan's selective "op" checkpointing: in every block, the outputs of SDPA and of every
# other matmul kept (its _save_list and mm count), the rest recomputed: memory=selective's own
# policy at memory.matmul_every=2
SELECTIVE = ["memory=selective", "memory.save_ops=[matmul,attention]", "memory.matmul_every=2"]


def _fsdp_8b(nodes: int, compiled: bool) -> list[str]:
    return [*L8B, *SELECTIVE, "parallel=fsdp", "data.seq_len=8192", "data.batch_size=2", f"plan.nodes={nodes}",
            f"compile={str(compiled).lower()}"]  # fmt: skip


def _llama3(world: int, dp: int, cp: int, seq: int, per_dp: int) -> list[str]:
    """The paper's layout: TP 8 within a node, PP 16 interleaved (4 stages a rank, assumed: the
    paper gives no count), FSDP over dp without resharding, micro-batch 1, no checkpointing."""
    return [*L405B, "parallel=hybrid", "parallel.tp=8", "parallel.pp=16", f"parallel.dp_shard={dp}",
            f"parallel.cp={cp}", "parallel.schedule=Interleaved1F1B", "parallel.stages_per_rank=4",
            f"parallel.n_microbatches={per_dp}", "parallel.sequence_parallel=true", "memory=none",
            f"data.seq_len={seq}", f"data.batch_size={per_dp}", f"plan.nodes={world // 8}"]  # fmt: skip


# (name, source, overrides, GPUs, power limit W, published tokens/s per GPU, published GiB, published as)
ROWS = [
    ("8B FSDP 8 (eager) [fit]", f"{TITAN} Table 1", _fsdp_8b(1, False), 8, 500, 5762, 82.4, "5,762 TPS/GPU"),
    ("8B FSDP 8 + compile", f"{TITAN} Table 1", _fsdp_8b(1, True), 8, 500, 6667, 77.0, "6,667 TPS/GPU"),
    ("8B FSDP 128 (eager)", f"{TITAN} Table 3", _fsdp_8b(16, False), 128, 500, 5605, 67.0, "5,605 TPS/GPU"),
    ("8B FSDP 128 + compile", f"{TITAN} Table 3", _fsdp_8b(16, True), 128, 500, 6514, 62.0, "6,514 TPS/GPU"),
    (
        "405B FSDP 16 x TP 8, full AC",
        TITAN_405,
        [
            *L405B,
            "parallel=hybrid",
            "parallel.tp=8",
            "parallel.pp=1",
            "parallel.dp_shard=16",
            "parallel.reshard_after_forward=true",  # torchtitan's default without a pipeline
            "parallel.loss_parallel=true",  # torchtitan's default under TP
            "memory=checkpoint",
            "memory.checkpoint_every=1",
            "parallel.sequence_parallel=true",
            "data.seq_len=8192",
            "data.batch_size=2",
            "plan.nodes=16",
        ],
        128,
        500,
        109,
        None,
        "109 WPS (29.0% MFU)",
    ),
    ("405B TP8 PP16 DP64, 8K", LLAMA3, _llama3(8192, 64, 1, 8192, 32), 8192, 700, None, None, "430 TFLOP/s/GPU"),
    ("405B TP8 PP16 DP128, 8K", LLAMA3, _llama3(16384, 128, 1, 8192, 16), 16384, 700, None, None, "400 TFLOP/s/GPU"),
    (
        "405B TP8 CP16 PP16 DP8, 128K",
        LLAMA3,
        _llama3(16384, 8, 16, 131072, 16),
        16384,
        700,
        None,
        None,
        "380 TFLOP/s/GPU",
    ),
]
PUBLISHED_TFLOPS = {"405B TP8 PP16 DP64, 8K": 430.0, "405B TP8 PP16 DP128, 8K": 400.0,
                    "405B TP8 CP16 PP16 DP8, 128K": 380.0}  # fmt: skip


def forecast(overrides: list[str], world: int, watts: float) -> tuple[dict, float]:
    """(the prediction, tokens per second per GPU) of one row's layout at `watts`."""
    cfg = compose([*overrides, f"plan.gpu_power_w={watts}"])
    p = predict(cfg, world, machine_profile(cfg, world, "config"))
    layout_dp = world // (cfg.parallel.get("tp", 1) * cfg.parallel.get("pp", 1) * cfg.parallel.get("cp", 1))
    tokens = cfg.data.batch_size * cfg.accumulation_steps * cfg.data.seq_len * layout_dp
    return p, tokens / p["step_time_s"] / world


def plan_rows() -> list[dict]:
    """One dict per published row: the forecast beside the published figure, and the split."""
    out = []
    for name, source, overrides, world, watts, tps, gib, published in ROWS:
        p, forecast_tps = forecast(overrides, world, watts)
        count = p["model_flops_per_token"]
        if tps is None:  # published as TFLOP/s per GPU: tokens at the planner's count of a token's FLOPs
            tps = PUBLISHED_TFLOPS[name] * 1e12 / count
        peak, reserved = p["peak_bytes"] / 2**30, p["reserved_bytes"] / 2**30
        out.append({"name": name, "source": source, "gpus": world, "watts": watts, "published": published,
                    "published_tps": tps, "forecast_tps": forecast_tps, "ratio": forecast_tps / tps,
                    "published_gib": gib, "forecast_gib": peak, "reserved_gib": reserved,
                    "activation_gib": p["memory"]["activation_bytes"] / 2**30,
                    "peak_ratio": reserved / gib if gib else None,
                    "tflops": forecast_tps * count / 1e12, "split": p["split"], "step": p["step_time_s"]})  # fmt: skip
    return out


H100_BYTES = SPECS["H100"].memory_gb * 1e9  # what a layout must fit in (the search's budget too)
FULL_AC = ["memory=checkpoint", "memory.checkpoint_every=1"]


def held_blocks(overrides: list[str], world: int) -> tuple[float, int]:
    """(bytes one block saves for one micro-batch, block x micro-batches held on the busiest rank)."""
    cfg = compose(overrides)
    layout = layout_of(cfg.parallel, world, *model_dims_of(cfg))
    shapes = shapes_of(cfg, layout)
    g = SimpleNamespace(**shapes.gpt)
    block = block_activation_bytes(micro_batch(cfg, layout), g, cfg, layout, cfg.memory.name != "none")
    held: dict[int, int] = defaultdict(int)
    for stage, layers in enumerate(shapes.stage_layers):
        held[stage_rank(stage, layout)] += len(layers) * in_flight(stage, layout)
    return block, max(held.values())


def fit_rows(rows: list[dict]) -> list[dict]:
    """The 405B rows' peak taken apart, whether it fits an H100, and the same layout under
    full activation checkpointing (what this framework needs where the published layout does not fit)."""
    out = []
    for r, (name, _, overrides, world, watts, *_) in zip(rows, ROWS, strict=True):
        if "405B" not in name:
            continue
        block, held = held_blocks(overrides, world)
        full_ac = [o for o in overrides if not o.startswith("memory")] + FULL_AC
        p, tps = forecast(full_ac, world, watts)
        out.append({"name": name, "memory": next(o for o in overrides if o.startswith("memory=")),
                    "reserved_gib": r["reserved_gib"], "activation_gib": r["activation_gib"],
                    "block_gib": block / 2**30, "held": held, "fits": r["reserved_gib"] * 2**30 <= H100_BYTES,
                    "full_ac_gib": p["reserved_bytes"] / 2**30, "full_ac_ratio": tps / r["published_tps"]})  # fmt: skip
    return out


def main() -> None:
    rows = plan_rows()
    text = table(
        ["row", "GPUs", "power limit W", "published", "published tokens/s/GPU", "forecast tokens/s/GPU", "forecast / published",
         "published GiB", "forecast allocated GiB", "forecast reserved GiB", "peak ratio", "forecast TFLOP/s/GPU", "step s",
         *(f"{k} s" for k in SPLIT), "source"],
        [[r["name"], r["gpus"], r["watts"], r["published"], r["published_tps"], r["forecast_tps"], f"{r['ratio']:.3f}",
          r["published_gib"], r["forecast_gib"], r["reserved_gib"], f"{r['peak_ratio']:.3f}" if r["peak_ratio"] else "not published",
          r["tflops"], r["step"], *(r["split"][k] for k in SPLIT), r["source"]] for r in rows],
    )  # fmt: skip
    fits = table(
        ["405B row", "memory lever", "forecast reserved GiB", "saved activations GiB", "a block's saved GiB a micro-batch",
         "blocks x micro-batches held (busiest rank)", "fits an H100 (80 GB)", "full AC: reserved GiB", "full AC: forecast / published"],
        [[f["name"], f["memory"], f["reserved_gib"], f["activation_gib"], f["block_gib"], f["held"],
          "yes" if f["fits"] else "no", f["full_ac_gib"], f"{f['full_ac_ratio']:.3f}"] for f in fit_rows(rows)],
    )  # fmt: skip
    print(text + "\n\n" + fits)
    write_result("plan_h100", "python benchmarks/plan_h100.py", HEADER, text + "\n\n" + FITS + fits + NOTES)


FITS = """**Does each 405B layout fit an H100?** The peak taken apart (`peak_parts`): the saved
activations are almost all of it where the rows do not fit. The busiest rank holds blocks x
micro-batches of them: every block's one micro-batch without a pipeline; under the interleaved
schedule the first pipeline rank's warm-up forwards over its four stages of two blocks (79 stages
in flight at 32 micro-batches, every one of 64 at 16), as torch's and Megatron's schedules run it.
The last two columns plan the same layout with every block checkpointed (`memory=checkpoint
memory.checkpoint_every=1`).

"""

HEADER = (
    "Published H100 rows against the planner's forecast of the same layout (`plan.gpu=H100`, "
    "`plan.gpu_power_w` = the row's power limit; framework/plan/gpu.py: the H100 SXM's measured matmul rate, "
    "FlashAttention-2 at 35% of the peak on Hopper over a causal mask's half of the scores, HBM at 88%, NVLink "
    "and the network at NCCL's share of line rate). One constant is fitted: the power exponent (matmul and "
    "attention rates x (limit / TDP)^1.22), on the row marked [fit] alone; every other row checks it. "
    "Throughput is tokens per second per GPU; a row published as TFLOP/s per GPU is converted with the "
    "planner's count of a token's FLOPs, 6 x parameters + 12 x layers x width x sequence (attention unmasked), "
    "the count torchtitan's MFU uses (its 405B row: 109 WPS x 2.63 TFLOP = 29.0% of 989, as published). "
    "Split: the step's seconds by term (they sum to the step): compute (matmuls, attention), memory-bound "
    "(norms, activations, casts, the optimizer at HBM's rate), the pipeline's bubble, and the communication "
    "the compute does not hide."
)

NOTES = """

**Sources.** torchtitan's `benchmarks/llama3_h100_202412_torchtitan.md` (pytorch/torchtitan, Tables 1
and 3: Llama 3.1 8B, FSDP, local batch 2, sequence 8,192, selective activation checkpointing, on
Grand Teton hosts of 8 H100s with 96 GB HBM2e at 2.4 TB/s, 400 Gb/s per GPU, "the default 500W
power limit"); its `docs/performance.md` of 2024-12-03 (Llama 3.1 405B on 128 H100s, FSDP 16 x TP 8,
local batch 2, full checkpointing, 109 WPS, 29.0% MFU; its power limit is not stated there: planned
at the same hosts' 500 W); the Llama 3 paper's Table 4 (405B, sequence 8,192 at 8,192 and 16,384
GPUs: TP 8, PP 16, DP 64 and 128, 430 and 400 TFLOP/s per GPU; sequence 131,072 at 16,384 GPUs:
TP 8, CP 16, PP 16, DP 8, 380 TFLOP/s per GPU; 16M tokens a batch; H100 SXM at 700 W), read through
a transcription of the SC'24 slide that shows it (glennklockwood.com/garden/llama-3.1), not re-checked
against the PDF here.

**Left out, and why.** torchtitan's Tables 2, 4, 5 and 6 (context parallel to 262,144 tokens, 70B
and 405B at 256-512 GPUs) all run Float8 linears: the planner prices no FP8 matmul, so they are not
forecast. NVIDIA's Megatron-Core / NeMo H100 tables and MLPerf Training's H100 results were not
found in this project's search tools with their layouts, so no row of theirs is shown (no figure
here is from memory).

**Assumptions, stated.** torchtitan's selective "op" checkpointing (its `_save_list` and mm count at
commit 9dec370, the one its tables name) is planned as this framework's own `memory=selective
memory.matmul_every=2`: in every block the outputs of SDPA and of every other matmul in the block's
order are kept (a Llama block: wq, wv, w1, w2; wk, wo and w3 run again in backward), the rest
recomputed; on the CPU the framework's meter measures what it keeps within 0.04% of the forecast
(tests/test_memory_levers.py). The compiled rows are priced as the eager ones for time (the
planner does not model the compiler's fusion: they read 11-14% slow); for memory, the compiler's
partitioner saves only the kept outputs that backward reads, so w2's (taken by the residual add
alone; wo's likewise, where kept) is not held: 4.0 GiB less, against the 5.4 and 5.0 GiB the
tables show. torchtitan's 405B row: FSDP resharding after forward and loss parallel under TP, torchtitan's defaults
without a pipeline (planned at first without either, it read 175 GiB: every block's parameters held
gathered, 94.5 GiB, and the whole fp32 logits). The
Llama 3 rows: FSDP without resharding over DP, micro-batch 1 (32 or 16 micro-batches per pipeline),
interleaved 1F1B at 4 stages per rank (the paper gives no count), no activation checkpointing. The
torchtitan hosts' HBM2e (2.4 TB/s) is priced as the SXM part's 3.35 TB/s: the fitted power exponent
absorbs that difference for these rows.

**Peak memory.** torchtitan's GiB is `reserved_bytes.all.peak` of CUDA's caching allocator (its
`train.py` logs `max_reserved_gib`): more than the allocated peak by the cached blocks that nothing
live at the peak can use. The forecast reserved peak adds two: FSDP's all-gather output of its
largest unit (the embeddings, norm and head, 2.0 GiB in bf16: allocated on FSDP's copy-in stream
and cached in that stream's pool, which the default stream's tensors cannot take) and the forward's
bf16 logits (3.9 GiB: freed by the peak at the start of backward, where the loss's tensors are all
fp32 and twice its size). The allocated peak is at the loss's backward: the float32 state over the
shards (12 bytes a parameter; the gradients are set to None at zero_grad), the root and one block
gathered, every block's kept outputs, and three fp32 copies of the logits (log-softmax's saved
output, and in backward the gradient nll_loss hands it beside the gradient it returns: eager
cross-entropy holds two gradient copies at once, torchtitan's loss as this framework's). These two
cached blocks are read from torch's code, not measured on an H100 here; without them the forecast
(the allocated column) reads 0.88-0.92x. The 405B rows publish no memory.

**Why the Llama 3 rows do not fit as planned.** The paper trained these layouts on 80 GB H100s
without activation checkpointing at 8K ("with these optimizations, we could pretrain Llama 3 on
8K tokens without activation checkpointing"); the forecast, 186-225 GiB, says this framework
could not. The planner's accounting is not the cause: the parameters, gradients and optimizer state
are sharded over tp x pp x dp (0.3-0.6 GiB), the gathered stage parameters are 5.9 GiB, and the
in-flight count is the interleaved schedule's (above). The saved activations are the cause: a block
of this framework's Llama (models/llama.py, measured on the CPU within 5% of the forecast,
tests/test_context.py and tests/test_memory_levers.py) saves 10 x width bytes a token on a rank at
TP 8 with sequence parallel, 1.25 GiB a micro-batch of 8,192 tokens: the two norms' 16-bit
outputs whole (the all-gather's output each linear saves: 4.0 x width, 40%), the SwiGLU MLP's
four ffn-wide tensors (3.25 x width), the norms' fp32 inputs and normalised values (1.5 x
width), attention's rotated q, repeated k and v, output and its copy (1.25 x width). At the
least a pipeline holds (one micro-batch of every block on the first rank, 126 block x
micro-batches) that is 158 GiB, twice an H100's memory. To fit 80 GB without recomputation a
block could save at most 4.3 x width bytes a token a rank (80 GB less the gathered stage and the
state, over 126 x 8,192 tokens), about what Megatron's accounting of a sequence-parallel block
gives (34 x sequence x width / TP, 4.25 x width at TP 8: inputs saved sharded and gathered again
in backward, 16-bit norms, k and v not repeated); the paper's implementation is not public, and
this framework's Llama saves 2.3 times that. With every block checkpointed these layouts fit
(25 GiB), at 0.71-0.84x the published throughput (the recomputed forward). One overcount is left
in these rows' forecast: the loss's fp32 transients at the start of backward (7.8 GiB) and the
16-bit logits' cached block (2.0 GiB) are added to the busiest rank's peak, the first pipeline
rank, which holds no head (framework/plan/peak.py takes the activations' maximum over ranks and
adds the head's on top); it does not change whether they fit.
"""
if __name__ == "__main__":
    main()
