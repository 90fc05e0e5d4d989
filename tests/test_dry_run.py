"""The planner's dry run (framework/plan/dry_run.py): the real code lays out one rank of each role
of a world on torch's fake process group. At 4 ranks each figure equals what a real gloo run of
the same config measures, and the planner's forecast; at cluster scale it equals the forecast
(`make test-all`; the table: benchmarks/plan_dry_run.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from omegaconf import OmegaConf

from framework.plan.dry_run import STATE, compare, role_ranks
from framework.plan.model import Layout
from framework.run.sweep import run_configs
from tests.helpers import ROOT, train_cli, world_config

LLAMA = ["model=llama", "steps=1", "logger=none"]
CASES = {
    # FSDP2 x tensor parallel in bf16; ffn_hidden 770: w1 and w3 split 385 rows per tp rank, which
    # FSDP pads to 193 + 193 over dp_shard (the last chunk one row short)
    "fsdp2xtp2_bf16": [*LLAMA, "model.ffn_hidden=770", "parallel=hybrid", "parallel.tp=2", "parallel.dp_shard=2",
                       "precision=bf16"],
    # a pipeline over tensor parallel: the embedding on rank 0, the head on rank 1, 1F1B in flight
    "pp2xtp2": [*LLAMA, "parallel=hybrid", "parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=1"],
}  # fmt: skip


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """Each case trained for real on 4 gloo ranks (one group of workers): its summary."""
    configs = {name: world_config(args, 4) for name, args in CASES.items()}
    return configs, run_configs(configs, 4, str(tmp_path_factory.mktemp("real")))


@pytest.mark.parametrize("name", list(CASES))
def test_the_dry_run_at_4_ranks_holds_what_a_real_gloo_run_measures_and_the_planner_forecasts(real, name):
    configs, summaries = real
    measured = summaries[name]["memory"]
    ranks, predicted = compare(OmegaConf.create(configs[name]), 4)
    for key in STATE:  # from the sharded tensors themselves: exactly
        assert max(r.state[key] for r in ranks) == measured[key] == predicted[key], (key, ranks, measured)
    saved = max(r.activation_bytes for r in ranks)
    assert saved == pytest.approx(measured["activation_bytes"], rel=0.02), (ranks, measured)
    assert predicted["activation_bytes"] == pytest.approx(saved, rel=0.10)


def test_roles_are_one_rank_per_distinct_stage_at_each_end_of_the_shard_axis():
    layout = Layout("hybrid", dp_shard=16, tp=8, pp=8, fsdp=2)
    # 80 blocks over 8 stages: the first (embedding), a middle one for the six alike, the last (head)
    assert role_ranks(layout, 80) == [0, 120, 128, 248, 896, 1016]
    # 83 blocks: stages 0-2 take one more each, so stages 1 and 2 differ from 3-6
    assert role_ranks(layout, 83) == [0, 120, 128, 248, 384, 504, 896, 1016]
    assert role_ranks(Layout("fsdp", dp_shard=4, fsdp=2), 6) == [0, 3]


LLAMA_70B = ["model=llama", "model.flavor=70b", "model.vocab_size=128256", "data.seq_len=8192", "data.batch_size=8",
             "parallel=hybrid", "parallel.tp=8", "parallel.pp=8", "parallel.dp_shard=16", "parallel.n_microbatches=8",
             "parallel.sequence_parallel=true", "precision=bf16", "memory=checkpoint"]  # fmt: skip
GPT3_175B = ["model=gpt", "model.n_layer=96", "model.n_embd=12288", "model.n_head=96", "model.vocab_size=51200",
             "data.seq_len=2048", "data.batch_size=384", "parallel=hybrid", "parallel.tp=8", "parallel.pp=12",
             "parallel.dp_replicate=4", "parallel.dp_shard=1", "parallel.sequence_parallel=false",
             "parallel.n_microbatches=384", "precision=bf16", "memory=checkpoint"]  # fmt: skip


@pytest.mark.slow  # about 90 s and 55 s on 2 cores; benchmarks/plan_dry_run.py writes the same rows
@pytest.mark.parametrize("args,world", [(LLAMA_70B, 1024), (GPT3_175B, 384)], ids=["llama70b-1024", "gpt3-175b-384"])
def test_the_dry_run_at_cluster_scale_equals_the_planner(args, world):
    from tests.helpers import compose_config

    start = time.perf_counter()
    ranks, predicted = compare(compose_config([*args, "launch.nproc_per_node=8"]), world)
    assert time.perf_counter() - start < 300
    for key in STATE:
        assert max(r.state[key] for r in ranks) == predicted[key], (key, ranks, predicted)
    assert predicted["activation_bytes"] == pytest.approx(max(r.activation_bytes for r in ranks), rel=0.10)


@pytest.mark.parametrize("args", [["parallel=ddp"], ["parallel=fsdp", "parallel.version=1"]], ids=["ddp", "fsdp1"])
def test_the_dry_run_refuses_what_it_cannot_lay_out_in_one_line(args):
    from framework.config import ConfigError
    from tests.helpers import compose_config

    with pytest.raises(ConfigError, match=r"^plan.dry_run: lays out the mesh strategies with FSDP2 .* got parallel"):
        compare(compose_config([*args, "launch.nproc_per_node=2"]), 2)


def plan_cli(args: list[str]) -> subprocess.CompletedProcess:
    """`python -m framework.plan ARGS` in a subprocess, as a user types it."""
    return subprocess.run([sys.executable, "-m", "framework.plan", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip


def test_the_dry_run_door_spawns_roles_that_follow_the_datas_vocabulary():
    """data=text with no model.vocab_size: the model's vocab_size is `${data_vocab:}`, which a
    spawned role cannot resolve on its own (issue 53: an OmegaConf traceback from the roles)."""
    done = plan_cli(["plan.dry_run=true", "plan.world_size=2", "model=llama", "data=text", "data.seq_len=64",
                     "data.batch_size=2", "parallel=tp"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "1 roles" in done.stdout and "state bytes equal the planner's" in done.stdout, done.stdout


def test_micro_batches_below_the_stages_are_train_pys_one_line_at_the_dry_run_door(tmp_path):
    """The dry run validates as train.py does, before any role starts: the same line, exit 2."""
    layout = ["model=llama", "parallel=hybrid", "parallel.pp=2", "parallel.tp=1", "parallel.dp_shard=2",
              "parallel.n_microbatches=1"]  # fmt: skip
    planned = plan_cli(["plan.dry_run=true", "plan.world_size=4", *layout])
    trained = train_cli([*layout, "launch.nproc_per_node=4"], run_dir=tmp_path / "run")
    line = "error: parallel.n_microbatches: the 1F1B schedule needs at least as many micro-batches as stages (2)\n"
    assert (planned.returncode, planned.stderr) == (trained.returncode, trained.stderr) == (2, line)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # about 45 s on 2 cores: six roles of Llama 3 70B
def test_the_issue_53_dry_run_at_1024_ranks_finishes_through_the_front_door():
    done = plan_cli(["plan.dry_run=true", "plan.world_size=1024", "plan.nodes=128", "model=llama", "model.flavor=70b",
                     "data=text", "parallel=hybrid", "parallel.tp=8", "parallel.pp=8", "parallel.dp_shard=16",
                     "parallel.n_microbatches=8"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "6 roles" in done.stdout and "state bytes equal the planner's" in done.stdout, done.stdout
