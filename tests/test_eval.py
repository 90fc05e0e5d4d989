"""Evaluation (issue 21): the validation split, val_loss under every strategy equal to one
process's, training untouched by evaluation, the best checkpoint and resume=best, early stopping,
and the evaluate / generate commands. Strategy runs share one group of worker processes."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from framework.run.sweep import run_configs
from tests.helpers import (
    ROOT,
    compose_config,
    is_png_with_content,
    losses,
    read_metrics,
    read_summary,
    train_cli,
    world_config,
)

STEPS = 3
GPT = ["experiment=smoke", "logger=none", f"steps={STEPS}", "model.n_layer=4", "data.max_bytes=40000",
       "data.val_fraction=0.1", f"eval.every={STEPS}", "eval.at_start=true", "metrics.sample_every=0"]  # fmt: skip
# 70 vectors, 7 held out: 7 on 2 ranks does not divide (rank 1 pads with a repeat that must not count)
MLP = ["experiment=mlp", "logger=none", f"steps={STEPS}", "data.num_samples=70", "data.val_fraction=0.1",
       f"eval.every={STEPS}", "eval.at_start=true", "metrics.sample_every=0"]  # fmt: skip
TOL = 1e-5

WORLD2 = {
    "ddp": [*GPT, "parallel=ddp", "data.batch_size=4"],
    "fsdp2": [*GPT, "parallel=fsdp", "data.batch_size=4", f"checkpoint.every={STEPS}"],
    "fsdp1": [*GPT, "parallel=fsdp", "parallel.version=1", "data.batch_size=4"],
    "tp": [*GPT, "parallel=tp", "data.batch_size=8"],
    "tp_loss_parallel": [*GPT, "parallel=tp", "parallel.loss_parallel=true", "data.batch_size=8"],
    **{f"pp_{s}": [*GPT, "parallel=pp", f"parallel.schedule={s}", "data.batch_size=8"]
       for s in ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble")},
    "mlp_ddp": [*MLP, "parallel=ddp", "data.batch_size=4", f"checkpoint.every={STEPS}"],
    "mlp_fsdp": [*MLP, "parallel=fsdp", "data.batch_size=4"],
    # dropout on: evaluation must draw nothing from the training's random streams
    "dropout_eval": [*GPT, "parallel=ddp", "data.batch_size=4", "model.dropout=0.2", "eval.every=1"],
    "dropout_no_eval": [*GPT, "parallel=ddp", "data.batch_size=4", "model.dropout=0.2", "eval.every=0",
                        "eval.at_start=false"],  # fmt: skip
}  # fmt: skip
WORLD4 = {
    "hybrid_dp2_tp2": [*GPT, "parallel=hybrid", "data.batch_size=4", "parallel.n_microbatches=2"],
    "hybrid_dp2_pp2": [*GPT, "parallel=hybrid", "parallel.tp=1", "parallel.pp=2", "data.batch_size=4"],
}


def single_process(out, overrides: list[str]) -> dict:
    from framework.run.trainer import run

    cfg = OmegaConf.create(world_config(["parallel=none", "data.batch_size=8", *overrides], 1))
    summary = run(cfg, str(out), {"parallel": "none"})
    assert summary["status"] == "ok"
    return summary


def val_losses(summary: dict) -> list[tuple[int, float]]:
    return [(h["step"], h["loss"]) for h in summary["eval"]["history"]]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    return {"gpt": single_process(out / "gpt", GPT), "mlp": single_process(out / "mlp", MLP)}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    out = tmp_path_factory.mktemp("world2")
    configs = {name: world_config(args, 2) for name, args in WORLD2.items()}
    return out, run_configs(configs, 2, str(out))


def assert_same_val_losses(summary: dict, reference: dict, name: str) -> None:
    got, want = val_losses(summary), val_losses(reference)
    assert [s for s, _ in got] == [s for s, _ in want] == [0, STEPS], name
    for (step, a), (_, b) in zip(got, want, strict=True):
        assert abs(a - b) <= TOL * abs(b), f"{name} step {step}: val_loss {a} vs one process {b}"
    assert summary["eval"]["history"][-1]["terms"] == reference["eval"]["history"][-1]["terms"], name


def test_val_loss_equals_one_process_under_every_strategy_world_2(world2, references):
    out, summaries = world2
    for name, summary in summaries.items():
        if name.startswith("dropout"):
            continue
        reference = references["mlp" if name.startswith("mlp") else "gpt"]
        assert_same_val_losses(summary, reference, name)
        # metrics.jsonl carries the evaluation of the last step; W&B keys are val/...
        last = read_metrics(out / name)[-1]
        assert last["val_loss"] == summary["eval"]["loss"], name
        assert ("val_perplexity" in last) == (not name.startswith("mlp")), name
    gpt = references["gpt"]["eval"]
    assert gpt["history"][-1]["loss"] < gpt["history"][0]["loss"]  # it trains: not a comparison of constants
    assert gpt["perplexity"] == pytest.approx(math.exp(gpt["loss"]))


def test_an_uneven_validation_split_counts_every_sample_once(world2, references):
    _, summaries = world2
    assert references["mlp"]["eval"]["history"][-1]["terms"] == 7
    for name in ("mlp_ddp", "mlp_fsdp"):  # 7 samples on 2 ranks: 4 + 3 and one masked repeat
        assert summaries[name]["eval"]["history"][-1]["terms"] == 7
        assert summaries[name]["eval"]["accuracy"] == pytest.approx(references["mlp"]["eval"]["accuracy"])


def test_evaluation_leaves_training_bitwise_unchanged(world2):
    out, summaries = world2
    with_eval, without = losses(out / "dropout_eval"), losses(out / "dropout_no_eval")
    assert with_eval == without and len(with_eval) == STEPS  # exact, dropout 0.2 on
    assert summaries["dropout_eval"]["eval"]["evals"] == STEPS + 1 and summaries["dropout_no_eval"]["eval"] is None


def test_hybrid_val_loss_equals_one_process_world_4(tmp_path, references):
    configs = {name: world_config(args, 4) for name, args in WORLD4.items()}
    for name, summary in run_configs(configs, 4, str(tmp_path)).items():
        assert_same_val_losses(summary, references["gpt"], name)


def test_validation_split_never_overlaps_training():
    from framework.data import build_dataset

    text = compose_config(["experiment=smoke", "data.max_bytes=40000", "data.val_fraction=0.1"]).data
    train, val = build_dataset(text, 0, "lm", "train"), build_dataset(text, 0, "lm", "val")
    full = build_dataset(compose_config(["experiment=smoke", "data.max_bytes=40000"]).data, 0, "lm")
    cut = len(train.data)
    assert len(val.data) == len(full.data) - cut == 4000 and torch.equal(val.data, full.data[cut:])
    last = train[len(train) - 1]  # the last training window's targets end before the held-out region
    assert (len(train) - 1) * train.seq_len + train.seq_len + 1 <= cut and last[1].numel() == train.seq_len
    for overrides in (["experiment=mlp", "data.num_samples=70"], ["experiment=resnet", "data.num_samples=50"],
                      ["experiment=lstm", "data.num_samples=300"]):  # fmt: skip
        cfg = compose_config([*overrides, "data.val_fraction=0.2"]).data
        parts = [build_dataset(cfg, 3, "classify", s) for s in ("train", "val")]
        if hasattr(parts[0], "indices"):  # held-out samples
            ids = [set(p.indices) for p in parts]
        else:  # varlen: by document
            ids = [{bytes(s.to(torch.uint8).tolist()) for s in p.seqs} for p in parts]
        assert not ids[0] & ids[1], overrides
        assert len(parts[1]) == round(0.2 * (len(parts[0]) + len(parts[1]))), overrides
        again = build_dataset(cfg, 3, "classify", "val")  # deterministic
        assert len(again) == len(parts[1]) and str(again[0]) == str(parts[1][0])


def test_best_checkpoint_is_the_argmin_and_resume_best_continues_exactly(tmp_path):
    from framework.run.trainer import run

    base = [*GPT, "schedule=constant", "eval.at_start=false", "eval.every=2", "checkpoint.monitor=val_loss"]
    first = tmp_path / "first"
    run(OmegaConf.create(world_config([*base, "parallel=none", "steps=4"], 1)), str(first), {})
    logged = [(m["step"], m["val_loss"]) for m in read_metrics(first) if "val_loss" in m]
    best_step = min(logged, key=lambda s: s[1])[0]
    assert [s for s, _ in logged] == [2, 4] and read_summary(first)["eval"]["best_step"] == best_step
    assert sorted(p.name for p in (first / "checkpoints" / "best").iterdir()) == [f"step-{best_step:06d}"]
    straight = tmp_path / "straight"  # six steps without stopping: what resuming must reproduce
    run(OmegaConf.create(world_config([*base, "parallel=none", "steps=6"], 1)), str(straight), {})
    resumed = tmp_path / "resumed"
    shutil.copytree(first, resumed)
    proc = train_cli([*base, "parallel=none", "steps=6", "checkpoint.resume=best"], resumed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert losses(resumed) == losses(straight) and len(losses(resumed)) == 6  # exact continuation
    # the resumed run went on from the best so far: its best is still the argmin of everything logged
    logged = [(m["step"], m["val_loss"]) for m in read_metrics(resumed) if "val_loss" in m]
    best_step = min(logged, key=lambda s: s[1])[0]
    assert [s for s, _ in logged] == [2, 4, 6] and read_summary(resumed)["eval"]["best_step"] == best_step
    assert sorted(p.name for p in (resumed / "checkpoints" / "best").iterdir()) == [f"step-{best_step:06d}"]


def test_the_best_checkpoints_saves_are_counted_in_the_summary(tmp_path):
    from framework.run.trainer import run

    base = [*GPT, "parallel=none", "steps=4", "eval.at_start=false", "eval.every=2", "checkpoint.monitor=val_loss"]
    run(OmegaConf.create(world_config(base, 1)), str(tmp_path), {})
    evaluated = [m["val_loss"] for m in read_metrics(tmp_path) if "val_loss" in m]
    improved = sum(loss < min(evaluated[:i], default=math.inf) for i, loss in enumerate(evaluated))
    assert len(evaluated) == 2 and improved >= 1 and len(list((tmp_path / "checkpoints" / "best").iterdir())) == 1
    saves = read_summary(tmp_path)["checkpoint"]  # each improvement saved under best/; no periodic saves
    assert saves["saves"] == saves["best_saves"] == improved and saves["blocking_s"] > 0


def test_patience_stops_every_rank_after_the_same_step(tmp_path):
    run = tmp_path / "run"  # min_delta 100: no evaluation after the first improves; patience 2
    args = [*GPT, "steps=8", "eval.every=1", "eval.patience=2", "eval.min_delta=100", "parallel=ddp"]
    proc = train_cli([*args, "launch.nproc_per_node=2"], run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(run)
    assert summary["status"] == "ok" and summary["stopped_early"] == 3
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3] and summary["eval"]["best_step"] == 1
    # the console says each validation loss and why the run stopped
    evals = [line for line in proc.stdout.splitlines() if line.startswith("eval at step")]
    assert len(evals) == 3 and evals[0].startswith("eval at step 1: val_loss "), proc.stdout[-2000:]
    assert "early stop: no improvement by more than eval.min_delta=100 in eval.patience=2" in evals[2], evals


def module_cli(module: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_evaluate_an_fsdp_checkpoint_as_one_process(world2, tmp_path):
    out, summaries = world2
    proc = module_cli("framework.evaluate", [str(out / "fsdp2")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((out / "fsdp2" / "eval.json").read_text())
    assert got["step"] == STEPS and got["parallel"] == "none" and "loss" in proc.stdout
    assert abs(got["loss"] - summaries["fsdp2"]["eval"]["loss"]) <= TOL * got["loss"]
    # a file given by data.path: consecutive windows at 0, T, 2T, ...; any tool reproduces the mean
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 7)  # 665 bytes: 20 windows of 32 and a dropped tail
    from framework.doors.evaluate import main as evaluate  # the door's main, in this process (a start saved)

    assert evaluate([str(out / "fsdp2"), f"data.path={text}"]) == 0
    got = json.loads((out / "fsdp2" / "eval.json").read_text())
    from framework.doors.generate import open_lm

    model, data = open_lm(str(out / "fsdp2"), [], "cpu")[0], text.read_bytes()
    windows = torch.tensor([list(data[i : i + 33]) for i in range(0, len(data) - 32, 32)])
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten())
    assert got["terms"] == 20 * 32 and got["loss"] == pytest.approx(expected.item(), rel=TOL)


def test_generate_is_greedy_and_deterministic_and_refuses_a_classifier(world2, capsys):
    out, _ = world2
    args = [str(out / "fsdp2"), "--prompt", "def ", "--max-new-tokens", "12", "--temperature", "0"]
    first = module_cli("framework.generate", args)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.startswith("def ")
    from framework.doors.generate import open_lm

    model = open_lm(str(out / "fsdp2"), [], "cpu")[0]
    tokens = list(b"def ")
    with torch.no_grad():
        for _ in range(12):  # the bytes the trained model predicts, one at a time
            tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    assert first.stdout.rstrip("\n") == bytes(tokens).decode("utf-8", errors="replace").rstrip("\n")
    from framework.doors.generate import main as generate  # the refusal: the door's main, in this process

    capsys.readouterr()
    assert generate([str(out / "mlp_ddp"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "language model" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["eval.every=5"], "eval"),  # no validation split
        (["checkpoint.monitor=val_loss"], "checkpoint.monitor"),  # without eval
        (["eval.steps=0", "data.val_fraction=0.1"], "eval.steps"),
        (["data.val_fraction=1.5"], "data.val_fraction"),
        (["eval.patience=2", "data.val_fraction=0.1"], "eval.patience"),
        (["optimize=val_loss"], "optimize"),
    ],
)
def test_bad_eval_settings_name_their_key(overrides, key):
    from framework.config import ConfigError
    from framework.doors.compose import compose_run

    with pytest.raises(ConfigError) as err:
        compose_run(["experiment=smoke", "parallel=none", *overrides])
    assert err.value.key == key


def test_resume_best_without_a_best_checkpoint_exits_2_in_one_line(tmp_path):
    run = tmp_path / "run"
    proc = train_cli(["experiment=smoke", "parallel=none", "logger=none", "checkpoint.resume=best"], run)
    assert proc.returncode == 2 and "checkpoint.resume" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not (run / "metrics.jsonl").exists()


@pytest.mark.slow  # the default run keeps tests/test_sweeps.py's Optuna search
def test_optimize_val_loss_in_a_three_trial_optuna_search(tmp_path):
    sweep = tmp_path / "search"
    proc = train_cli(["hparams_search=lowest_val_loss", "experiment=smoke", "parallel=none", "logger=none",
                      "steps=4", "eval.every=2", "data.max_bytes=40000", "hydra.sweeper.n_trials=3",
                      f"hydra.sweep.dir={sweep}"], timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    best = float((sweep / "optimization_results.yaml").read_text().split("best_value:")[1])
    found = [read_summary(d)["eval"]["loss"] for d in sweep.iterdir() if (d / "summary.json").exists()]
    assert len(found) == 3 and best == pytest.approx(min(found))
    # the sweep report: a val loss column and the validation curves
    assert "val loss" in (sweep / "report.md").read_text() and is_png_with_content(sweep / "val_loss.png")
