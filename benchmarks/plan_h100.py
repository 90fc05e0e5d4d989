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
# torchtitan's float8 rows (its Tables 1-5 at commit 9dec370): torchao's tensorwise recipe with float8
# all-gather under FSDP2 (its llama3_405b.toml's [float8] keys, the recipe torchtitan had then: dynamic
# tensorwise scaling), every linear but the output head; each run compiled
FLOAT8 = ["converters=[float8]", "converters.float8.recipe=tensorwise", "compile=true"]
FULL_AC_8B = [*L8B, "model.max_seq_len=262144", "memory=checkpoint", "memory.checkpoint_every=1"]


def _cp_8b(cp: int) -> list[str]:
    """Table 2: FSDP 8/cp x CP cp on 8 GPUs, sequence 32,768 x cp, local batch 1, full AC; FSDP
    resharding after forward (torchtitan's default without a pipeline); CP planned as the
    framework's ring attention (torchtitan's: torch's context_parallel, its all-gather rotation)."""
    layout = ["parallel=fsdp"] if cp == 1 else ["parallel=hybrid", "parallel.tp=1", "parallel.pp=1", f"parallel.cp={cp}",
                                                f"parallel.dp_shard={8 // cp}", "parallel.reshard_after_forward=true"]  # fmt: skip
    return [*FULL_AC_8B, *layout, f"data.seq_len={32768 * cp}", "data.batch_size=1", "plan.nodes=1", *FLOAT8]


def _tp_layout(tp: int, pp: int, dp: int, reshard: bool) -> list[str]:
    return ["parallel=hybrid", f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.dp_shard={dp}",
            f"parallel.reshard_after_forward={str(reshard).lower()}", "parallel.loss_parallel=true",
            "parallel.sequence_parallel=true", "memory=checkpoint", "memory.checkpoint_every=1", "data.seq_len=8192"]  # fmt: skip


def _405b_pp(schedule: str, stages: int) -> list[str]:
    """Table 5: FSDP 8 x TP 8 x PP 8 on 512 GPUs, local batch 32 in 8 micro-batches (torchtitan's
    default: the pipeline degree), 2 stages a rank when interleaved (its default split), FSDP
    without resharding under a pipeline (torchtitan's), full AC."""
    return [*L405B, *_tp_layout(8, 8, 8, False), f"parallel.schedule={schedule}", f"parallel.stages_per_rank={stages}",
            "parallel.n_microbatches=8", "data.batch_size=32", "plan.nodes=64", *FLOAT8]  # fmt: skip


L70B = [*LLAMA, "model.flavor=70b"]
FLOAT8_ROWS = [
    ("8B FSDP 8 + compile + float8", f"{TITAN} Table 1", [*_fsdp_8b(1, True), *FLOAT8], 8, 500, 8532, 76.8,
     "8,532 TPS/GPU"),
    ("8B FSDP 128 + compile + float8", f"{TITAN} Table 3", [*_fsdp_8b(16, True), *FLOAT8], 128, 500, 8380, 61.8,
     "8,380 TPS/GPU"),
    *[(f"8B FSDP {8 // cp} x CP {cp}, {32768 * cp:,} tokens, float8", f"{TITAN} Table 2", _cp_8b(cp), 8, 500, tps, gib,
       f"{tps:,} TPS/GPU") for cp, tps, gib in ((1, 3890, 83.9), (2, 2540, 84.2), (4, 1071, 84.0), (8, 548, 84.5))],
    ("70B FSDP 32 x TP 8, float8 (2D)", f"{TITAN} Table 4",
     [*L70B, *_tp_layout(8, 1, 32, True), "data.batch_size=16", "plan.nodes=32", *FLOAT8], 256, 500, 829, 71.9,
     "829 TPS/GPU"),
    ("405B FSDP 8 x TP 8 x PP 8 1F1B, float8", f"{TITAN} Table 5", _405b_pp("1F1B", 1), 512, 500, 100, 82.5,
     "100 TPS/GPU (AsyncTP)"),
    ("405B FSDP 8 x TP 8 x PP 8 interleaved, float8", f"{TITAN} Table 5", _405b_pp("Interleaved1F1B", 2), 512, 500,
     128, 72.7, "128 TPS/GPU (AsyncTP)"),
]  # fmt: skip
BF16_ROWS = list(ROWS)
ROWS += FLOAT8_ROWS
PUBLISHED_TFLOPS = {"405B TP8 PP16 DP64, 8K": 430.0, "405B TP8 PP16 DP128, 8K": 400.0,
                    "405B TP8 CP16 PP16 DP8, 128K": 380.0}  # fmt: skip


def forecast(overrides: list[str], world: int, watts: float) -> tuple[dict, float]:
    """(the prediction, tokens per second per GPU) of one row's layout at `watts`."""
    cfg = compose([*overrides, f"plan.gpu_power_w={watts}"])
    p = predict(cfg, world, machine_profile(cfg, world, "config"))
    layout_dp = world // (cfg.parallel.get("tp", 1) * cfg.parallel.get("pp", 1) * cfg.parallel.get("cp", 1))
    tokens = cfg.data.batch_size * cfg.accumulation_steps * cfg.data.seq_len * layout_dp
    return p, tokens / p["step_time_s"] / world


def plan_rows(rows: list | None = None) -> list[dict]:
    """One dict per published row (of `rows`, default ROWS): the forecast beside the published
    figure, and the split."""
    out = []
    for name, source, overrides, world, watts, tps, gib, published in rows or ROWS:
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
                    "tflops": forecast_tps * count / 1e12, "split": p["split"], "step": p["step_time_s"],
                    # AsyncTP's bound: the same step with its exposed communication hidden behind the matmuls
                    "hidden_tps": forecast_tps * p["step_time_s"] / (p["step_time_s"] - p["split"]["exposed_comm"])})  # fmt: skip
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
    by_name = {row[0]: row for row in ROWS}
    for r in rows:
        name, _, overrides, world, watts, *_ = by_name[r["name"]]
        if "405B" not in name or "float8" in name:
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
         "exposed comm hidden (AsyncTP's bound) tokens/s/GPU",
         *(f"{k} s" for k in SPLIT), "source"],
        [[r["name"], r["gpus"], r["watts"], r["published"], r["published_tps"], r["forecast_tps"], f"{r['ratio']:.3f}",
          r["published_gib"], r["forecast_gib"], r["reserved_gib"], f"{r['peak_ratio']:.3f}" if r["peak_ratio"] else "not published",
          r["tflops"], r["step"], r["hidden_tps"], *(r["split"][k] for k in SPLIT), r["source"]] for r in rows],
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

**Float8 rows** (`converters=[float8]`, priced by the converter's own `planner_price`,
framework/converters/float8_price.py; docs/planner.md, "A converter's price"): torchtitan's Tables 1-5
at its commit 9dec370, torchao's tensorwise recipe with float8 all-gather under FSDP2 and the
scales precomputed (its `[float8]` keys then: dynamic tensorwise scaling was the one recipe), every
linear but the output head, every row compiled. Table 2: local batch 1, full AC, FSDP resharding
after forward; CP planned as the framework's ring attention (torchtitan's is torch's
context_parallel with its all-gather rotation; no float8 all-gather at FSDP 1, as torchtitan's
`dp_shard_enabled`). Table 4: 70B, FSDP 32 x TP 8, local batch 16, full AC, sequence parallel and
loss parallel. Table 5: 405B, FSDP 8 x TP 8 x PP 8, local batch 32 in 8 micro-batches
(torchtitan's default: the pipeline degree), 2 stages a rank when interleaved (its default
split), FSDP without resharding under the pipeline, full AC. Table 6 (4D with CP) is left out.

*What compile buys* is priced (the compiled bf16 rows read 0.98x and 1.01x, before 0.86x and 0.89x):
each block's elementwise runs between two matmuls fuse into one kernel each (framework/plan/ops.py
follows every tensor of the traced forward; a Llama 3 8B block moves 45% of its eager bytes).

*AsyncTP.* Table 5's rows run AsyncTP (Table 4's 2D row does not; its AsyncTP row, 876 TPS/GPU,
is left out). This framework has no AsyncTP, so each row is planned with tensor parallel's
collectives blocking; the column "exposed comm hidden" is AsyncTP's bound, the same step with its
exposed communication hidden behind the matmuls (Table 4's 2D row: 1,139 against AsyncTP's published
876, so the forecast does not credit AsyncTP with hiding all of it).

*Missed, and why* (no constant is set per row). Throughput: Table 2's two longest rows, CP 4 at
131,072 tokens (1.23x) and CP 8 at 262,144 (1.27x), while CP 1 and CP 2 read 1.01x and 0.93x. Every
row of Table 2 holds 32,768 tokens a rank, so a rank's attention work a token grows in proportion
to the sequence while its other work stays: at any one attention rate each further 32,768 tokens of
sequence add the same seconds a token. The published rows add 1.37e-4 s a token from 32,768 to
65,536 tokens, then 2.70e-4 per 32,768 from 65,536 to 131,072 and 2.23e-4 from 131,072 to 262,144:
twice as much from CP 4 on, which no single attention rate fits (the forecast, at the rate every
H100 row uses, is slower than published at CP 2 and faster at CP 4 and 8). torchtitan ran torch's
context_parallel (this framework's `parallel.cp_impl=torch`), whose collectives and kernels the
planner does not model (framework/plan/traffic.py); these rows are planned as the framework's
ring. Memory: Table 5's 1F1B row (0.81x: 66.9 of 82.5 GiB), while its interleaved row reads 0.92x.
The two layouts hold the same state, the same 15 or 16 blocks a rank, the same 8 micro-batches (the
first rank runs all 8 forwards before its first backward under both); published, 1F1B takes 9.8
GiB more, which the forecast (the same 66.9 GiB for both, on the first rank: 8 micro-batches of
its checkpointed blocks in flight beside the stage's fp32 gradients) does not explain. Not priced:
a pipeline's last stage keeps every micro-batch's logits to the step's end (torch's stage appends
each to `output_chunks` for the schedule to merge; 7.8 GiB on Table 5's last rank), AsyncTP's
symmetric-memory workspaces, the allocator's fragmentation. Pricing the held logits was tried: it
puts the interleaved row at 0.97x and 1F1B's still at 0.80x, and this framework's own pipeline
holds them too (framework/parallel/pipeline.py steps the schedule with `return_outputs` left on),
which puts the Llama 3 rows' last rank at 63 GiB more (32 micro-batches of the whole vocabulary's
16-bit logits): they would not fit even checkpointed. Whether the framework stops holding them
(it never reads them) is left open, so the term is left out.

*Memory closed by two general terms* (each also in every bf16 row it applies to; Table 4 read
0.79x and Table 5's interleaved row 0.54x before them): (1) under a pipeline a stage's gradients
are held from its first micro-batch's backward to the step's end, beside the activations of the
micro-batches in flight: under FSDP2 unsharded, in the reduce dtype (torch's stage,
torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`, turns FSDP's gradient sync
and resharding off until the last backward): 24 GiB a rank for the 405B at PP 8 x TP 8
(framework/plan/peak.py `held_gradients`); (2) under loss parallel the loss's
backward holds three fp32 vocabulary-wide tensors beside log-softmax's saved output, not two
(torch/distributed/tensor/parallel/loss.py computes log-softmax's backward with nll_loss's:
the scatter's zeros, exp(output) and their sum at once): 7.8 GiB for Table 4's 16 x 8,192 tokens.
Table 4 reads 0.90x with them (65.0 of 71.9 GiB), Table 5's interleaved row 0.92x.

NVIDIA's Megatron-Core / NeMo H100 tables and MLPerf Training's H100 results were not
found in this project's search tools with their layouts, so no row of theirs is shown (no figure
here is from memory).

**Assumptions, stated.** torchtitan's selective "op" checkpointing (its `_save_list` and mm count at
commit 9dec370, the one its tables name) is planned as this framework's own `memory=selective
memory.matmul_every=2`: in every block the outputs of SDPA and of every other matmul in the block's
order are kept (a Llama block: wq, wv, w1, w2; wk, wo and w3 run again in backward), the rest
recomputed; on the CPU the framework's meter measures what it keeps within 0.04% of the forecast
(tests/test_memory_levers.py). The compiled rows are priced with the compiler's fusion (above); for memory, the compiler's
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
