"""Data at scale: Hugging Face datasets (map-style and streamed) split over ranks and loader
workers, weighted mixtures, a data position counted in samples (resumes across a batch ramp, a
world size, a stream), and the curriculum (sequence-length warm-up, batch ramp)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from framework.data import build_data
from framework.data.mixture import Mixture, blend
from tests.helpers import compose_config, read_metrics, read_summary, train_cli, train_in_process

TINY_GPT = ["model=gpt", "model.n_layer=1", "model.n_head=2", "model.n_embd=32", "model.dropout=0.0", "progress=false"]


def write_rows(folder: Path, n: int = 120) -> dict[str, Path]:
    """The same rows as a parquet folder (three files) and a JSON-lines file: each row's tokens
    begin with its id (two ids in 1..250), then 1-20 filler tokens; its text says its id."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": i, "tokens": [i % 250 + 1, i // 250 + 1] + [7] * (1 + i % 20), "text": f"row {i}. " * (3 + i % 4)}
            for i in range(n)]  # fmt: skip
    (folder / "parquet").mkdir(parents=True, exist_ok=True)
    for k in range(3):
        part = rows[k::3]
        pq.write_table(pa.table({key: [r[key] for r in part] for key in rows[0]}), folder / "parquet" / f"{k}.parquet")
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"parquet": folder / "parquet", "json": folder / "rows.jsonl"}


def epoch_ids(overrides: list[str], world: int) -> list[list[int]]:
    """The row ids each data-parallel rank reads in epoch 0 (the pipeline as training builds it)."""
    cfg = compose_config(["model=gpt", "data=hf", "data.tokens_column=tokens", "data.vocab_size=256", *overrides])
    per_rank = []
    for rank in range(world):
        batches, ids = build_data(cfg.data, (rank, world), torch.device("cpu"), 0, "lm").batches(), []
        for epoch, (inputs, _) in batches:
            if epoch > 0:
                break
            ids += [(a - 1) + 250 * (b - 1) for a, b in inputs[0][:, :2].tolist()]
        per_rank.append(ids)
    return per_rank


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streamed"])
def test_every_row_is_read_once_an_epoch_over_ranks_and_loader_workers(tmp_path, streaming):
    """A parquet folder and a JSON-lines file, 2 data-parallel ranks x 2 loader workers each: the
    ranks read disjoint rows that together are every row (120 divide into global batches of 8),
    a stream in windows of 32 shuffled rows."""
    for fmt, path in write_rows(tmp_path).items():
        args = [f"data.path={path}", f"data.streaming={streaming}", "data.num_workers=2", "data.batch_size=4",
                "data.seq_len=16", "data.shuffle_buffer=32"]  # fmt: skip
        per_rank = epoch_ids(args, 2)
        seen = [i for ids in per_rank for i in ids]
        assert sorted(seen) == list(range(120)), (fmt, streaming, per_rank)
        assert seen != sorted(seen)  # shuffled


def test_a_mixture_draws_its_weights_deterministically():
    """Every prefix of a 0.7/0.3 mixture's order holds each source within one sample of its share;
    the same seed gives the same order, another seed another; a small source repeats, reshuffled."""
    sources, _ = blend([500, 100], [0.7, 0.3])
    for n in range(1, 600):
        assert abs(sources[:n].count(1) - 0.3 * n) <= 1
    mix = Mixture([list(range(500)), list(range(100))], ["a", "b"], [0.7, 0.3])
    order = mix.order(seed=1, epoch=0)
    assert order == mix.order(seed=1, epoch=0) and order != mix.order(seed=2, epoch=0)
    b = [i - 500 for i in order if i >= 500]
    assert len(b) == 180 and sorted(b[:100]) == list(range(100)) and b[:80] != b[100:180]  # read through, then anew


def test_a_mixture_trains_with_its_shares_logged(tmp_path):
    """200 steps of 0.7/0.3 from a parquet folder and a JSON-lines file: the drawn shares are
    within 2 points of the weights (in metrics.jsonl each step, and in the summary)."""
    paths = write_rows(tmp_path)
    mixture = f"data.sources=[{{path: {paths['parquet']}, weight: 0.7}}, {{path: {paths['json']}, weight: 0.3}}]"
    args = [*TINY_GPT, "data=hf", mixture, "data.seq_len=16", "data.batch_size=8", "steps=200", "parallel=none",
            "metrics.sample_every=0", "checkpoint.every=0"]  # fmt: skip
    proc = train_cli(args, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, summary = read_metrics(tmp_path / "run"), read_summary(tmp_path / "run")["sources"]
    assert set(summary) == {"parquet", "rows"}
    assert abs(summary["parquet"]["share"] - 0.7) <= 0.02 and abs(summary["rows"]["share"] - 0.3) <= 0.02
    assert sum(m["sources"]["rows"]["samples"] for m in metrics) == summary["rows"]["samples"]
    assert all(m["sources"]["parquet"]["samples"] + m["sources"]["rows"]["samples"] == 8 for m in metrics)
    assert summary["rows"]["tokens"] == sum(m["sources"]["rows"]["tokens"] for m in metrics) > 0


# ----------------------------------------------------------------------------- resume and curriculum

# a stream of 240 rows of at least 17 tokens (every sequence fills its length), ddp x2 with 2 loader
# workers each; 4 samples of 8 tokens a step, 16 tokens from step 3 (index 2), 8 samples from step 4
CURRICULUM = ["data=hf", "data.tokens_column=tokens", "data.vocab_size=256", "data.streaming=true",
              "data.shuffle_buffer=64", "data.seq_len=16", "data.seq_len_schedule=[[0,8],[2,16]]",
              "data.batch_schedule=[[0,4],[3,8]]", "steps=6", "checkpoint.every=2", "schedule.warmup_steps=2",
              "metrics.sample_every=0"]  # fmt: skip


@pytest.fixture(scope="module")
def curriculum(tmp_path_factory):
    """The uninterrupted run (ddp x2, streamed, 2 loader workers a rank), one process on the same
    global batches, the run resumed at step 2 (before both ramps) and at step 4 on 4 ranks."""
    root = tmp_path_factory.mktemp("curriculum")
    rows = write_rows(root, 240)["parquet"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    for f in rows.iterdir():  # every row at least 17 tokens
        table = pq.read_table(f)
        padded = pa.array([r + [9] * 17 for r in table.column("tokens").to_pylist()])
        pq.write_table(table.set_column(table.schema.get_field_index("tokens"), "tokens", padded), f)
    base = [*TINY_GPT, *CURRICULUM, f"data.path={rows}"]
    runs = {
        "full": [*base, "parallel=ddp", "launch.nproc_per_node=2", "data.num_workers=2"],
        "one": [*base, "parallel=none"],
    }
    for name, args in runs.items():
        proc = train_cli(args, root / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = root / "full" / "checkpoints"
    resumed = {
        "at2": [*runs["full"], f"checkpoint.resume={ckpt / 'step-000002'}"],
        "at4_x4": [*base, "parallel=ddp", "launch.nproc_per_node=4", f"checkpoint.resume={ckpt / 'step-000004'}"],
    }
    for name, args in resumed.items():
        proc = train_cli(args, root / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return {name: read_metrics(root / name) for name in [*runs, *resumed]} | {"root": root}


def test_the_curriculum_takes_effect_at_its_steps(curriculum):
    """Tokens a step: 4 x 8, 4 x 8, 4 x 16 (the length from step 3), then 8 x 16 (the batch from 4)."""
    tokens = [round(m["tokens_per_s"] * m["step_time_s"]) for m in curriculum["full"]]
    assert tokens == [32, 32, 64, 128, 128, 128]
    # MFU counts a token's FLOPs at the length in force: attention over 16 positions costs more than over 8
    per_token = [m["mfu"] / m["tokens_per_s"] for m in curriculum["full"]]
    assert per_token[0] == pytest.approx(per_token[1]) and per_token[2] == pytest.approx(per_token[5])
    assert per_token[2] > per_token[0] * 1.001


def test_a_stream_on_two_ranks_and_workers_trains_as_one_process(curriculum):
    """ddp x2 with 2 loader workers each reads the global batches one process reads."""
    full, one = [m["loss"] for m in curriculum["full"]], [m["loss"] for m in curriculum["one"]]
    assert full == pytest.approx(one, rel=1e-5)


def test_a_resume_mid_ramp_on_a_stream_is_bitwise(curriculum):
    """Resumed at step 2 (the stream's position in samples, before the length and batch ramps)."""
    want = {m["step"]: m["loss"] for m in curriculum["full"]}
    got = curriculum["at2"]
    assert [m["step"] for m in got] == [3, 4, 5, 6]
    assert [m["loss"] for m in got] == [want[m["step"]] for m in got]


def test_a_resume_at_another_world_size_reads_on_from_the_next_sample(curriculum):
    """Saved at step 4 on 2 ranks, resumed on 4 (2 samples a rank): the next global batches are
    the uninterrupted run's, so the losses follow it (the ranks' sums differ in the last bits)."""
    want = {m["step"]: m["loss"] for m in curriculum["full"]}
    got = curriculum["at4_x4"]
    assert [m["step"] for m in got] == [5, 6]
    assert [m["loss"] for m in got] == pytest.approx([want[5], want[6]], rel=1e-5)


def test_a_mixture_and_a_curriculum_are_refused_where_they_cannot_run():
    from framework.config import ConfigError, validate

    cases = {  # 5 samples over 2 ranks; longer than data.seq_len; a mixture of length-grouped batches
        "data.batch_schedule": ["data.batch_schedule=[[0,5]]", "launch.nproc_per_node=2", "parallel=ddp"],
        "data.seq_len_schedule": ["data.seq_len_schedule=[[0,256]]", "parallel=none"],
        "data.sources": ["data=varlen", "data.sources=[{num_samples: 100}]", "data.sampler=length_grouped",
                         "parallel=none"],
    }  # fmt: skip
    for key, args in cases.items():
        with pytest.raises(ConfigError) as err:
            validate(compose_config(["model=gpt", *args]))
        assert err.value.key == key and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streamed"])
def test_a_text_column_with_empty_rows_trains_to_the_end(tmp_path, streaming, capsys):
    """data=hf as documented: a text column tokenized on the fly. Three rows in four are empty or
    blank (wikitext has a third), so unfiltered, some batches would hold nothing to predict: those
    rows are left out (counted where the dataset is map-style), and the run trains to the end."""
    rows = [{"text": f"row {i}: " + "some words here. " * (1 + i % 5) if i % 4 == 0 else ("" if i % 8 else "   ")}
            for i in range(240)]  # fmt: skip
    path, val = tmp_path / "rows.jsonl", tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    val.write_text("".join(json.dumps(r) + "\n" for r in rows[:40]))
    run = tmp_path / "run"
    args = [*TINY_GPT, "data=hf", f"data.path={path}", f"data.streaming={streaming}", "data.seq_len=32",
            "data.batch_size=8", "data.shuffle_buffer=64", "steps=12", f"data.val_path={val}", "eval.every=6"]  # fmt: skip
    summary = train_in_process(args, run)
    assert len(read_metrics(run)) == 12 and all(m["loss"] == m["loss"] and m["loss"] < 10 for m in read_metrics(run))
    # validated on data.val_path, as data.md says (a stream holds nothing out)
    assert [m["step"] for m in read_metrics(run) if m.get("val_loss") is not None] == [6, 12]
    assert summary["data"]["rows_left_out"] == (None if streaming else 180)
    assert ("data: 180 of 240 rows" in capsys.readouterr().out) != streaming


def test_a_missing_source_and_a_file_of_another_format_are_one_line_before_any_worker(tmp_path):
    from framework.config import ConfigError, validate

    paths = write_rows(tmp_path)
    (tmp_path / "fake.parquet").write_text("not parquet at all\n")
    cases = {
        "data.sources[1].path": [f"data.sources=[{{path: {paths['json']}}}, {{path: {tmp_path / 'gone.jsonl'}}}]"],
        "data.sources[0].text_column": [f"data.sources=[{{path: {paths['json']}, text_column: txt}}]"],
        "data.path": [f"data.path={tmp_path / 'fake.parquet'}", "data.format=parquet"],
        # validation: a stream holds nothing out; a file of its own reads as data.path does
        "data.val_fraction": [f"data.path={paths['json']}", "data.streaming=true", "data.val_fraction=0.1"],
        "data.val_path": [f"data.path={paths['json']}", f"data.val_path={tmp_path / 'gone.jsonl'}"],
        "eval": [f"data.path={paths['json']}", "data.streaming=true", "eval.every=2"],
    }
    for key, args in cases.items():
        with pytest.raises(ConfigError) as err:
            validate(compose_config(["model=gpt", "data=hf", "parallel=none", *args]))
        assert err.value.key == key and "\n" not in str(err.value), (key, str(err.value))


@pytest.mark.parametrize("streaming", [False, True], ids=["map-style", "streamed"])
def test_data_whose_every_row_is_empty_is_one_line_not_a_hang(tmp_path, streaming):
    """Every row empty or blank: nothing to train on. A map-style dataset says so as its sampler
    is built, counting the rows left out; a stream, whose size is unknown ahead, at the end of its
    first epoch (it looped forever, reading the file again and again)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": "" if i % 2 else " "}) + "\n" for i in range(50)))
    cfg = compose_config(
        ["model=gpt", "data=hf", f"data.path={path}", f"data.streaming={streaming}", "data.seq_len=16"]
    )
    from framework.data import DataError

    with pytest.raises(DataError) as err:  # the launcher's one line (a plain ValueError is a traceback)
        next(build_data(cfg.data, (0, 1), torch.device("cpu"), 0, "lm").batches())
    message = str(err.value)
    assert "\n" not in message and message.startswith("data.batch_size" if not streaming else "data.path"), message
    assert ("50 rows with no token to predict" in message) != streaming and "empty" in message, message
    if streaming:  # through train.py under ddp x2: the workers' one line, no traceback
        run = train_cli([*TINY_GPT, "parallel=ddp", "steps=2", f"data.path={path}", "data=hf", "data.streaming=true",
                         "data.seq_len=16"], tmp_path / "run")  # fmt: skip
        assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
        assert f"error: {message}" in run.stderr, run.stderr[-2000:]
