"""The planner: `parallel=auto` under a memory budget, the error when nothing fits, the ranked table
of `python -m framework.plan`, and the formulas that need no run. (Every run checks the planner's
prediction of itself: the parity and measurement tests assert those errors for ddp, fsdp both
ways, tp, pp with every schedule, hybrid and HSDP at world sizes 2 and 4.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from framework.plan import bubble, candidates, predict
from framework.plan.model import Layout
from framework.plan.profile import machine_profile
from tests.helpers import ROOT, assert_plan_holds, compose_config, read_summary, train_cli

# a gpt of about 100M parameters (8 blocks x 1024 wide: 12 x 8 x 1024^2), short sequences
GPT_100M = ["experiment=smoke", "logger=none", "model.n_layer=8", "model.n_embd=1024", "model.n_head=8",
            "data.seq_len=32", "data.batch_size=4"]  # fmt: skip
LINK = ["plan.latency_us=100", "plan.intra_node_gbps=1"]  # fixed link figures: no probe in tests
# a plan no machine's speed or load changes: nominal compute figures (no probe, no cache) and a
# link so slow that the fewest bytes decide (a 1F1B-type pipeline's: the zero-bubble schedules,
# which a faster link ranks first, forecast this shape's activations 41% over)
PINNED = ["plan.latency_us=100", "plan.intra_node_gbps=0.01", "plan.profile=config"]
MB = 2**20


def test_auto_under_a_budget_below_ddp_picks_a_sharded_layout_that_fits(tmp_path):
    # DDP needs ~1.6 GB of model state per rank for 100M parameters (Adam, fp32), ~2.5 GB at its peak
    # with the process (~0.65 GB on CPU); sharded layouts peak near 1.3 GB
    budget = 1500
    ddp_cfg = compose_config([*GPT_100M, "parallel=ddp"])
    assert predict(ddp_cfg, 4, machine_profile(ddp_cfg, 4, "config"))["peak_bytes"] > budget * MB
    # PINNED: the same pick on every machine, however fast or loaded. Three steps: the plan is of
    # a steady step, and a pipeline's first one also infers its stages' shapes (a micro-batch more
    # through them, the shapes sent), so the run measures its third
    run = train_cli(
        [*GPT_100M, *PINNED, "parallel=auto", f"plan.memory_budget_mb={budget}", "launch.nproc_per_node=4", "steps=3"],
        tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    summary = read_summary(tmp_path)
    auto = summary["plan"]["auto"]
    assert auto["layout"] != "ddp" and summary["choices"]["parallel"] != "ddp"
    assert "fit 1500 MB per rank" in auto["why"] and "parallel=auto:" in run.stdout
    memory = summary["memory"]
    assert memory["param_bytes"] + memory["grad_bytes"] + memory["optim_bytes"] <= budget * MB
    assert memory["rss_peak_bytes"] <= budget * MB  # the measured peak fits, not only the forecast
    assert summary["plan"]["budget"] == {
        "budget_bytes": budget * MB,
        "peak_bytes": memory["rss_peak_bytes"],
        "over": False,
    }
    assert_plan_holds(summary, auto["layout"])


def test_a_run_over_its_memory_budget_says_so_at_the_end_and_records_it(tmp_path, capsys):
    from omegaconf import OmegaConf

    from framework.run.trainer import run
    from tests.helpers import world_config

    args = ["experiment=smoke", "logger=none", "parallel=none", "steps=2", "plan.memory_budget_mb=1"]
    run(OmegaConf.create(world_config(args, 1)), str(tmp_path), {})
    summary = read_summary(tmp_path)
    peak = summary["memory"]["device_peak_bytes"] or summary["memory"]["rss_peak_bytes"]
    assert summary["plan"]["budget"] == {"budget_bytes": MB, "peak_bytes": peak, "over": True}
    closing = capsys.readouterr().out.splitlines()
    over = [line for line in closing if "over the memory budget of 1 MB" in line]
    assert len(over) == 1 and f"the measured peak, {peak / MB:.0f} MB per rank" in over[0]


def test_the_budget_checked_is_the_one_given_or_the_one_auto_chose_for():
    from framework.run.summary import budget_check

    summary = {"memory": {"device_peak_bytes": None, "rss_peak_bytes": 509 * MB}}
    auto = {"budget_mb": 460}  # parallel=auto with plan.memory_budget_mb=460: 11% over
    assert budget_check(compose_config([]), summary, auto) == {"budget_bytes": 460 * MB, "peak_bytes": 509 * MB,
                                                               "over": True}  # fmt: skip
    assert budget_check(compose_config(["plan.memory_budget_mb=600"]), summary, None)["over"] is False
    assert budget_check(compose_config([]), summary, None) is None  # no budget given: nothing to check


def test_a_budget_no_layout_meets_is_an_error_before_any_worker_starts(tmp_path):
    run = train_cli(
        [*GPT_100M, *LINK, "parallel=auto", "plan.memory_budget_mb=100", "launch.nproc_per_node=4"], tmp_path
    )
    assert run.returncode == 2
    assert "plan.memory_budget_mb: no layout fits 100 MB per rank at 4 ranks" in run.stderr
    assert "python" not in run.stderr.split("plan.memory_budget_mb")[0].lower()  # nothing started before it
    assert "the smallest predicted footprint is" in run.stderr
    assert not (tmp_path / "summary.json").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_the_plan_command_ranks_every_layout_fastest_first():
    cmd = [
        sys.executable,
        "-m",
        "framework.plan",
        "experiment=smoke",
        "model.n_head=4",
        "model.n_layer=4",
        "plan.world_size=4",
        *LINK,
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| ") and "layout" not in line]
    layouts = [r[1].strip() for r in rows]
    for expected in ("ddp", "fsdp", "fsdp(grad_op)", "tp", "cp4", "hybrid dp2xtp2", "hybrid dp2xpp2",
                     "hybrid pp2xtp2"):  # fmt: skip
        assert expected in layouts, (expected, layouts)
    assert any(name.startswith("pp 1F1B m=") for name in layouts) and any(n.startswith("pp GPipe m=") for n in layouts)
    assert "latency 100 us per call (config)" in out.stdout and "no link probe ran" in out.stdout
    assert "runner-up:" in out.stdout
    step_ms = [float(r[12]) for r in rows]
    assert step_ms == sorted(step_ms)  # an ample budget: everything fits, fastest first
    # and the link prices what the table lists: the communication of ddp and of both fsdp
    # variants differs by exactly their extra calls and bytes on the configured link (100 us per
    # call, 1 GB/s), read from their own columns (their compute differs too: the optimizer's
    # share, FSDP's copies, as this machine's kernels price them)
    by = {r[1].strip(): (int(r[9]), float(r[10]), r[13].split()) for r in rows}
    comm_ms = {}
    for name in ("ddp", "fsdp(grad_op)", "fsdp"):
        cfg = compose_config(["experiment=smoke", "model.n_head=4", "model.n_layer=4", *LINK, *by[name][2]])
        comm_ms[name] = predict(cfg, 4, machine_profile(cfg, 4, "config"))["comm_time_s"] * 1e3
    for slower in ("fsdp(grad_op)", "fsdp"):
        (calls0, mb0, _), (calls1, mb1, _) = by["ddp"], by[slower]
        wire_ms = (calls1 - calls0) * 0.1 + (mb1 - mb0) * MB / 1e9 * 1e3
        assert wire_ms > 0.5 and comm_ms[slower] - comm_ms["ddp"] == pytest.approx(wire_ms, abs=0.02), (slower, by)
    assert f"parallel=auto would run: {layouts[0]}" in out.stdout


def test_candidates_respect_the_model_and_the_batch():
    cfg = compose_config(["experiment=smoke", "data.batch_size=4"])  # 2 heads, 2 layers, 4 samples per rank
    names = {predict(c.cfg, 4)["layout"] for c in candidates(cfg, 4)}
    assert "tp" not in names  # 2 heads do not split over 4 ranks
    assert not any(n.startswith("pp") for n in names)  # 2 layers cannot fill 4 stages
    assert {"ddp", "fsdp", "fsdp(grad_op)"} <= names


def test_pipeline_bubble_shrinks_with_micro_batches_and_interleaving():
    one_f_one_b = Layout("pp", pp=4, schedule="1F1B", n_microbatches=4)
    assert bubble(one_f_one_b) == pytest.approx(3 / 7)
    assert bubble(Layout("pp", pp=4, schedule="1F1B", n_microbatches=12)) == pytest.approx(3 / 15)
    interleaved = Layout("pp", pp=4, schedule="Interleaved1F1B", n_microbatches=4, stages_per_rank=2)
    assert bubble(interleaved) == pytest.approx(3 / 11)
    assert bubble(Layout("ddp", dp_replicate=4)) == 0.0


def test_ranks_under_a_launcher_rank_from_the_config_alone(tmp_path, monkeypatch):
    """Every rank of a torchrun/srun job must pick the same layout: `config` ignores the cache
    (nodes may hold different ones) and never probes; a run's own check reads the cache."""
    import json

    from framework.machine import local_ranks
    from framework.plan.profile import NOMINAL, _link_key, machine_profile

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cfg = compose_config(["experiment=smoke", "plan.peak_tflops=1"])
    (tmp_path / "hydradist").mkdir()
    key = _link_key("cpu", "gloo", local_ranks(4, 1, None, "cpu"))  # one node's ranks, capped by the cores
    (tmp_path / "hydradist" / "links.json").write_text(json.dumps({key: {"bytes_per_s": 123.0, "latency_s": 0.5}}))
    assert machine_profile(cfg, 4, "cache").intra_bytes_per_s == 123.0
    alike = machine_profile(cfg, 4, "config")
    assert alike.intra_bytes_per_s == NOMINAL["gbps"] * 1e9 and alike.latency_s == NOMINAL["latency_us"] * 1e-6
    configured = machine_profile(
        compose_config(["experiment=smoke", "plan.intra_node_gbps=2", "plan.latency_us=7"]), 4, "config"
    )
    assert configured.intra_bytes_per_s == 2e9 and configured.latency_s == pytest.approx(7e-6)


def test_the_search_chooses_memory_knobs_that_fit_a_budget_in_seconds():
    """A budget the layouts meet only with activation checkpointing or smaller micro-batches: the
    pick keeps the global batch and its predicted peak fits; a few hundred combinations in < 5 s."""
    import time

    from framework.plan.profile import machine_profile
    from framework.plan.search import memory_budget_bytes, rank

    cfg = compose_config([*GPT_100M, *LINK, "data.seq_len=512", "data.batch_size=4", "plan.peak_tflops=0.05",
                          "plan.op_overhead_us=20", "launch.nproc_per_node=4"])  # fmt: skip
    profile = machine_profile(cfg, 4, "config")
    ample = rank(cfg, 4, profile, memory_budget_bytes(cfg, 4))
    plain = min(r.footprint() for r in ample if r.knobs == ample_plain(r))
    least = min(r.footprint() for r in ample)
    assert least < plain - 32 * MB  # the knobs save memory
    budget = (least + plain) / 2  # below every layout at its plain knobs
    started = time.process_time()  # CPU seconds: the test machine's wall clock is shared
    ranked = rank(cfg, 4, profile, budget)
    seconds = time.process_time() - started
    assert len(ranked) >= 150 and seconds < 5, (len(ranked), seconds)
    best = ranked[0]
    assert best.fits and best.footprint() <= budget
    assert best.knobs != ample_plain(best)  # checkpointing or accumulation made it fit
    k = best.knobs
    samples = k.batch_size * k.accumulation_steps * predict_dp(best)
    assert samples == cfg.data.batch_size * 4  # the global batch kept
    assert any("memory=checkpoint" in " ".join(r.overrides) for r in ranked)


def ample_plain(r):
    """The knobs a layout runs with when nothing is searched: no checkpointing, no accumulation."""
    from framework.plan.search import Knobs

    return Knobs(0, r.knobs.batch_size, 1, r.knobs.n_microbatches) if r.knobs.accumulation_steps == 1 else None


def predict_dp(ranked) -> int:
    from framework.plan.model import layout_of

    return layout_of(ranked.candidate.cfg.parallel, 4, 8, 8).dp


@pytest.mark.slow  # a launched link probe; the default run plans 1,024 ranks on 128 nodes without one
def test_planning_a_cluster_probes_no_more_ranks_than_one_node_runs(tmp_path):
    """8 ranks on 4 nodes: the link probe starts 2 workers (one node's ranks), whatever the world;
    the figures it cannot measure here are the config's or nominal, and the table says which."""
    import json

    env = {"XDG_CACHE_HOME": str(tmp_path), "WANDB_MODE": "offline"}
    cmd = [sys.executable, "-m", "framework.plan", "experiment=smoke", "model.n_head=4", "model.n_layer=4",
           "plan.world_size=8", "plan.nodes=4", "plan.peak_tflops=0.05", "plan.op_overhead_us=20"]  # fmt: skip
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "link probed with 2 local ranks" in out.stdout
    assert "peak 0.05 TFLOP/s per rank (config)" in out.stdout and "across nodes" in out.stdout
    cache = json.loads((tmp_path / "hydradist" / "links.json").read_text())
    probed = [k for k in cache if "|gloo|" in k]
    assert probed and all("world=2|" in k for k in probed), probed


def test_gpt3_at_1024_ranks_on_128_nodes_plans_in_seconds():
    """GPT-3 175B's shape planned for a 128-node cluster, in-process and without a probe. (CPU
    seconds of this process: the machine the tests run on is shared, and its wall clock with it.)"""
    import time

    from framework.plan.search import choose

    cfg = compose_config(GPT3 + ["plan.world_size=1024", "plan.nodes=128"])
    started = time.process_time()
    best, ranked, _ = choose(cfg, 1024, "config")
    assert time.process_time() - started < 30
    assert best.fits and best.prediction["step_time_s"] > 0
    assert {r.prediction["layout"].split()[0] for r in ranked} >= {"hybrid", "fsdp"}


# GPT-3 175B (96 x 12288, 96 heads, seq 2048, bf16) on A100s: Megatron-LM's figures (tests the speed
# of planning; docs/results/plan_megatron.md compares the forecast with the paper)
GPT3 = ["model=gpt", "model.n_layer=96", "model.n_embd=12288", "model.n_head=96", "model.vocab_size=51200",
        "data.seq_len=2048", "data.batch_size=1", "precision=bf16", "memory=checkpoint", "plan.peak_tflops=312",
        "plan.intra_node_gbps=300", "plan.inter_node_gbps=25", "plan.latency_us=10", "plan.overlap=0.8",
        "plan.memory_budget_mb=81920", "plan.op_overhead_us=0"]  # fmt: skip


def test_a_context_parallel_run_checks_the_planner(tmp_path):
    """cp=2: the run's own check of the planner holds (state, saved activations, ring sends and
    calls within 10%), and the peak is predicted and checked (summary.plan.error.peak_bytes)."""
    run = train_cli(["experiment=smoke", "logger=none", "parallel=cp", "launch.nproc_per_node=2", "steps=2",
                     *LINK], tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    plan = read_summary(tmp_path)["plan"]
    assert plan["layout"] == "cp2", plan
    for figure in ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "wire_bytes", "comm_calls"):
        assert abs(plan["error"][figure]) <= 0.10, (figure, plan)
    assert plan["error"]["peak_bytes"] is not None and abs(plan["error"]["peak_bytes"]) < 0.5, plan


# ----------------------------------------------------------------------------- the op trace


def _traced_flops(trace, regions=None) -> float:
    """Forward FLOPs of a trace's matmuls and attention (two matmuls of the scores' shape)."""
    total = 0.0
    for key, region in trace.regions.items():
        if regions is None or key in regions:
            total += sum(2 * m * k * n for m, k, n, *_ in region.matmuls)
            total += sum(4 * m * k * n for m, k, n in region.attention)
    return total


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_the_traced_forward_has_the_models_declared_flops(model):
    """The time model prices what the trace finds: its matmuls and attention, times three for
    forward and backward, are the model's own FLOP count (models/gpt.py, models/llama.py), exactly."""
    from framework.config.model import meta_model, model_spec
    from framework.plan.ops import trace_forward

    overrides = ["model.n_layer=3", "model.n_embd=64", "model.n_head=4"] if model == "gpt" else []
    cfg = compose_config([f"model={model}", *overrides, "data.seq_len=32"])
    net, spec = meta_model(cfg), model_spec(cfg)
    trace = trace_forward(net, spec, 2, 32)
    assert 3 * _traced_flops(trace) == pytest.approx(net.flops_per_token(32) * 2 * 32, rel=1e-12)
    blocks = {key[0] for key in trace.regions if isinstance(key, tuple)}
    assert len(blocks) == len(getattr(net, spec.blocks))


def test_a_bf16_trace_holds_autocasts_casts():
    """Under CPU autocast the same matmuls run, each input cast to bf16 first: the trace holds a
    cast per weight (and per activation entering a matmul in fp32)."""
    from framework.config.model import meta_model, model_spec
    from framework.plan.ops import trace_forward

    cfg = compose_config(["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "data.seq_len=32"])
    net, spec = meta_model(cfg), model_spec(cfg)
    fp32, bf16 = trace_forward(net, spec, 2, 32), trace_forward(net, spec, 2, 32, torch.bfloat16)
    assert _traced_flops(bf16) == _traced_flops(fp32)
    block = ("blocks.0", "sharded")
    weights = len(fp32.regions[block].matmuls)  # each matmul's weight is cast once per forward
    assert bf16.regions[block].ops >= fp32.regions[block].ops + weights


def test_the_trace_places_each_operator_where_tensor_parallel_splits_it():
    """q/k/v and the MLP (and attention between them) are in a block's sharded part, the norms
    and residual adds in its replicated part, the head after the blocks, split by its output."""
    from framework.config.model import meta_model, model_spec
    from framework.plan.ops import trace_forward

    cfg = compose_config(["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "data.seq_len=32"])
    net, spec = meta_model(cfg), model_spec(cfg)
    trace = trace_forward(net, spec, 2, 32)
    sharded, replicated = trace.regions["blocks.0", "sharded"], trace.regions["blocks.0", "replicated"]
    assert [m[3] for m in sharded.matmuls] == ["colwise"] * 3 + ["rowwise", "colwise", "rowwise"]
    assert len(sharded.attention) == 1 and not replicated.matmuls and not replicated.attention
    assert replicated.bytes > 0 and replicated.ops >= 4  # two norms, two residual adds
    assert [m[3] for m in trace.regions["post"].matmuls] == ["output"]
    assert trace.regions["post"].matmuls[0][:3] == (64, 64, cfg.model.vocab_size)


@pytest.mark.parametrize("world", [2, 4])
def test_every_combination_the_search_ranks_is_one_the_run_accepts(world):
    """Each layout and knob combination parallel=auto may pick passes the run's own checks (a
    pipeline's micro-batches at least its stages where the schedule needs it): a pick never fails
    at launch; nor one the memory check refuses (memory=selective under cp or a zero-bubble schedule)."""
    import copy

    from framework.config.memory_checks import check_memory
    from framework.config.model import model_dims_of
    from framework.parallel.dims import ParallelDims
    from framework.plan import choose

    cfg = compose_config([*GPT_100M, *LINK, "parallel=auto", "plan.memory_budget_mb=100000"])
    _, ranked, _ = choose(cfg, world, "config")
    schedules = set()
    for r in ranked:
        trial = copy.deepcopy(r.candidate.cfg)
        r.knobs.apply(trial)
        dims = ParallelDims.from_config(trial.parallel, world, *model_dims_of(trial))
        dims.check_run(trial)  # raises DimsError, naming the key, on a combination the run refuses
        check_memory(trial)  # raises ConfigError, naming the key
        schedules.add(trial.parallel.get("schedule") if dims.pp > 1 else None)
    assert {"1F1B", "Interleaved1F1B", "GPipe"} <= schedules


def test_plain_data_parallelism_on_the_hybrid_mesh_replicates_and_keeps_megatrons_trend():
    """Megatron-LM's PTD-P as benchmarks/plan_megatron.py plans it: `parallel.dp_replicate=<dp>
    parallel.dp_shard=1` is plain data parallelism (every replica holds its stage's whole state, no
    reduce-scatter, the gradients all-reduced across the replicas), and GPT-3 175B's forecast keeps
    the direction of the paper's Table 2: the same batch of 1,536 over more GPUs, fewer FLOP/s each."""
    from framework.plan.profile import machine_profile

    def plan(world: int, replicate: bool) -> dict:
        dp, m = world // 96, 1536 // (world // 96)
        cfg = compose_config([*GPT3, "plan.overlap=0", f"plan.nodes={world // 8}", "parallel=hybrid", "parallel.tp=8",
                              "parallel.pp=12", f"parallel.dp_replicate={dp if replicate else 1}",
                              f"parallel.dp_shard={1 if replicate else dp}", "parallel.sequence_parallel=false",
                              f"parallel.n_microbatches={m}", f"data.batch_size={m}"])  # fmt: skip
        return predict(cfg, world, machine_profile(cfg, world, "config"))

    replicated, sharded = plan(1536, True), plan(1536, False)
    assert "reduce_scatter" not in replicated["comm"]["by_op"] and "reduce_scatter" in sharded["comm"]["by_op"]
    ratio = replicated["memory"]["param_bytes"] / sharded["memory"]["param_bytes"]
    assert 15.5 < ratio <= 16, ratio  # dp 16: the whole stage on each replica (FSDP pads its shards)
    seconds = [plan(world, True)["step_time_s"] * world for world in (384, 768, 1536)]  # GPU-seconds per step
    assert seconds[0] < seconds[1] < seconds[2], seconds


def test_planner_md_example_prints_what_the_doc_shows(tmp_path, monkeypatch, capsys):
    """docs/planner.md's example (plan.gpu=A100: published figures, no probe, no cache) prints its
    table on any machine exactly as the doc shows it (issue 53: a newcomer got another table)."""
    import re
    import shlex

    from framework.doors.plan import main

    doc = (ROOT / "docs" / "planner.md").read_text()
    example = re.search(r"```\n\$ (python -m framework\.plan .*?)\n(.*?)```", doc.replace("\\\n", ""), re.S)
    argv = shlex.split(example[1])[3:]
    assert "plan.gpu=A100" in argv
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # an empty cache: nothing of this machine's
    assert main(argv) == 0
    assert capsys.readouterr().out == example[2]
    assert not (tmp_path / "hydradist").exists()


# the search's shapes whose whole lists go through validate: the default GPT, the Llama, the MoE Llama
SEARCHED = {"gpt": [], "llama": ["model=llama"], "moe_llama": ["model=llama", "model.flavor=debug_moe"]}
WALKED = [(s, w) if (s, w) == ("gpt", 2) else pytest.param(s, w, marks=pytest.mark.slow)
          for s in SEARCHED for w in (2, 4, 8)]  # fmt: skip


@pytest.mark.parametrize(("shape", "world"), WALKED)
def test_no_combination_of_the_search_is_one_the_config_check_refuses(shape, world, monkeypatch):
    """No candidate of the planner's search is refused by the config check: the search's whole list
    (every layout at every knob combination) for the default GPT, the Llama and the MoE Llama at 2,
    4 and 8 ranks, each put through train.py's own `validate`. What the planner's check refuses
    (it is never priced), validate refuses in the same words: at 2 ranks memory=selective under cp
    and the zero-bubble schedules, which benchmarks/plan_auto.py once proposed and train.py refused."""
    import copy

    from omegaconf import open_dict

    from framework.config import ConfigError, validate
    from framework.config.model import model_dims_of
    from framework.parallel import pipeline
    from framework.plan.admit import Admission
    from framework.plan.knobs import knob_options
    from framework.plan.search import merged

    # the pipeline's split is the model's alone: traced once, not once per combination (0.17 s each)
    traced, trace = {}, pipeline.trace_split
    monkeypatch.setattr(pipeline, "trace_split", lambda m, spec, t: traced.get((id(m), t)) or
                        traced.setdefault((id(m), t), trace(m, spec, t)))  # fmt: skip
    cfg = compose_config(["logger=none", *SEARCHED[shape]])
    admission, admitted = Admission(world, model_dims_of(cfg)), 0
    for c in candidates(cfg, world):
        trial = copy.deepcopy(c.cfg)  # one copy a layout, its knobs varied in place (as the search does)
        with open_dict(trial):
            trial.launch.nproc_per_node = world
        for knobs in knob_options(cfg, c.cfg, model_dims_of(cfg)[0]):
            knobs.apply(trial)
            why = admission.refusal(trial, merged(c.overrides, knobs.overrides(c.cfg)))
            try:
                validate(trial)
                refused = None
            except ConfigError as err:
                refused = str(err)
            assert refused == why, f"{' '.join(c.overrides)} {' '.join(knobs.overrides(c.cfg))}"
            admitted += why is None
    record = admission.record()
    assert admitted > 100 and record["checked"] == admitted + record["refused"]
    if world == 2:  # selective checkpointing's cache under cp, and under each zero-bubble schedule
        assert record["refused"] > 0 and "the selective-checkpoint cache" in record["refused_example"]
