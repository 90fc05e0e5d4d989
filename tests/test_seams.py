"""Where two features meet: the seams issue 34 found, each shown on the smallest case that has it."""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

from framework.checkpoint import resume
from framework.checkpoint import store as checkpoint
from framework.dist import DistInfo

ONE = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend=None)


def fake_checkpoint(root, step: int) -> str:
    """A folder that a finished save leaves (`.metadata` and `trainer.json`): enough for
    checkpoint.verify=off, which is all the ordering below reads."""
    path = checkpoint.step_dir(str(root), step)
    os.makedirs(path)
    for name in (".metadata", checkpoint.TRAINER_FILE):
        open(os.path.join(path, name), "w").close()
    return path


def test_checkpoints_are_ordered_by_step_past_a_million_and_pruning_keeps_the_newest(tmp_path):
    for step in (999_000, 999_500, 1_000_000, 1_000_500):
        fake_checkpoint(tmp_path, step)
    assert checkpoint.latest(str(tmp_path)).endswith("step-1000500")
    checkpoint.prune(str(tmp_path), keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step-1000000", "step-1000500"]


def test_an_elastic_restart_continues_from_the_newest_save_not_from_checkpoint_resume(tmp_path, monkeypatch):
    start = fake_checkpoint(tmp_path / "earlier-run", 1_000)
    for step in (1_500, 4_000):
        fake_checkpoint(tmp_path / "run", step)
    cfg = OmegaConf.create({"checkpoint": {"verify": "off", "resume": start}})
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resume.choose(cfg, str(tmp_path / "run"), ONE)[0] == start  # the first attempt starts where asked
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume.choose(cfg, str(tmp_path / "run"), ONE)[0].endswith("step-004000")
    empty = tmp_path / "fresh"  # a restart before this run saved anything goes back to where it began
    assert resume.choose(cfg, str(empty), ONE)[0] == start


def _save_step_15(rank: int, world: int, root: str, slow: str) -> str | None:
    """Every rank saves step 15. Rank 0 is slow (`slow`: before it looks for an earlier attempt's
    folder, or while it moves one aside), so a rank that did not wait for it would go first."""
    import time

    from torch import nn

    if rank == 0:
        name = {"check": "wait", "move": "move_aside"}[slow]
        owner = checkpoint.Checkpointer if slow == "check" else checkpoint
        original = getattr(owner, name)

        def slowly(*args):
            time.sleep(1.5)
            return original(*args)

        setattr(owner, name, slowly)
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    options = OmegaConf.create({"keep_last": 0, "async_save": False, "verify": "full", "on_error": "stop"})
    state = checkpoint.TrainerState(15, {}, {}, {}, {"parallel": "ddp", "world_size": world, "dp_size": world})
    checkpoint.Checkpointer(root, rank, options).save(15, model, optimizer, state, {})
    info = DistInfo(rank, world, rank, world, torch.device("cpu"), "gloo")
    return resume.verify(checkpoint.step_dir(root, 15), "full", info)


@pytest.mark.parametrize("stale", [False, True], ids=["fresh", "over-an-earlier-attempt"])
def test_a_save_agrees_on_its_folder_before_any_rank_writes(tmp_path, stale):
    from tests.helpers import run_workers

    if stale:
        (tmp_path / "step-000015").mkdir()
        (tmp_path / "step-000015" / "rng-rank0.pt").write_bytes(b"an earlier attempt")
    problems = run_workers(_save_step_15, 2, str(tmp_path), "move" if stale else "check")
    assert problems == {0: None, 1: None}  # the new checkpoint verifies: every rank's files are in it
    aside = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("superseded"))
    assert aside == (["superseded-step-000015"] if stale else [])  # only a real earlier attempt is moved
    if stale:
        assert sorted(os.listdir(tmp_path / "superseded-step-000015")) == ["rng-rank0.pt"]


def test_token_budget_resume_is_checked_on_what_decides_the_batches():
    """With 400 samples, 2 ranks x 200 tokens and 4 ranks x 100 tokens (the same tokens a step)
    pack other global batches from the first one on; the resume check tells them apart."""
    from framework.data import global_batch
    from framework.data.samplers import TokenBudgetBatchSampler

    lengths = [int(n) for n in torch.randint(8, 64, (400,), generator=torch.Generator().manual_seed(0))]

    def first_global_batch(max_tokens: int, world: int) -> list[int]:
        ranks = [
            TokenBudgetBatchSampler(lengths, max_tokens, world, r, seed=0).epoch_batches()[0][r] for r in range(world)
        ]
        return sorted(i for rank in ranks for i in rank)

    assert first_global_batch(200, 2) != first_global_batch(100, 4)
    cfg = OmegaConf.create({"rank_batch_sizes": None, "sampler": "token_budget", "max_tokens": 200})
    assert global_batch(cfg, 2) != global_batch(OmegaConf.merge(cfg, {"max_tokens": 100}), 4)
