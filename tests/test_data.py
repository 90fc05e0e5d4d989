"""Data pipeline and load balance: samplers cover every sample once, resume exactly, balance
ranks; per-rank batch sizes and packing keep the arithmetic of one process."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from framework.data.datasets import PackedSequences, VarlenSequences, VarlenShape
from framework.data.samplers import BatchSizes, length_grouped_sampler, token_budget_sampler, weighted_sampler
from framework.run.sweep import run_configs
from models import GPT
from tests.helpers import losses, run_workers, world_config

LENGTHS = VarlenSequences(VarlenShape(1000, 32, 4, 4, 128, 24), seed=0).lengths.tolist()


def samplers(world: int, kind: str):
    if kind == "length_grouped":
        return [length_grouped_sampler(LENGTHS, world, r, 1, BatchSizes(8 * world)) for r in range(world)]
    if kind == "token_budget":
        return [token_budget_sampler(LENGTHS, 512, world, r, seed=1) for r in range(world)]
    sizes = [5, 3, 1][:world]
    return [weighted_sampler(len(LENGTHS), sizes, r, seed=1) for r in range(world)]


@pytest.mark.parametrize("kind", ["length_grouped", "token_budget", "weighted"])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_no_sample_lost_or_duplicated_across_ranks(kind, world):
    per_rank = [list(s) for s in samplers(world, kind)]
    assert len({len(b) for b in per_rank}) == 1  # every rank takes the same number of steps
    seen = [i for batches in per_rank for batch in batches for i in batch]
    assert len(seen) == len(set(seen))  # nothing twice
    # documented drops: the epoch's tail that does not fill a global batch (token_budget: fewer
    # samples than ranks)
    dropped = len(LENGTHS) - len(seen)
    assert 0 <= dropped < {"length_grouped": 8 * world, "token_budget": world, "weighted": sum([5, 3, 1][:world])}[kind]


@pytest.mark.parametrize("world", [2, 3])
def test_the_default_sampler_gives_each_data_parallel_rank_its_own_samples(world):
    """data.sampler=distributed as the config builds it (framework.data.build_sampler): the ranks'
    samples are disjoint and together cover the dataset but the tail that fills no global batch."""
    from framework.data import build_sampler
    from tests.helpers import compose_config

    cfg = compose_config(["experiment=smoke"]).data
    dataset = list(range(60))  # a sampler only asks the dataset's length
    per_rank = [list(build_sampler(cfg, dataset, r, world, seed=3)) for r in range(world)]
    seen = [i for batches in per_rank for batch in batches for i in batch]
    global_batch = cfg.batch_size * world
    assert len(seen) == len(set(seen)) == 60 // global_batch * global_batch, per_rank


@pytest.mark.parametrize("kind", ["length_grouped", "token_budget", "weighted"])
def test_resumed_batch_sampler_continues_exactly(kind):
    full = samplers(2, kind)[1]
    full.set_epoch(2)
    read = sum(len(share) for step in list(full.global_batches())[:5] for share in step)  # the position after 5
    batches = list(full)
    resumed = samplers(2, kind)[1]
    resumed.load_state_dict({"epoch": 2, "start": read})
    assert list(resumed) == batches[5:]
    resumed.set_epoch(3)
    assert list(resumed) != batches  # a new epoch, a new order
    assert full.state_dict()["epoch"] == 2 and full.state_dict()["start"] == 0


def test_token_budget_balances_tokens_per_step():
    a, b = samplers(2, "token_budget")
    for x, y in zip(a, b, strict=True):
        tx, ty = sum(LENGTHS[i] for i in x), sum(LENGTHS[i] for i in y)
        assert max(tx, ty) / ((tx + ty) / 2) <= 1.1
        assert max(len(x), len(y)) * max(LENGTHS[i] for i in x + y) <= 2 * 512  # within budget, padded


def test_packed_gpt_keeps_attention_within_each_sequence():
    torch.manual_seed(0)
    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16).eval()
    a, b = torch.randint(1, 32, (1, 6)), torch.randint(1, 32, (1, 10))
    packed = model(torch.cat([a, b], 1), torch.tensor([[0] * 6 + [1] * 10]))
    assert torch.allclose(packed[:, :6], model(a), atol=1e-5)
    assert torch.allclose(packed[:, 6:], model(b), atol=1e-5)  # positions restart, no attention to a


def test_packing_masks_the_loss_at_boundaries():
    base = VarlenSequences(VarlenShape(50, 32, 4, 4, 20, 8), seed=0, task="lm")
    packed = PackedSequences(base, block_len=32, seed=0)
    (tokens, docs), target = packed[0]
    boundary = torch.nonzero(docs[1:] != docs[:-1]).flatten()
    assert len(boundary) > 0 and (target[boundary] == -100).all()
    kept = target[:-1] != -100
    assert torch.equal(target[:-1][kept], tokens[1:][kept])  # elsewhere: the next token of the same sequence
    assert PackedSequences.tokens_in(((tokens[None], docs[None]), target[None])) == 32 - len(boundary)


def config(overrides: list[str], world: int) -> dict:
    return world_config(["logger=none", "steps=5", *overrides], world)


def test_per_rank_batch_sizes_update_like_one_process_on_the_union_batch(tmp_path):
    from framework.run.trainer import run

    args = ["experiment=smoke", "optim.grad_clip=0"]
    got = run_configs({"ddp_6_2": config([*args, "data.rank_batch_sizes=[6,2]"], 2)}, 2, str(tmp_path))
    balance = got["ddp_6_2"]["load_balance"]
    assert balance["work_per_rank"][0] == 3 * balance["work_per_rank"][1]
    assert balance["imbalance"] == pytest.approx(1.5) and balance["max_imbalance"] == pytest.approx(
        1.5
    )  # 6 / mean(6, 2)
    ref_dir = tmp_path / "ref"
    run(OmegaConf.create(config([*args, "parallel=none", "data.batch_size=8"], 1)), str(ref_dir), {})
    for a, b in zip(losses(tmp_path / "ddp_6_2"), losses(ref_dir), strict=True):
        assert abs(a - b) / b <= 1e-5


def test_token_losses_are_token_weighted_like_one_process_on_the_union_batch(tmp_path):
    """Random variable-length batches give the ranks unequal real tokens. The step's loss and
    gradient are the mean over every real token of the step, as one process on the union of the
    two ranks' batches computes it (the sampler's order does not depend on the world size), not a
    mean of per-rank means; SGD without clipping, so a wrong weighting shows in the losses.
    (Token budgets split each step's tokens evenly, so there a mean of means would agree too.)"""
    from framework.run.trainer import run

    args = ["model=gpt", "data=varlen", "optim=sgd", "optim.lr=0.5", "optim.grad_clip=0", "metrics.sample_every=0"]
    got = run_configs({"ddp": config([*args, "data.batch_size=4"], 2)}, 2, str(tmp_path))
    assert got["ddp"]["load_balance"]["max_imbalance"] > 1.05  # the ranks really hold unequal tokens
    run(OmegaConf.create(config([*args, "data.batch_size=8", "parallel=none"], 1)), str(tmp_path / "ref"), {})
    assert losses(tmp_path / "ddp") == pytest.approx(losses(tmp_path / "ref"), rel=1e-5)


def test_token_budget_and_grouping_cut_imbalance_and_padding(tmp_path):
    varlen = ["model=gpt", "data=varlen", "metrics.sample_every=0"]
    rows = {
        "distributed": [*varlen, "data.batch_size=16"],
        "length_grouped": [*varlen, "data.sampler=length_grouped", "data.batch_size=16"],
        "token_budget": [*varlen, "data.sampler=token_budget", "data.max_tokens=1024"],
        "packed": [*varlen, "data.pack=true", "data.batch_size=4"],
    }
    got = run_configs({k: config(v, 2) for k, v in rows.items()}, 2, str(tmp_path))
    lb = {k: v["load_balance"] for k, v in got.items()}
    assert lb["token_budget"]["imbalance"] <= 1.05
    assert lb["token_budget"]["imbalance"] < lb["distributed"]["imbalance"]
    assert lb["length_grouped"]["padding_waste"] <= 0.05 and lb["packed"]["boundary_waste"] <= 0.05
    assert lb["distributed"]["padding_waste"] > 0.3  # what grouping saves
    for name in rows:  # per-rank compute (forward seconds), measured on both ranks
        assert len(lb[name]["forward_s_per_rank"]) == 2 and min(lb[name]["forward_s_per_rank"]) > 0


def test_load_balance_arithmetic_on_known_work():
    from framework.measure.metrics import load_balance

    # two ranks, three steps: even, 3:1, even; 52 real tokens in 65 positions: 20% padding
    lb = load_balance([[8, 12, 10], [8, 4, 10]], [30, 35], [[0.0, 0.3, 0.1], [0.0, 0.1, 0.1]])
    assert lb["max_imbalance"] == pytest.approx(1.5) and lb["imbalance"] == pytest.approx((1 + 1.5 + 1) / 3)
    assert lb["padding_waste"] == pytest.approx(0.2) and lb["work_per_rank"] == [30, 22]
    assert lb["compute_imbalance"] == pytest.approx((1.5 + 1.0) / 2)  # the first step is left out


def test_loader_workers_do_not_change_the_run(tmp_path):
    rows = {f"workers_{n}": ["experiment=lstm", "steps=3", f"data.num_workers={n}"] for n in (0, 2)}
    got = run_configs({k: config(v, 2) for k, v in rows.items()}, 2, str(tmp_path))
    assert losses(tmp_path / "workers_0") == losses(tmp_path / "workers_2")
    assert got["workers_0"]["global_batch_size"] == got["workers_2"]["global_batch_size"]


def _token_budget_step(rank: int, world: int):
    """One token-budget step through the trainer's own build and forward_backward at 2 ranks (DDP),
    and, on every rank, the same model's gradient on the union of both ranks' batches."""
    from omegaconf import OmegaConf

    from framework.dist import DistInfo, all_gather_object
    from framework.loss import IGNORE_INDEX, cross_entropy
    from framework.measure.metrics import ForwardTimer
    from framework.run.measurements import Measurements
    from framework.run.step import StepInput, forward_backward
    from framework.run.trainer import build

    cfg = OmegaConf.create(config(["model=gpt", "data=varlen", "data.sampler=token_budget", "data.max_tokens=512"], 2))
    info = DistInfo(rank, world, rank, world, torch.device("cpu"), "gloo")
    setup = build(cfg, info)
    step_batches = [next(setup.data.batches())]
    timer = Measurements(meter=None, probe=None, forward_timer=ForwardTimer(info.device), peak_flops=None)
    forward_backward(cfg, info, setup, StepInput(step_batches), timer)
    grads = {n: p.grad.clone() for n, p in setup.par.module.module.named_parameters()}

    torch.manual_seed(cfg.seed)  # the same initial weights, one process, the union batch
    from framework.contract import build_model

    union = build_model(cfg.model, "cpu")
    batches = [b for _, b in all_gather_object(step_batches[0], info)]
    longest = max(b[0][0].size(1) for b in batches)
    pad = lambda t, value: torch.nn.functional.pad(t, (0, longest - t.size(1)), value=value)  # noqa: E731
    inputs = torch.cat([pad(b[0][0], 0) for b in batches])
    target = torch.cat([pad(b[1], IGNORE_INDEX) for b in batches])
    cross_entropy(union(inputs), target).backward()
    tokens = [int((b[1] != IGNORE_INDEX).sum()) for b in batches]
    return grads, {n: p.grad for n, p in union.named_parameters()}, tokens


def test_token_budget_gradients_equal_one_process_on_the_union_batch():
    """A token-budget step at 2 ranks: DDP's gradient equals one process's on the union of the
    two ranks' batches, the mean over every real token of the step. (Token budgets hand each rank
    the same real tokens here, so a mean of per-rank means would agree too; the random-batch test
    above is the one where the weighting decides.)"""
    grads, union, tokens = run_workers(_token_budget_step, 2)[0]
    assert sum(tokens) > 0 and len(tokens) == 2
    for name, g in union.items():
        assert torch.allclose(grads[name], g, rtol=1e-5, atol=1e-7), name
