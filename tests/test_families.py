"""Mistral, Qwen2, Qwen3 and Qwen3-MoE folders as model=llama (issue 55): a sliding window, query/key/value
biases, per-head query/key norms and a head width of its own are Llama options
(models/llama_args.py), read from the folder's config.json. Each family gives transformers'
logits, goes back to its own tensors bit for bit, trains under fsdp x2 and tp x2 as one process,
and exports a folder transformers loads with the framework's logits. Tiny shapes, no download."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from models.kv_cache import caching  # noqa: E402
from models.llama import Llama  # noqa: E402
from models.llama_hf import args_from_hf_config, iter_hf_tensors, to_hf  # noqa: E402
from tests.helpers import read_metrics, train_cli  # noqa: E402

VOCAB = 257  # the bytes tokenizer's
SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 96, "vocab_size": VOCAB, "max_position_embeddings": 256, "rms_norm_eps": 1e-6}  # fmt: skip
# each family's own option, shaped so that getting it wrong shows: a window shorter than the
# sequence, a tied head, a head width that is not hidden / heads
FAMILIES = {
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=8),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, tie_word_embeddings=True),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=24),
    # routed: 4 experts of 48, top 2 renormalised, in every layer (a routed Qwen3)
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE, head_dim=24, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True
    ),
}
FAMILY = {"qwen3_moe": "qwen3"}  # LlamaArgs.family of a model type (its experts make it Qwen3-MoE)


def family_folder(kind: str, folder: Path, seed: int = 0):
    """A tiny random model of the family, saved to `folder`. Its biases, norm weights and routers
    are moved off transformers' zeros and ones, which would hide one read into the wrong place."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[kind]()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            if name.endswith("mlp.gate.weight"):  # a router: distinct choices
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return model


def ours_from(folder: Path) -> Llama:
    from framework.hf import load_pretrained

    model = Llama(hf_config=str(folder)).eval()
    assert load_pretrained(model, str(folder), torch.device("cpu"), model.from_hf_name) == []
    return model


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_family_folder_gives_transformers_logits_and_goes_back_bitwise(tmp_path, kind):
    hf = family_folder(kind, tmp_path)
    ours = ours_from(tmp_path)
    assert ours.args.family == FAMILY.get(kind, kind)
    tokens = torch.randint(0, VOCAB, (2, 32))
    with torch.no_grad():
        assert torch.allclose(ours(tokens), hf(tokens).logits, atol=1e-5, rtol=0)
    back, files = to_hf(ours.state_dict(), ours.args), dict(iter_hf_tensors(str(tmp_path)))
    assert set(back) == set(files) - ({"lm_head.weight"} if ours.args.tie_embeddings else set())
    assert all(torch.equal(back[name], files[name]) for name in back)
    # the files an export writes (config.json and the tensors) load as the family's own architecture
    from safetensors.torch import save_file

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text(json.dumps(ours.hf_config()))
    save_file({k: v.contiguous() for k, v in back.items()}, str(tmp_path / "out" / "model.safetensors"))
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(exported) is type(hf)
    with torch.no_grad():
        assert torch.allclose(exported(tokens).logits, hf(tokens).logits, atol=1e-6, rtol=0)


def test_a_sliding_window_holds_while_generating(tmp_path):
    """Decoding with the key/value cache past Mistral's window sees only the window's last keys:
    token by token, the logits are the whole sequence's."""
    family_folder("mistral", tmp_path)
    model = ours_from(tmp_path)
    tokens = torch.randint(0, VOCAB, (1, 20))
    with torch.no_grad():
        whole = model(tokens)
        with caching(model, batch=1, max_len=20):
            steps = [model(tokens[:, :5]), *(model(tokens[:, i : i + 1]) for i in range(5, 20))]
    assert torch.allclose(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=0)


def test_a_family_config_it_cannot_hold_is_refused_in_one_line():
    base = {"model_type": "qwen2", **SHAPE}
    with pytest.raises(ValueError, match="use_sliding_window=true"):
        args_from_hf_config({**base, "use_sliding_window": True})
    with pytest.raises(ValueError, match="attention_bias=true"):
        args_from_hf_config({**base, "model_type": "qwen3", "attention_bias": True})
    with pytest.raises(ValueError, match="'gemma'.*allowed: llama, mistral, qwen2, qwen3"):
        args_from_hf_config({**base, "model_type": "gemma"})
    assert args_from_hf_config({**base, "model_type": "qwen3"}).head_dim == 128  # transformers' default
    assert args_from_hf_config({**base, "model_type": "mistral"}).sliding_window == 4096


# ----------------------------------------------------------------------------- trained

TINY = ["model=llama", "logger=none", "progress=false", "data.seq_len=32", "data.max_bytes=200000", "steps=3",
        "optim.grad_clip=0.5"]  # fmt: skip
# (layout, micro-batch per data-parallel rank): a global batch of 4 in each
LAYOUTS = {"none": ("parallel=none", 4), "fsdp": ("parallel=fsdp", 2), "tp": ("parallel=tp", 4)}


# trained in the default tier: qwen3 (its q/k norms, a head width apart from hidden / heads) and
# qwen3_moe (routed); mistral's window and qwen2's biases are the long tier's (the matrix's
# llama(qwen,mistral) cells train both features under every strategy against one process)
TRAINED = [k if k.startswith("qwen3") else pytest.param(k, marks=pytest.mark.slow) for k in FAMILIES]


@pytest.fixture(scope="module", params=TRAINED)
def family_runs(request, tmp_path_factory):
    """Each family from its folder, 3 steps in one process, under fsdp x2 and under tp x2 (which
    exports at its end): one multirun over the layouts, each a config file of its own (`+layout=`,
    on hydra.searchpath: its parallel choice, ranks and batch), so that one launcher starts them all."""
    kind = request.param
    root = tmp_path_factory.mktemp(kind)
    family_folder(kind, root / "hf")
    (root / "conf" / "layout").mkdir(parents=True)
    for name, (layout, batch) in LAYOUTS.items():
        extra = "checkpoint:\n  every: 3\n  export: true\n" if name == "tp" else ""
        (root / "conf" / "layout" / f"{name}.yaml").write_text(
            f"# @package _global_\ndefaults:\n  - override /parallel: {layout.split('=')[1]}\n"
            f"launch:\n  nproc_per_node: {1 if name == 'none' else 2}\ndata:\n  batch_size: {batch}\n{extra}"
        )
    proc = train_cli(["-m", *TINY, f"+layout={','.join(LAYOUTS)}", f"hydra.searchpath=[file://{root / 'conf'}]",
                      f"model.pretrained={root / 'hf'}", f"hydra.sweep.dir={root / 'sweep'}"], timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for job in (root / "sweep").iterdir():  # each job's folder by its layout's name
        if (job / "summary.json").exists():
            job.rename(root / json.loads((job / "summary.json").read_text())["choices"]["parallel"])
    runs = {name: read_metrics(root / name) for name in LAYOUTS}
    assert json.loads((root / "tp" / "summary.json").read_text())["world_size"] == 2
    return kind, root, runs


def test_a_family_trains_under_fsdp_and_tp_as_one_process(family_runs):
    kind, _, runs = family_runs
    want = runs["none"]
    assert want[-1]["loss"] < want[0]["loss"]
    for layout in ("fsdp", "tp"):
        for step, (a, b) in enumerate(zip(runs[layout], want, strict=True), start=1):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(b[key]), f"{kind} {layout} step {step}: {key}"


def test_a_family_trained_under_tp_exports_what_transformers_loads(family_runs):
    """checkpoint.export=true under tp x2: the folder is the family's architecture, and its logits
    are the framework's at the last step (read back from the checkpoint) within 1e-5."""
    from framework.checkpoint.export import checkpoint_tensors, read_tensor

    kind, root, _ = family_runs
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / "tp" / "hf").eval()
    assert exported.config.model_type == kind
    ckpt = str(sorted((root / "tp" / "checkpoints").glob("step-*"))[-1])
    state = {n: read_tensor(ckpt, n, *meta) for n, meta in checkpoint_tensors(ckpt).items()}
    ours = Llama(hf_config=str(root / "hf")).eval()
    ours.load_state_dict({**state, "output.weight": state.get("output.weight", state["tok_embeddings.weight"])})
    tokens = torch.randint(0, VOCAB, (2, 32))
    with torch.no_grad():
        assert torch.allclose(exported(tokens).logits, ours(tokens), atol=1e-5, rtol=0)
