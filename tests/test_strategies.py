"""Numerical parity of every sharded and model-parallel strategy with one process.

With fp32 and dropout 0, a strategy is a re-arrangement of the same arithmetic: at the same
global batch it must follow the single-process loss trajectory, and its global gradient norm
(over sharded, replicated and partial gradients) must equal the single process's at every step.
Adam's update hardly depends on the gradient's scale, so a run with plain SGD and active
clipping checks that a wrong norm (a wrong clipping factor) shows in the losses. Configs run back
to back inside one group of worker processes (no process start-up per config).
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from framework.run.sweep import run_configs
from tests.helpers import assert_plan_holds, losses, read_metrics, run_workers, world_config

STEPS = 5
BASE = [
    "experiment=smoke",
    "logger=none",
    f"steps={STEPS}",
    "model.n_layer=4",
    "checkpoint.export=true",
]
GLOBAL_BATCH = 8


def config(overrides: list[str], world: int) -> dict:
    return world_config([*BASE, *overrides], world)


def single_process(out, overrides: list[str] = ()) -> tuple:
    from framework.run.trainer import run

    cfg = OmegaConf.create(config(["parallel=none", f"data.batch_size={GLOBAL_BATCH}", *overrides], 1))
    summary = run(cfg, str(out), {"parallel": "none"})
    got = losses(out)
    assert len(got) == STEPS and got[-1] < got[0] and summary["status"] == "ok"
    grad_norms = [m["grad_norm"] for m in read_metrics(out)]
    return got, torch.load(out / "model.pt", weights_only=True), grad_norms


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return single_process(tmp_path_factory.mktemp("reference"))


def train_all(configs: dict, world: int, out_dir) -> dict:
    summaries = run_configs(configs, world, str(out_dir))
    return {name: (losses(out_dir / name), summary) for name, summary in summaries.items()}


def assert_parity(results: dict, reference: tuple, out_dir, tol: float = 1e-5) -> None:
    """Same losses (1e-5 relative: observed <= 2e-7, reordered fp32 sums) and, exported as a full
    state dict from the shards, the same trained weights under the plain model's names."""
    ref_losses, ref_state, ref_norms = reference
    for name, (got, summary) in results.items():
        assert summary["global_batch_size"] == GLOBAL_BATCH, name
        assert len(got) == STEPS, name
        for step, (a, b) in enumerate(zip(got, ref_losses, strict=True), start=1):
            assert abs(a - b) / abs(b) <= tol, f"{name} step {step}: {a} vs single process {b}"
        norms = [m["grad_norm"] for m in read_metrics(out_dir / name)]
        assert norms == pytest.approx(ref_norms, rel=1e-4), f"{name}: gradient norms {norms} vs {ref_norms}"
        state = torch.load(out_dir / name / "model.pt", weights_only=True)
        assert state.keys() == ref_state.keys(), name
        for key in ref_state:
            assert torch.allclose(state[key], ref_state[key], rtol=1e-4, atol=1e-6), f"{name}: {key}"


WORLD2 = {
    "fsdp2": ["parallel=fsdp", "data.batch_size=4"],
    "fsdp2_shard_grad_op": [
        "parallel=fsdp",
        "parallel.reshard_after_forward=false",
        "data.batch_size=4",
    ],
    "fsdp2_accum4_sync_skipped": ["parallel=fsdp", "data.batch_size=1", "accumulation_steps=4"],
    "fsdp2_accum4_sync_every": [
        "parallel=fsdp",
        "data.batch_size=1",
        "accumulation_steps=4",
        "parallel.sync_every_microbatch=true",
    ],
    "fsdp1_full_shard": ["parallel=fsdp", "parallel.version=1", "data.batch_size=4"],
    "fsdp1_shard_grad_op": [
        "parallel=fsdp",
        "parallel.version=1",
        "parallel.sharding_strategy=SHARD_GRAD_OP",
        "data.batch_size=4",
    ],
    "fsdp1_accum2": [
        "parallel=fsdp",
        "parallel.version=1",
        "data.batch_size=2",
        "accumulation_steps=2",
    ],
    "tp_sequence_parallel": ["parallel=tp", "data.batch_size=8"],
    "tp_plain": ["parallel=tp", "parallel.sequence_parallel=false", "data.batch_size=8"],
    "tp_loss_parallel": ["parallel=tp", "parallel.loss_parallel=true", "data.batch_size=8"],
    "tp_accum2": ["parallel=tp", "data.batch_size=4", "accumulation_steps=2"],
    "pp_GPipe": ["parallel=pp", "parallel.schedule=GPipe", "data.batch_size=8"],
    "pp_1F1B": ["parallel=pp", "parallel.schedule=1F1B", "data.batch_size=8"],
    "pp_Interleaved1F1B": ["parallel=pp", "parallel.schedule=Interleaved1F1B", "data.batch_size=8"],
    "pp_InterleavedZeroBubble": [
        "parallel=pp",
        "parallel.schedule=InterleavedZeroBubble",
        "data.batch_size=8",
    ],
    "pp_ZBVZeroBubble": ["parallel=pp", "parallel.schedule=ZBVZeroBubble", "data.batch_size=8"],
    "pp_accum2": ["parallel=pp", "data.batch_size=4", "accumulation_steps=2"],
}

WORLD4 = {
    "hybrid_auto_dp2_tp2": ["parallel=hybrid", "data.batch_size=4", "parallel.n_microbatches=2"],
    "hybrid_dp2_pp2": ["parallel=hybrid", "parallel.tp=1", "parallel.pp=2", "data.batch_size=4"],
    "hybrid_pp2_tp2": ["parallel=hybrid", "parallel.pp=2", "parallel.tp=2", "data.batch_size=8"],
    "hsdp_2x2": ["parallel=fsdp", "parallel.dp_replicate=2", "data.batch_size=2"],
    "fsdp1_hybrid_shard_2x2": ["parallel=fsdp", "parallel.version=1", "parallel.dp_replicate=2",
                               "parallel.sharding_strategy=HYBRID_SHARD", "data.batch_size=2"],
}  # fmt: skip


def test_every_strategy_follows_the_single_process_trajectory_world_2(tmp_path, reference):
    configs = {name: config(args, 2) for name, args in WORLD2.items()}
    results = train_all(configs, 2, tmp_path)
    assert set(results) == set(WORLD2)
    assert_parity(results, reference, tmp_path)
    for name, (_, summary) in results.items():  # every run checks the planner's prediction of it
        assert_plan_holds(summary, name)


def test_hybrid_and_hsdp_follow_the_single_process_trajectory_world_4(tmp_path, reference):
    configs = {name: config(args, 4) for name, args in WORLD4.items()}
    results = train_all(configs, 4, tmp_path)
    dims = results["hybrid_auto_dp2_tp2"][1]["parallel_dims"]
    assert dims == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "ep": 1}
    assert results["hybrid_dp2_pp2"][1]["parallel_dims"]["pp"] == 2
    assert_parity(results, reference, tmp_path)
    for name, (_, summary) in results.items():
        assert_plan_holds(summary, name)


SGD = ["optim=sgd", "optim.lr=0.5", "optim.momentum=0.0", "optim.grad_clip=0.5"]


def test_sharded_clipping_scales_like_one_process_under_sgd(tmp_path):
    """Plain SGD with clipping active (norms above 0.5): the update is lr x clip factor x
    gradient, so a wrong global norm under sharding moves the losses."""
    reference = single_process(tmp_path / "reference", SGD)
    assert max(reference[2]) > 0.5  # clipping is active
    configs = {
        "fsdp2_sgd": config(["parallel=fsdp", "data.batch_size=4", *SGD], 2),
        "tp_sgd": config(["parallel=tp", "data.batch_size=8", *SGD], 2),
        "pp_sgd": config(["parallel=pp", "data.batch_size=8", *SGD], 2),
    }
    assert_parity(train_all(configs, 2, tmp_path), reference, tmp_path)


# ----------------------------------------------------------------------------- knobs leave traces


def test_sequence_and_loss_parallel_show_in_the_collectives(tmp_path):
    """Same arithmetic, other collectives: sequence parallel turns the row-wise outputs'
    all-reduces into reduce-scatters (and all-gathers the sequence back); loss parallel leaves the
    (B, T, vocab) logits ungathered."""
    tp = ["parallel=tp", "data.batch_size=8", "steps=3"]
    configs = {
        "plain": config([*tp, "parallel.sequence_parallel=false"], 2),
        "sp": config(tp, 2),
        "sp_lp": config([*tp, "parallel.loss_parallel=true"], 2),
    }
    ops = {name: s["comm"]["by_op"] for name, s in run_configs(configs, 2, str(tmp_path)).items()}
    logits = {"calls": 1, "bytes": 8 * 32 * 256 * 4}  # the head's (B, T, vocab) fp32 output, gathered once
    # per rank per step, 2 blocks: with sequence parallel, 19 reduce-scatters and as many all-gathers
    # of the residual stream (shards of (B, T, C)) replace the plain layout's activation all-reduces
    assert ops["plain"] == {"all_gather": logits, "all_reduce": {"calls": 26, "bytes": 819204}}, ops["plain"]
    stream = {"calls": 19, "bytes": 593920}
    assert ops["sp"] == {"all_gather": {"calls": 19 + 1, "bytes": 593920 + logits["bytes"]}, "reduce_scatter": stream,
                         "all_reduce": {"calls": 10, "bytes": 1156}}, ops["sp"]  # fmt: skip
    # loss parallel: the same, less the logits' gather
    assert ops["sp_lp"] == {"all_gather": stream, "reduce_scatter": stream, "all_reduce": {"calls": 10, "bytes": 1156}}


def _pipeline_actions(rank: int, world: int, schedules: list[str]) -> dict[str, list[str]]:
    """This rank's stage forwards (F) and backwards (B) of a pipeline step, in the order run, per
    schedule (the second step: the first also infers the stages' shapes)."""
    from framework.dist import DistInfo
    from framework.run.trainer import build

    got = {}
    for schedule in schedules:
        args = ["experiment=smoke", "logger=none", "parallel=pp", f"parallel.schedule={schedule}", "data.batch_size=8"]
        cfg = OmegaConf.create(world_config(args, world))
        setup = build(cfg, DistInfo(rank, world, rank, world, torch.device("cpu"), "gloo"))
        actions: list[str] = []

        def record(module, args, output, actions=actions):
            if output.device.type != "meta":
                actions.append("F")
                output.register_hook(lambda grad: actions.append("B"))

        next(iter(setup.par.module.blocks.values())).register_forward_hook(record)  # one F per micro-batch
        tokens = torch.randint(0, 256, (8, cfg.data.seq_len + 1), generator=torch.Generator().manual_seed(0))
        for _ in range(2):
            actions.clear()
            setup.par.pipeline.step(tokens[:, :-1], tokens[:, 1:])
        got[schedule] = "".join(actions)
    return got


def test_pipeline_schedules_run_their_own_action_order():
    """The same arithmetic in another order (2 stages, 4 micro-batches): GPipe runs every
    micro-batch's forward before any backward; 1F1B starts backwards as soon as the last stage
    has a micro-batch, then alternates."""
    got = run_workers(_pipeline_actions, 2, ["GPipe", "1F1B"])
    assert got[0] == {"GPipe": "FFFFBBBB", "1F1B": "FFBFBFBB"}, got
    assert got[1] == {"GPipe": "FFFFBBBB", "1F1B": "FBFBFBFB"}, got


def test_grad_clip_scales_the_update_in_a_run_designed_to_clip(tmp_path):
    """One plain SGD step with clipping at 0.1, below the first step's gradient norm: the update
    is the unclipped update times the clip coefficient 0.1 / norm < 1, parameter by parameter."""
    from framework.dist import DistInfo
    from framework.run.trainer import build, run

    sgd = ["optim=sgd", "optim.momentum=0.0", "optim.lr=0.5", "schedule=constant", "schedule.warmup_steps=0",
           "steps=1", "parallel=none", f"data.batch_size={GLOBAL_BATCH}"]  # fmt: skip
    cfg = OmegaConf.create(config(sgd, 1))
    start = build(cfg, DistInfo(0, 1, 0, 1, torch.device("cpu"), None)).par.module.state_dict()
    weights = {}
    for name, clip in (("clipped", 0.1), ("free", 0.0)):
        run(OmegaConf.create(config([*sgd, f"optim.grad_clip={clip}"], 1)), str(tmp_path / name), {"parallel": "none"})
        weights[name] = torch.load(tmp_path / name / "model.pt", weights_only=True)
    norm = read_metrics(tmp_path / "clipped")[0]["grad_norm"]
    assert norm == read_metrics(tmp_path / "free")[0]["grad_norm"]
    coef = 0.1 / (norm + 1e-6)
    assert coef < 0.5, norm  # clipping is active, and by a factor the comparison can tell from 1
    for key, w0 in start.items():
        free, clipped = weights["free"][key] - w0, weights["clipped"][key] - w0
        assert torch.allclose(clipped, coef * free, rtol=1e-3, atol=1e-7), key
