"""model=llama against Hugging Face's LlamaForCausalLM (GQA, llama3 rope scaling, tied and untied),
checkpoints in and out in its format, and parity under every strategy. Tiny shapes, no download
(HF_HUB_OFFLINE). Tokenizers, shards and data=tokens: tests/test_tokens.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from models.llama import Llama  # noqa: E402
from models.llama_hf import iter_hf_tensors, to_hf  # noqa: E402
from tests.helpers import read_metrics, read_summary, train_cli  # noqa: E402

VOCAB = 257  # the bytes tokenizer's (256 bytes + end of document)


def hf_model(folder: Path, tie: bool, shard: bool = False, seed: int = 0):
    """A tiny random LlamaForCausalLM (GQA: 8 query heads on 2 key/value heads; llama3 rope
    scaling with a short original context, so most frequencies are scaled), saved to `folder`."""
    torch.manual_seed(seed)
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}  # fmt: skip
    config = transformers.LlamaConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
        vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-5, rope_scaling=rope,
        tie_word_embeddings=tie,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder, max_shard_size="40KB" if shard else "2GB")
    return model


def ours_from(folder: Path) -> Llama:
    from framework.hf import load_pretrained

    model = Llama(hf_config=str(folder)).eval()
    assert load_pretrained(model, str(folder), torch.device("cpu"), model.from_hf_name) == []  # nothing missing
    return model


@pytest.mark.parametrize("tie,shard", [(False, False), (True, True)])
def test_logits_equal_hf_and_import_export_is_bitwise(tmp_path, tie, shard):
    hf = hf_model(tmp_path, tie, shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    ours = ours_from(tmp_path)
    tokens = torch.randint(0, VOCAB, (2, 48))
    with torch.no_grad():
        assert torch.allclose(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=0)
    back = to_hf(ours.state_dict(), ours.args)
    files = dict(iter_hf_tensors(str(tmp_path)))
    assert set(back) == set(files) - ({"lm_head.weight"} if tie else set())
    for name, tensor in files.items():
        if name in back:
            assert torch.equal(back[name], tensor), name


def test_pretrained_mismatch_names_what_differs(tmp_path):
    from framework.hf import load_pretrained

    hf_model(tmp_path, tie=False)
    deeper = Llama(hf_config=str(tmp_path), n_layers=3)
    assert "layers.2.attention.wq.weight" in load_pretrained(deeper, str(tmp_path), torch.device("cpu"),
                                                            deeper.from_hf_name)  # fmt: skip
    narrower = Llama(hf_config=str(tmp_path), ffn_hidden=80)
    with pytest.raises(ValueError) as err:
        load_pretrained(narrower, str(tmp_path), torch.device("cpu"), narrower.from_hf_name)
    message = str(err.value)  # the first that differs, by both names
    assert "mlp.down_proj.weight is [64, 96] in" in message and "feed_forward.w2.weight is [64, 80]" in message


def test_flavours_have_the_published_shapes():
    with torch.device("meta"):
        sizes = {f: sum(p.numel() for p in Llama(flavor=f).parameters()) for f in ("1b", "8b", "70b")}
    assert abs(sizes["1b"] - 1.236e9) / 1.236e9 < 0.01  # Llama 3.2 1B (tied)
    assert abs(sizes["8b"] - 8.03e9) / 8.03e9 < 0.01
    assert abs(sizes["70b"] - 70.6e9) / 70.6e9 < 0.01
    model = Llama(flavor="debug", vocab_size=VOCAB)
    flops = model.flops_per_token(64)
    assert flops > 6 * sum(p.numel() for n, p in model.named_parameters() if "embeddings" not in n)
    assert model.flops_per_token(64, recomputed_blocks=2) > flops


def test_meta_build_matches_eager_build():
    from framework.modules import materialize

    torch.manual_seed(3)
    eager = Llama(vocab_size=VOCAB, n_layers=2)
    with torch.device("meta"):
        meta = Llama(vocab_size=VOCAB, n_layers=2)
    materialize(meta, torch.device("cpu"), meta.init_rule, 3)
    for (name, a), (_, b) in zip(eager.state_dict().items(), meta.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with torch.device("meta"):
        tied = Llama(vocab_size=VOCAB, n_layers=1, tie_embeddings=True)
    materialize(tied, torch.device("cpu"), tied.init_rule, 3)
    assert tied.output.weight is tied.tok_embeddings.weight  # still one parameter after to_empty


# ----------------------------------------------------------------------------- through train.py

TINY = ["model=llama", "logger=none", "progress=false", "data.seq_len=32", "data.batch_size=2", "data.max_bytes=200000"]


def logits_of_checkpoint(run_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The framework's model at the run's last checkpoint (read back from DCP)."""
    from framework.checkpoint.export import checkpoint_tensors, read_tensor

    ckpt = sorted((run_dir / "checkpoints").glob("step-*"))[-1]
    state = {n: read_tensor(str(ckpt), n, *meta) for n, meta in checkpoint_tensors(str(ckpt)).items()}
    model = Llama(hf_config=str(run_dir.parent / "hf")).eval()
    if model.args.tie_embeddings:
        state.setdefault("output.weight", state["tok_embeddings.weight"])
    model.load_state_dict(state)
    with torch.no_grad():
        return model(tokens)


@pytest.fixture(scope="module")
def pretrained_fsdp_run(tmp_path_factory):
    """Start from a tiny HF checkpoint, train 2 steps under fsdp x2, save, export."""
    root = tmp_path_factory.mktemp("llama_fsdp")
    hf = hf_model(root / "hf", tie=False)
    run = root / "run"
    r = train_cli([*TINY, "parallel=fsdp", "launch.nproc_per_node=2", f"model.pretrained={root / 'hf'}",
                   "steps=2", "checkpoint.every=2", "checkpoint.export=true"], run)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    from framework.doors.export import main as export_main

    assert export_main([str(ckpt), str(root / "out"), "--format", "hf"]) == 0
    return root, hf, run


def test_pretrained_run_holds_the_hf_weights(tmp_path):
    """model=llama model.pretrained=<folder>: with a zero learning rate the saved model is the
    Hugging Face one, logits equal within 1e-5 (tied variant: the export test covers untied)."""
    hf = hf_model(tmp_path / "hf", tie=True)
    run = tmp_path / "run"
    r = train_cli([*TINY, "parallel=none", f"model.pretrained={tmp_path / 'hf'}", "steps=1", "checkpoint.every=1",
                   "optim.lr=1e-30", "optim.grad_clip=0", "checkpoint.export=true"], run)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_summary(run)["status"] == "ok"
    tokens = torch.randint(0, VOCAB, (2, 32))
    with torch.no_grad():
        assert torch.allclose(logits_of_checkpoint(run, tokens), hf(tokens).logits, atol=1e-5, rtol=0)
    # import then export (framework.export from the run's checkpoint): every tensor bitwise
    from framework.doors.export import main as export_main

    ckpt = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert export_main([str(ckpt), str(tmp_path / "out"), "--format", "hf"]) == 0
    exported, original = dict(iter_hf_tensors(str(tmp_path / "out"))), dict(iter_hf_tensors(str(tmp_path / "hf")))
    assert set(exported) == set(original) - {"lm_head.weight"}
    assert all(torch.equal(exported[k], original[k]) for k in exported)
    # checkpoint.export=true wrote the same folder at the end of the run (tied: no lm_head)
    at_end = dict(iter_hf_tensors(str(run / "hf")))
    assert set(at_end) == set(exported) and all(torch.equal(at_end[k], exported[k]) for k in exported)
    assert not (run / "model.pt").exists()


def test_a_tied_pretrained_llama_trains_under_pp_with_one_head_and_exports_it(tmp_path):
    """model.pretrained (tied: the checkpoint holds the embedding once) under pp x2: the last stage
    loads its head from the embedding, the two stages' copies stay bitwise equal through training,
    and the export loads in transformers with the framework's logits (1e-5)."""
    hf_model(tmp_path / "hf", tie=True)
    run = tmp_path / "run"
    r = train_cli([*TINY, "parallel=pp", "launch.nproc_per_node=2", "data.batch_size=4", "steps=2",
                   f"model.pretrained={tmp_path / 'hf'}", "checkpoint.every=2", "checkpoint.export=true"], run)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    from framework.checkpoint.export import checkpoint_tensors, read_tensor

    ckpt = str(sorted((run / "checkpoints").glob("step-*"))[-1])
    meta = checkpoint_tensors(ckpt)
    embedding, head = (read_tensor(ckpt, name, *meta[name]) for name in ("tok_embeddings.weight", "output.weight"))
    assert torch.equal(embedding, head)  # one parameter in value, held by two ranks
    exported = transformers.AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    tokens = torch.randint(0, VOCAB, (2, 32))
    with torch.no_grad():
        assert torch.allclose(exported(tokens).logits, logits_of_checkpoint(run, tokens), atol=1e-5, rtol=0)


def test_fsdp_export_loads_in_transformers_with_equal_logits(pretrained_fsdp_run):
    root, hf, run = pretrained_fsdp_run
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / "out").eval()
    tokens = torch.randint(0, VOCAB, (2, 32))
    with torch.no_grad():
        theirs = exported(tokens).logits
    assert torch.allclose(theirs, logits_of_checkpoint(run, tokens), atol=1e-5, rtol=0)
    with torch.no_grad():  # and training moved the weights away from the pretrained ones
        assert not torch.allclose(theirs, hf(tokens).logits, atol=1e-4)


def test_checkpoint_export_writes_an_hf_folder_transformers_loads(pretrained_fsdp_run):
    """checkpoint.export=true under fsdp x2 (untied): RUN_DIR/hf loads with from_pretrained, its
    logits equal the framework's at the last step within 1e-5, and every tensor equals the CLI's
    export of the same step's checkpoint bitwise."""
    root, _, run = pretrained_fsdp_run
    at_end = transformers.AutoModelForCausalLM.from_pretrained(run / "hf").eval()
    tokens = torch.randint(0, VOCAB, (2, 32))
    with torch.no_grad():
        assert torch.allclose(at_end(tokens).logits, logits_of_checkpoint(run, tokens), atol=1e-5, rtol=0)
    ours, cli = dict(iter_hf_tensors(str(run / "hf"))), dict(iter_hf_tensors(str(root / "out")))
    assert set(ours) == set(cli) and "lm_head.weight" in ours
    assert all(torch.equal(ours[k], cli[k]) for k in cli)


# ----------------------------------------------------------------------------- every strategy

TINY_LLAMA = ["model=llama", "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
              "model.ffn_hidden=64", "model.tie_embeddings=true", "logger=none", "progress=false", "data.seq_len=16",
              "steps=3", "optim.grad_clip=0.5"]  # fmt: skip


@pytest.fixture(scope="module")
def llama_reference(tmp_path_factory):
    run = tmp_path_factory.mktemp("llama_ref") / "none"
    proc = train_cli([*TINY_LLAMA, "parallel=none", "data.batch_size=4", "checkpoint.every=2"], run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(run)


def test_a_tied_llama_saved_by_one_process_resumes_under_pp(tmp_path, llama_reference, tmp_path_factory):
    """One process keeps one optimizer state for the tied embedding and head; the pipeline, which
    holds them on two ranks, loads the head's from the embedding's and goes on as one process did."""
    saved = next(tmp_path_factory.getbasetemp().glob("llama_ref*/none/checkpoints/step-000002"))
    proc = train_cli([*TINY_LLAMA, "parallel=pp", "launch.nproc_per_node=2", "data.batch_size=4",
                      f"checkpoint.resume={saved}"], tmp_path / "run")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    [got] = read_metrics(tmp_path / "run")
    assert got["step"] == 3 and abs(got["loss"] - llama_reference[2]["loss"]) <= 1e-5 * llama_reference[2]["loss"]


# (layout, ranks, micro-batch per data-parallel rank): a global batch of 4 in every case
LAYOUTS = [("ddp", 2, 2), ("fsdp", 2, 2), ("tp", 2, 4), ("pp", 2, 4), ("hybrid", 4, 2),
           ("hybrid parallel.pp=2 parallel.tp=2", 4, 4)]  # fmt: skip


# the default run keeps the layouts that split the tie (tp, pp); pp x tp and the rest in `make test-all`, and
# the matrix trains the tied Llama under each strategy family
SPLIT_TIE = {"tp", "pp"}


@pytest.mark.parametrize(
    "layout,ranks,batch",
    [case if case[0].split()[-1] in SPLIT_TIE else pytest.param(*case, marks=pytest.mark.slow) for case in LAYOUTS],
    ids=[layout.split()[-1] for layout, _, _ in LAYOUTS],
)
def test_tied_llama_parity_across_strategies(tmp_path, llama_reference, layout, ranks, batch):
    """fp32, the same global batch, the head tied to the embedding (as Llama 3.2 1B), clipping
    active: every strategy gives the single process's losses and gradient norms. tp keeps the tie
    one DTensor (GQA's key/value heads split too); pp puts the embedding and the head on two ranks,
    which keep their copies equal (their gradients summed, counted once in the norm); hybrid at 4:
    dp_shard 2 x tp 2, and pp 2 x tp 2."""
    parallel, *knobs = layout.split()
    run = tmp_path / "run"
    proc = train_cli([*TINY_LLAMA, f"parallel={parallel}", *knobs, f"launch.nproc_per_node={ranks}",
                      f"data.batch_size={batch}"], run)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got, want = read_metrics(run), llama_reference
    assert want[-1]["loss"] < want[0]["loss"] and want[0]["grad_norm"] > 0.5  # it trains, and clipping acts
    for step, (a, b) in enumerate(zip(got, want, strict=True), start=1):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) / abs(b[key]) <= 1e-5, f"step {step}: {layout} {key} {a[key]} vs {b[key]}"
