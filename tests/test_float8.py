"""Float8 training as a model converter (`converters=[float8]`, framework/converters/float8.py),
emulated on this CPU: each recipe under fsdp x2 (its weights all-gathered in float8, and not), tp
x2, pp x2, cp x2 and hybrid (dp_shard 2 x tp 2) equals one process's float8 run within the
matrix's noise floor, measured for float8 as the matrix measures every other arithmetic (one
process's own training summed in other orders, tests/matrix_run.py); the float8 all-gather moves
half the bytes of the converted weights; a float8 checkpoint resumes bitwise, loads into a run
without float8, and exports a folder transformers loads with the same loss; bad settings are one
line. The tensorwise recipe (the default) runs here; the rowwise recipes and hybrid in the long
tier, and all of them in `python benchmarks/float8.py` (docs/results/float8.md)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers import read_metrics, read_summary, train_cli
from tests.matrix import Cell, Value, models

os.environ.setdefault("HF_HUB_OFFLINE", "1")
F8 = "converters=[float8]"
STRATEGIES = [
    Value("fsdp", ("parallel=fsdp",), world=2),
    Value("fsdp(float8 all-gather off)", ("parallel=fsdp", "converters.float8.fsdp_float8_all_gather=false"), world=2),
    Value("tp", ("parallel=tp",), world=2),
    Value("pp", ("parallel=pp",), world=2),
    Value("cp", ("parallel=cp",), world=2),
]
HYBRID = Value("hybrid(dp_shardxtp)", ("parallel=hybrid", "parallel.dp_shard=2", "parallel.tp=2", "parallel.pp=1",
                                       "parallel.cp=1", "parallel.dp_replicate=1"), world=4)  # fmt: skip
LLAMA = ["model=llama", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
         "model.ffn_hidden=64", "data.seq_len=16", "data.max_bytes=20000", "progress=false"]  # fmt: skip


def recipe_feature(recipe: str) -> Value:
    settings = (F8, f"converters.float8.recipe={recipe}")
    return Value(f"float8 {recipe}", settings, reference=settings)


def cells(recipes: tuple[str, ...], strategies: list[Value]) -> list[Cell]:
    gpt = next(m for m in models() if m.name == "gpt")
    return [Cell(gpt, s, recipe_feature(r)) for r in recipes for s in strategies]


DEFAULT = cells(("tensorwise",), STRATEGIES)
LONG = cells(("rowwise", "rowwise_with_gw_hp"), STRATEGIES) + cells(("tensorwise", "rowwise", "rowwise_with_gw_hp"),
                                                                     [HYBRID])  # fmt: skip


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """Every collected cell of this module, run in one go as the matrix runs its cells."""
    from tests.matrix_run import run_cells

    wanted = {}
    for item in request.session.items:
        cell = getattr(item, "callspec", None) and item.callspec.params.get("cell")
        if item.module is request.module and isinstance(cell, Cell):
            wanted[cell.id] = cell
    return run_cells(list(wanted.values()), tmp_path_factory.mktemp("float8"))


def assert_parity(outcomes: dict, cell: Cell) -> None:
    kind, detail, figures = outcomes[cell.id]
    assert kind == "parity", f"{cell.id}: {kind}: {detail}"
    assert figures["floor"] > 2.0**-24 or cell.feature.name.startswith("float8 rowwise"), figures  # float8 moved it


@pytest.mark.parametrize("cell", DEFAULT, ids=[c.id for c in DEFAULT])
def test_tensorwise_float8_equals_one_process(outcomes, cell):
    assert_parity(outcomes, cell)


@pytest.mark.slow
@pytest.mark.parametrize("cell", LONG, ids=[c.id for c in LONG])
def test_rowwise_recipes_and_hybrid_equal_one_process(outcomes, cell):
    assert_parity(outcomes, cell)


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    """gpt under fsdp x2 in bf16, with float8 (all-gather in float8) and without: one multirun."""
    folder = tmp_path_factory.mktemp("pair")
    args = ["-m", "experiment=smoke", "steps=3", "parallel=fsdp", "precision=bf16", "progress=false",
            "converters=[],[float8]", f"hydra.sweep.dir={folder}"]  # fmt: skip
    proc = train_cli(args, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = {bool(read_summary(d).get("converters")): d for d in folder.iterdir() if (d / "summary.json").exists()}
    return runs[False], runs[True], proc.stdout


def test_float8_all_gather_moves_half_the_converted_weights_bytes(bf16_pair):
    """The comm counter's all-gather payload a step: each converted weight is gathered twice (forward,
    and backward after resharding), 2 bytes an element in bf16; in float8 those gathers move 0.5x
    (±5%) of that. What stays in bf16 (embeddings, norms, the head) moves the same bytes in both."""
    plain, float8 = (read_summary(d) for d in bf16_pair[:2])
    gathered = {name: s["comm_by_op"]["all_gather"]["mean_bytes"] for name, s in (("bf16", plain), ("f8", float8))}
    converted = float8["converters"]["float8"]["elements"]
    in_bf16 = 2 * 2 * converted  # two gathers of 2 bytes an element
    in_float8 = in_bf16 - (gathered["bf16"] - gathered["f8"])
    assert abs(in_float8 / in_bf16 - 0.5) <= 0.025, (gathered, converted)
    assert gathered["f8"] < 0.7 * gathered["bf16"]  # the whole step's gathers, the bf16 rest included
    assert plain["comm_by_op"]["reduce_scatter"] == float8["comm_by_op"]["reduce_scatter"]  # gradients: as before
    summary = float8["converters"]["float8"]
    assert summary["fsdp_float8_all_gather"] and summary["emulated"] and summary["recipe"] == "tensorwise"
    assert 0.5 < summary["flops_share"] < 1, summary  # the blocks' linears; not the head, nor attention's scores
    assert plain["converters"] is None


def test_the_run_says_it_emulates_in_one_line(bf16_pair):
    lines = [line for line in bf16_pair[2].splitlines() if line.startswith("float8:")]
    assert lines == [
        "float8: tensorwise, 12 linears, weights all-gathered in float8; 1 kept in high precision (the output "
        "head); emulated: this device has no float8 matmul (the numerics are float8's, the speed is not)"
    ], lines


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A float8 Llama under fsdp x2, 6 steps, a checkpoint every 3, exported at the end."""
    run = tmp_path_factory.mktemp("float8") / "full"
    proc = train_cli([*LLAMA, F8, "parallel=fsdp", "steps=6", "checkpoint.every=3", "checkpoint.export=true"], run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_a_float8_checkpoint_resumes_bitwise_and_loads_into_a_bf16_run(saved, tmp_path):
    at3 = saved / "checkpoints" / "step-000003"
    same = tmp_path / "same"
    proc = train_cli([*LLAMA, F8, "parallel=fsdp", "steps=6", f"checkpoint.resume={at3}"], same)
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = {m["step"]: m["loss"] for m in read_metrics(saved)}
    assert [(m["step"], m["loss"]) for m in read_metrics(same)] == [(s, want[s]) for s in (4, 5, 6)]
    plain = tmp_path / "plain"  # the same weights in a bf16 run without float8: a Linear's state is a Float8Linear's
    proc = train_cli([*LLAMA, "parallel=ddp", "precision=bf16", "steps=4", f"checkpoint.resume={at3}"], plain)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = read_metrics(plain)[0]
    assert first["step"] == 4 and abs(first["loss"] - want[4]) / want[4] < 0.02  # float8's rounding, not another model


def test_the_export_loads_in_transformers_with_the_same_loss(saved):
    """The exported folder holds the high-precision weights: transformers' fp32 loss on a batch
    equals the framework's Llama loaded from the last checkpoint (fp32, no float8) within 1e-5."""
    transformers = pytest.importorskip("transformers")
    from framework.checkpoint.export import checkpoint_tensors, read_tensor
    from framework.config import compose
    from framework.contract import build_model

    exported = transformers.AutoModelForCausalLM.from_pretrained(saved / "hf", torch_dtype=torch.float32).eval()
    ckpt = str(sorted((saved / "checkpoints").glob("step-*"))[-1])
    state = {n: read_tensor(ckpt, n, *meta) for n, meta in checkpoint_tensors(ckpt).items()}
    ours = build_model(compose(LLAMA).model, "cpu").eval()
    ours.load_state_dict(state, strict=False)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = exported(tokens, labels=tokens).loss
        logits = ours(tokens)
        mine = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
        )
    assert abs(theirs.item() - mine.item()) <= 1e-5 * abs(mine.item()), (theirs.item(), mine.item())
    assert json.loads((saved / "hf" / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.parametrize(
    "args, key",
    [
        (["converters.float8.filter_fqns=[nothing_here]"], "converters.float8.filter_fqns"),
        (["model=lstm", "data=varlen"], "converters.float8"),  # its one linear is the head
        (["converters.float8.recipe=rowwise", "converters.float8.fsdp_float8_all_gather=true"],
         "converters.float8.fsdp_float8_all_gather"),
        (["compile=true"], "compile"),
    ],
)  # fmt: skip
def test_a_bad_float8_setting_names_its_key(args, key):
    from framework.config import ConfigError, compose, validate

    with pytest.raises(ConfigError) as err:
        validate(compose(["experiment=smoke", F8, *args]))
    assert str(err.value).startswith(f"{key}: ") and "\n" not in str(err.value), str(err.value)


def test_a_bad_recipe_is_one_line_exit_2_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    proc = train_cli(["experiment=smoke", F8, "converters.float8.recipe=blockwise"], run)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "error: converters.float8.recipe: got 'blockwise'; torchao's recipes: tensorwise, rowwise, rowwise_with_gw_hp"
    ), proc.stderr
    assert not run.exists()
