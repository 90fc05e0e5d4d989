"""Where two features meet: the seams issue 34 found, each shown on the smallest case that has it."""

from __future__ import annotations

import errno
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


def test_token_budget_resumed_at_another_world_size_reads_every_sample_once():
    """token_budget's global batches depend on the ranks (max_tokens x world); its position counts
    samples of an order that does not, so 2 ranks x 200 tokens resumed at 4 ranks x 100 go on at
    the next unread sample: the epoch reads each sample once, and the 4-rank part is what a 4-rank
    sampler started at that position reads."""
    from framework.data.samplers import token_budget_sampler

    lengths = [int(n) for n in torch.randint(8, 64, (400,), generator=torch.Generator().manual_seed(0))]
    two = token_budget_sampler(lengths, 200, 2, 0, seed=0).global_batches()
    first = [i for _, step in zip(range(6), two, strict=False) for share in step for i in share]
    four = token_budget_sampler(lengths, 100, 4, 0, seed=0)
    four.load_state_dict({"epoch": 0, "start": len(first)})
    rest = [i for step in four.global_batches() for share in step for i in share]
    assert len(first + rest) == len(set(first + rest)) and len(first + rest) > 400 - 4
    for step in four.global_batches():  # within the budget, padded (token_budget's own rule, as in test_data)
        assert max(len(share) for share in step) * max(lengths[i] for share in step for i in share) <= 2 * 100


# ----------------------------------------------------------------------------- generate follows the run's tokenizer


class ScriptedLM(torch.nn.Module):
    """A language model that says `script` after any prompt, one token per call, and records
    the prompt it was given: what generate feeds it and what it makes of its ids are under test."""

    def __init__(self, script: list[int], vocab: int):
        super().__init__()
        self.script, self.vocab, self.prompts = script, vocab, []

    def forward(self, x):
        if not self.prompts:
            self.prompts.append(x[0].tolist())
        said = x.size(1) - len(self.prompts[0])
        logits = torch.zeros(1, x.size(1), self.vocab)
        logits[0, -1, self.script[min(said, len(self.script) - 1)]] = 1.0
        return logits


def run_with_shards(tmp_path, monkeypatch, shards, script: list[int], vocab: int) -> ScriptedLM:
    """A run folder trained on data=tokens from `shards` (its checkpoint holds `model`)."""
    import framework.doors.generate as gen
    from framework.doors.compose import compose_run

    path = fake_checkpoint(tmp_path / "run" / "checkpoints", 4)
    config = compose_run(["model=llama", "data=tokens", f"data.path={shards}", "parallel=none", "device=cpu"])
    checkpoint.write_config(os.path.dirname(path), config)
    model = ScriptedLM(script, vocab)
    monkeypatch.setattr(gen, "build_lm", lambda *_: model)
    return model


def test_generate_on_byte_token_shards_stops_at_the_end_of_document(tmp_path, monkeypatch, capsys):
    from framework.doors.generate import main
    from tests.test_tokens import prepare

    (tmp_path / "doc.txt").write_text("hello there")
    assert prepare(tmp_path / "doc.txt", tmp_path / "shards") == 0
    model = run_with_shards(tmp_path, monkeypatch, tmp_path / "shards", [*b"!!", 256, *b"never"], 257)
    capsys.readouterr()
    assert main([str(tmp_path / "run"), "--prompt", "hi", "--temperature", "0"]) == 0  # was a ValueError
    assert capsys.readouterr().out == "hi!!\n" and model.prompts == [list(b"hi")]


def test_generate_on_bpe_shards_speaks_bpe(tmp_path, monkeypatch, capsys):
    pytest.importorskip("tokenizers")
    from framework.data.tokenizer import tokenizer_of_shards
    from framework.doors.generate import main
    from tests.test_tokens import prepare, text_folder

    text_folder(tmp_path / "in", 20, 800, seed=3)
    assert prepare(tmp_path / "in", tmp_path / "shards", "--tokenizer", "bpe", "--vocab-size", "300") == 0
    tok = tokenizer_of_shards(str(tmp_path / "shards"))
    capsys.readouterr()
    said = tok.encode(" the lazy dog")
    model = run_with_shards(tmp_path, monkeypatch, tmp_path / "shards", [*said, tok.eos_id, *said], tok.vocab_size)
    assert main([str(tmp_path / "run"), "--prompt", "the quick brown fox", "--temperature", "0"]) == 0
    assert model.prompts == [tok.encode("the quick brown fox")]  # BPE ids in, not the prompt's bytes
    assert capsys.readouterr().out == "the quick brown fox the lazy dog\n"


# ----------------------------------------------------------------------------- export keeps an untied head


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("gpt2", True)])
def test_exporting_model_hf_follows_transformers_default_for_ties(tmp_path, model_type, tied):
    """config.json without tie_word_embeddings: LlamaConfig's default is untied (the trained head
    is kept), GPT2Config's tied (the head is left out, as save_pretrained does)."""
    import json

    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from framework.checkpoint.export import write_transformers_hf
    from tests.helpers import write_tiny_llama_config

    folder = write_tiny_llama_config(tmp_path / "config")
    settings = json.loads((folder / "config.json").read_text())
    del settings["tie_word_embeddings"]
    settings["model_type"] = model_type
    (folder / "config.json").write_text(json.dumps(settings))
    cfg = OmegaConf.create({"model": {"name": "hf", "config": str(folder)}, "data": {"name": "text"}})
    state = {"model.embed_tokens.weight": torch.zeros(8, 4), "lm_head.weight": torch.ones(8, 4)}
    write_transformers_hf(cfg, str(tmp_path / "out"), state)
    written = load_file(tmp_path / "out" / "model.safetensors")
    assert ("lm_head.weight" in written) == (not tied)


# ----------------------------------------------------------------------------- prepare reruns with other settings

RERUNS = {
    "dtype": (["--dtype", "uint32"], ["--dtype", "uint16"], "--dtype uint32 (now uint16)"),
    "shard-mb": (["--shard-mb", "0.002"], ["--shard-mb", "0.001"], "--shard-mb 0.002 (now 0.001)"),
    "tokenizer": (["--shard-mb", "0.001"], ["--shard-mb", "0.001", "--tokenizer", "bpe", "--vocab-size", "300"],
                  "--tokenizer bytes (now bpe)"),
}  # fmt: skip


@pytest.mark.parametrize("change", list(RERUNS))
def test_prepare_rerun_with_other_settings_rebuilds_instead_of_reading_old_shards(tmp_path, capsys, change):
    pytest.importorskip("tokenizers")
    from tests.test_tokens import decoded_docs, prepare, text_folder

    first, second, said = RERUNS[change]
    docs = text_folder(tmp_path / "in", 12, 600, seed=5)
    assert prepare(tmp_path / "in", tmp_path / "out", *first) == 0
    (tmp_path / "out" / "shard-00000.bin.tmp").write_bytes(b"an interrupted write")
    capsys.readouterr()
    assert prepare(tmp_path / "in", tmp_path / "out", *second) == 0
    assert decoded_docs(tmp_path / "out") == docs  # the old shards read as the new format are garbage
    err = capsys.readouterr().err
    assert f"holds shards made with {said}; rebuilding them" in err and len(err.strip().splitlines()) == 1
    manifest = OmegaConf.to_container(OmegaConf.load(tmp_path / "out" / "index.json"))
    shards = {p.name for p in (tmp_path / "out").glob("shard-*")}
    assert shards == {s["file"] for s in manifest["shards"]} | {s["file"][:-4] + ".idx" for s in manifest["shards"]}
    capsys.readouterr()
    assert prepare(tmp_path / "in", tmp_path / "out", *second) == 0  # the same settings: nothing rebuilt
    assert "rebuilding" not in capsys.readouterr().err


def test_prepare_rerun_with_a_changed_tokenizer_folder_rebuilds(tmp_path, capsys):
    """--tokenizer FOLDER was recorded by its path: another tokenizer saved into the same folder
    reused shards of the old ids. Its files' content is recorded now."""
    pytest.importorskip("tokenizers")
    import json

    from tokenizers import Tokenizer

    from tests.test_finetune import chat_folder
    from tests.test_tokens import decoded_docs, prepare, text_folder

    docs = text_folder(tmp_path / "in", 12, 600, seed=5)
    chat_folder(tmp_path / "tok")
    flags = ["--tokenizer", str(tmp_path / "tok"), "--shard-mb", "0.001"]
    assert prepare(tmp_path / "in", tmp_path / "out", *flags) == 0
    first = json.loads((tmp_path / "out" / "index.json").read_text())
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    tok.add_special_tokens(["<|another|>"])  # another tokenizer, saved over the first
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    capsys.readouterr()
    assert prepare(tmp_path / "in", tmp_path / "out", *flags) == 0
    assert "rebuilding them" in capsys.readouterr().err
    second = json.loads((tmp_path / "out" / "index.json").read_text())
    assert second["vocab_size"] == first["vocab_size"] + 1 and decoded_docs(tmp_path / "out") == docs
    assert second["tokenizer_digest"] != first["tokenizer_digest"]
    assert prepare(tmp_path / "in", tmp_path / "out", *flags) == 0  # unchanged: nothing rebuilt
    assert "rebuilding" not in capsys.readouterr().err


# ----------------------------------------------------------------------------- a full disk


def fill_the_disk_at(monkeypatch, step: int, error: BaseException) -> None:
    """The save of `step` writes part of a shard, then fails with `error`, and from then on the
    disk has 1 kB free (for the enforce-fail case, which carries no errno: only the space says it)."""
    from framework.checkpoint import space
    from framework.checkpoint.io import VerifiedWriter

    original_write, original_free, full = VerifiedWriter.write_data, space.free_bytes, []

    def write_data(self, plan, planner):
        if str(self.path).endswith(f"step-{step:06d}"):
            full.append(True)
            (self.path / "__0_0.distcp").write_bytes(b"x" * 600)
            raise error
        return original_write(self, plan, planner)

    monkeypatch.setattr(VerifiedWriter, "write_data", write_data)
    monkeypatch.setattr(space, "free_bytes", lambda path: 1000 if full else original_free(path))


@pytest.mark.parametrize(
    "error",
    [OSError(errno.ENOSPC, "No space left on device"),
     RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")],
    ids=["enospc", "enforce-fail"],
)  # fmt: skip
def test_a_save_into_a_full_disk_names_it_removes_its_partial_folder_and_resume_auto_works(
    tmp_path, monkeypatch, error
):
    from framework.checkpoint import space
    from framework.checkpoint.integrity import CheckpointError
    from tests.helpers import train_in_process

    run = ["experiment=smoke", "steps=4", "checkpoint.every=2", "checkpoint.async_save=false"]
    fill_the_disk_at(monkeypatch, 4, error)
    with pytest.raises(CheckpointError) as failed:
        train_in_process(run, tmp_path)
    root = tmp_path / "checkpoints"
    took = space.folder_bytes(str(root / "step-000002")) / 1e6
    assert str(failed.value) == (f"saving checkpoint {root / 'step-000004'} failed: no space left on {root}: "
                                 f"the last checkpoint took {took:.1f} MB, 0.0 MB free (its partial folder is removed)")  # fmt: skip
    assert sorted(os.listdir(root)) == [checkpoint.CONFIG_FILE, "step-000002"]  # no partial folder, no tmp file
    monkeypatch.undo()  # space freed
    summary = train_in_process([*run, "checkpoint.resume=auto"], tmp_path)
    assert summary["status"] == "ok" and checkpoint.latest(str(root)).endswith("step-000004")


def test_a_save_that_would_not_fit_is_refused_before_it_writes(tmp_path, monkeypatch, capsys):
    from torch import nn

    from framework.checkpoint import space
    from framework.checkpoint.integrity import CheckpointError

    model = nn.Linear(100, 100)  # 40 kB of weights; SGD with momentum: as much again after a step
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 100)).sum().backward()
    optimizer.step()
    monkeypatch.setattr(space, "free_bytes", lambda path: 50_000)
    state = checkpoint.TrainerState(1, {}, {}, {}, {"parallel": "none", "world_size": 1, "dp_size": 1})
    options = {"keep_last": 0, "async_save": False, "verify": "full", "on_error": "stop"}
    saver = checkpoint.Checkpointer(str(tmp_path), 0, OmegaConf.create(options))
    with pytest.raises(CheckpointError, match=r"not saved: no space left on .*: a checkpoint takes about 0\.1 MB, "
                                              r"0\.1 MB free"):  # fmt: skip
        saver.save(1, model, optimizer, state, {})
    assert os.listdir(tmp_path) == []  # nothing written
    warn = checkpoint.Checkpointer(str(tmp_path), 0, OmegaConf.create({**options, "on_error": "warn"}))
    assert warn.save(1, model, optimizer, state, {}) is None and warn.failed == 1
    assert "warning: checkpoint" in capsys.readouterr().err


def test_writing_the_run_config_into_a_full_disk_leaves_no_tmp_file(tmp_path, monkeypatch):
    def dump(obj, f, **_):
        f.write("{")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.json, "dump", dump)
    with pytest.raises(OSError, match=f"writing {tmp_path / 'config.json'} failed: no space left on {tmp_path}$"):
        checkpoint.write_config(str(tmp_path), {"seed": 0})
    assert os.listdir(tmp_path) == []


# ----------------------------------------------------------------------------- the run lock without locks, on another clock


def test_a_run_folder_on_a_file_system_without_locks_is_kept_by_the_lease(tmp_path, monkeypatch):
    import fcntl

    from framework.checkpoint import runlock

    def no_locks(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    first = runlock.RunLock(str(tmp_path), "job-1")
    line = first.acquire()  # was the OSError's traceback
    assert line == runlock.no_locks_line(str(tmp_path / runlock.LOCK_FILE)) and "\n" not in line
    assert "without locks" in line and str(tmp_path) in line
    with pytest.raises(runlock.FolderInUse):  # this host, a running holder: live
        runlock.RunLock(str(tmp_path), "job-2").acquire(wait_s=0)
    with pytest.raises(runlock.FolderInUse):
        runlock.RunLock(str(tmp_path), "job-2").share(wait_s=0)
    first.release()
    second = runlock.RunLock(str(tmp_path), "job-2")
    assert second.acquire(wait_s=0) == line  # released: taken, with the same one warning line
    second.release()
    assert [p.name for p in tmp_path.iterdir()] == [runlock.LOCK_FILE]  # no probe file left


def test_a_lease_is_aged_on_the_file_systems_clock_not_this_hosts(tmp_path, monkeypatch):
    """Another host's run renewed its lease just now; this host's clock is an hour ahead of the
    file server's. The lease is fresh: the folder is in use, not taken over."""
    import json
    import time

    from framework.checkpoint import runlock

    lock_file = tmp_path / runlock.LOCK_FILE
    lock_file.write_text(json.dumps({"host": "elsewhere", "pid": 1, "job": "theirs", "since": "now"}))
    real = time.time
    monkeypatch.setattr(runlock.time, "time", lambda: real() + 3600)
    with pytest.raises(runlock.FolderInUse, match="host elsewhere"):
        runlock.RunLock(str(tmp_path), "ours").acquire(wait_s=0)
    os.utime(lock_file, (real() - 2 * runlock.LEASE_S,) * 2)  # renewed two leases ago: gone
    ours = runlock.RunLock(str(tmp_path), "ours")
    assert ours.acquire(wait_s=0).startswith(f"run folder lock: taking over {lock_file} from host elsewhere")
    ours.release()


def _batchnorm_on_half(rank: int, world: int, momentum):
    """One step of a BatchNorm2d made global over the group, on this rank's half of the batch."""
    import torch.distributed as dist

    from framework.parallel.batchnorm import sync_batchnorm

    torch.manual_seed(0)
    x = torch.randn(4 * world, 3, 5, 5) * 3 + 1
    bn = torch.nn.Sequential(torch.nn.BatchNorm2d(3, momentum=momentum))
    torch.nn.init.uniform_(bn[0].weight)
    bn = sync_batchnorm(bn, dist.group.WORLD, torch.device("cpu"))
    mine = x.chunk(world)[rank].clone().requires_grad_()
    (bn(mine) * torch.arange(75.0).view(3, 5, 5)).sum().backward()
    dist.all_reduce(bn[0].weight.grad)
    return {"grad_x": mine.grad, "grad_w": bn[0].weight.grad, **dict(bn[0].named_buffers()), "type": type(bn[0])}


@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_under_data_parallel_normalises_by_the_global_batch(momentum):
    """parallel.sync_batchnorm: two ranks with half a batch each get one process's input and
    weight gradients (summed over ranks, as DDP does) and running statistics; plain BatchNorm's
    per-rank statistics do not (the resnet x ddp cell of the matrix)."""
    from tests.helpers import run_workers

    torch.manual_seed(0)
    x = (torch.randn(8, 3, 5, 5) * 3 + 1).requires_grad_()
    bn = torch.nn.BatchNorm2d(3, momentum=momentum)
    torch.nn.init.uniform_(bn.weight)
    (bn(x) * torch.arange(75.0).view(3, 5, 5)).sum().backward()
    ranks = run_workers(_batchnorm_on_half, 2, momentum)
    assert ranks[0]["type"].__name__ == "GlobalBatchNorm"
    torch.testing.assert_close(torch.cat([ranks[0]["grad_x"], ranks[1]["grad_x"]]), x.grad, rtol=1e-5, atol=1e-5)
    for r in ranks.values():
        torch.testing.assert_close(r["grad_w"], bn.weight.grad, rtol=1e-5, atol=1e-4)
        for name, value in bn.named_buffers():
            torch.testing.assert_close(r[name], value, rtol=1e-5, atol=1e-6)
