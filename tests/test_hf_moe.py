"""Mixtures of experts through `model=hf` (issue 67): a tiny Qwen3-MoE and a tiny DeepSeek-V3
folder, written by transformers in float32. Their FLOPs are counted on the meta device (torch's
meta grouped matmul takes bf16 only, and FlopCounterMode has no formula for it: this was a
RuntimeError), their files (one tensor per expert, the router's bias a buffer) load into
transformers' grouped experts, `framework.evaluate` gives transformers' own loss, and they train
under ddp x2 and fsdp x2 as one process."""

from __future__ import annotations

import os

import pytest
import torch
from omegaconf import OmegaConf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from framework.loss import IGNORE_INDEX  # noqa: E402
from framework.run.sweep import run_configs  # noqa: E402
from tests.helpers import losses, world_config  # noqa: E402

STEPS, GLOBAL_BATCH, SEQ = 3, 8, 32
SHAPE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
         "vocab_size": 257, "max_position_embeddings": 256, "moe_intermediate_size": 48, "num_experts_per_tok": 2}  # fmt: skip
FAMILIES = {
    # 4 experts in every layer, top 2 renormalised
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE, num_key_value_heads=2, head_dim=24, num_experts=4, norm_topk_prob=True
    ),  # fmt: skip
    # multi-head latent attention; layer 0 dense, layer 1 routed (4 experts in 2 groups, the best group's
    # top 2, a shared expert), the router's score correction a buffer
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **SHAPE,
        num_key_value_heads=4,  # MLA's keys are per head: transformers' attention fails on fewer
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
    ),
}


def moe_folder(kind: str, folder) -> torch.nn.Module:
    """A tiny random model of the family saved to `folder`; its norms, routers and the router's
    bias moved off transformers' ones and zeros (a buffer left unloaded would not show on zeros)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[kind]()).eval()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name or name.endswith("e_score_correction_bias"):
                t.add_(0.1 * torch.randn_like(t))
            if name.endswith("mlp.gate.weight"):  # a router: distinct choices
                t.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    (root / "text.txt").write_bytes(bytes(range(32, 127)) * 7)  # 665 bytes: 20 windows of 32
    return root, {kind: (root / kind, moe_folder(kind, root / kind)) for kind in FAMILIES}


def transformers_loss(model: torch.nn.Module, dataset) -> tuple[float, int]:
    """transformers' mean next-token loss over every sample of `dataset`."""
    total, terms = 0.0, 0
    for i in range(len(dataset)):
        (tokens,), target = dataset[i]
        with torch.no_grad():
            logits = model(tokens[None]).logits[0].float()
        total += torch.nn.functional.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum").item()
        terms += int((target != IGNORE_INDEX).sum())
    return total / terms, terms


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_moe_folder_loads_and_evaluates_as_transformers_does(folders, kind):
    """One tensor per expert in the files, stacked into transformers' grouped experts (gate and up
    joined) as its own conversion mapping says, the router's bias (a buffer) read too: bitwise
    transformers' own from_pretrained; `framework.evaluate` gives its loss (was the FLOP count's
    RuntimeError, then 'no weights for 4 parameters')."""
    from framework.config.door import resolve_input
    from framework.contract import canonical_name
    from framework.data import build_dataset
    from framework.doors.evaluate import run
    from framework.hf import from_config, load_pretrained

    root, built = folders
    folder = built[kind][0]
    with torch.device("meta"):
        ours = from_config(str(folder))
    ours.to_empty(device="cpu")
    assert load_pretrained(ours, str(folder), torch.device("cpu"), ours.from_hf_name) == []
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    expected = {k: v for k, v in theirs.state_dict().items() if "inv_freq" not in k}
    got = {canonical_name(k): v for k, v in ours.state_dict().items() if "inv_freq" not in k}
    assert set(got) == set(expected) and any(v.dim() == 3 for v in got.values())  # grouped experts
    assert all(torch.equal(got[k], expected[k]) for k in expected), [
        k for k in expected if not torch.equal(got[k], expected[k])
    ]
    overrides = ["model=hf", f"model.pretrained={folder}", "data=text", f"data.path={root / 'text.txt'}",
                 f"data.seq_len={SEQ}", "data.batch_size=4"]  # fmt: skip
    result, cfg = run(None, overrides), resolve_input(None, overrides).cfg
    loss, terms = transformers_loss(theirs, build_dataset(cfg.data, cfg.seed, "lm", "train"))
    assert result["terms"] == terms and result["loss"] == pytest.approx(loss, rel=1e-5)


def test_a_float32_grouped_matmul_on_meta_counts_as_its_loop_of_matmuls():
    """torch's counter has no formula for torch._grouped_mm (it counted 0) and its meta kernel
    refuses float32 (the RuntimeError) and a width of 12 (not 16-byte aligned): a forward and a
    backward (the 2-D x 3-D form again, and the 2-D x 2-D one) count what the same work counts as
    a loop of plain matmuls, 3 x 2·M·K·N."""
    from torch.utils.flop_counter import FlopCounterMode

    from framework.measure.flops import GroupedOnMeta

    sizes, k, n = [3, 0, 5, 4], 8, 12  # an expert no token chose among them
    x = torch.randn(sum(sizes), k, device="meta", requires_grad=True)
    w = torch.randn(len(sizes), k, n, device="meta", requires_grad=True)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32).to("meta")
    with FlopCounterMode(display=False) as grouped, GroupedOnMeta():
        y = torch.nn.functional.grouped_mm(x, w, offs=offs)
        y.backward(torch.ones_like(y))
    assert y.dtype == torch.float32 and y.shape == (sum(sizes), n) and w.grad.shape == w.shape
    with FlopCounterMode(display=False) as looped:
        xs = torch.randn(sum(sizes), k, requires_grad=True).split(sizes)
        ws = torch.randn(len(sizes), k, n, requires_grad=True)
        torch.cat([a @ b for a, b in zip(xs, ws, strict=True)]).sum().backward()
    assert grouped.get_total_flops() == looped.get_total_flops() == 3 * 2 * sum(sizes) * k * n


def _on_meta(folder, experts: str | None = None):
    from framework.contract import spec_of
    from framework.hf import from_config

    with torch.device("meta"):
        model = from_config(str(folder))
    if experts is not None:
        model.set_experts_implementation(experts)
    return model, spec_of(model, OmegaConf.create({"name": "hf"}))


@pytest.mark.parametrize("kind", FAMILIES)
def test_moe_flops_count_on_meta_as_batched_experts_count_them(folders, kind):
    """transformers' default grouped_mm experts on meta, in float32, count what its batched_mm
    experts count with torch's own bmm formula; a checkpointed block adds its forward (its name
    under FlopCounterMode's root was never found: HFU was MFU). Eager experts (a loop over the
    chosen experts: torch.nonzero, no meta kernel) cannot run on meta: an estimate, saying so."""
    from framework.measure.flops import COUNTED_ON_META, training_flops

    folder = folders[1][kind][0]
    model, spec = _on_meta(folder)
    flops, hardware, how = training_flops(model, spec, SEQ, recomputed=1)
    assert how == COUNTED_ON_META and hardware > flops
    assert training_flops(*_on_meta(folder, "batched_mm"), SEQ, recomputed=1) == (flops, hardware, how)
    estimate, _, how = training_flops(*_on_meta(folder, "eager"), SEQ)
    assert how.startswith("estimated") and "torch.nonzero()" in how
    if kind == "qwen3_moe":  # the estimate leaves out attention's 12·L·H·Q·T, and nothing else
        config = model.config
        attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * SEQ
        assert estimate + attention == flops


def test_a_moe_folder_is_traced_for_pipeline_stages_on_meta(folders):
    """parallel=pp (and the planner's pipeline check) run the model once on meta to find what
    runs around its blocks: the grouped matmul's float32 RuntimeError there too. (pp x2 trains
    both folders as one process: not run here, for the suite's time.)"""
    from framework.parallel.pipeline import trace_split

    split = trace_split(*_on_meta(folders[1]["deepseek_v3"][0]), SEQ)
    assert split.blocks == "model.layers" and split.own_forward


@pytest.fixture(scope="module")
def parity_runs(folders, tmp_path_factory):
    """Each folder's weights trained in one process, then under ddp x2 and fsdp x2 (the four in one
    group of workers; fsdp loads each expert's tensors into its shards of the grouped weight):
    {name: (summary, losses)}, with the one-process runs under `<kind>_none`."""
    from framework.run.trainer import run

    out, built = tmp_path_factory.mktemp("moe_runs"), folders[1]

    def base(kind: str, *extra: str) -> list[str]:
        return ["experiment=smoke", "logger=none", f"steps={STEPS}", "model=hf", f"model.pretrained={built[kind][0]}",
                "optim.grad_clip=0", *extra]  # fmt: skip

    runs = {}
    for kind in FAMILIES:
        cfg = OmegaConf.create(world_config([*base(kind, "parallel=none", f"data.batch_size={GLOBAL_BATCH}")], 1))
        runs[f"{kind}_none"] = run(cfg, str(out / f"{kind}_none"), {"parallel": "none"})
    configs = {f"{kind}_{parallel}": world_config(base(kind, f"parallel={parallel}", "data.batch_size=4"), 2)
               for kind in FAMILIES for parallel in ("ddp", "fsdp")}  # fmt: skip
    runs |= run_configs(configs, 2, str(out))
    return {name: (summary, losses(out / name)) for name, summary in runs.items()}


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", FAMILIES)
def test_a_moe_folder_trains_under_ddp_and_fsdp_as_one_process(parity_runs, kind, parallel):
    """Every expert is one 3-D weight (transformers' grouped experts): each step gives it a
    gradient, unchosen experts' rows zero, so ddp finds no unused parameter and fsdp shards it
    along its experts. The FLOPs are counted on meta (this was the RuntimeError), MFU reported."""
    from framework.measure.flops import COUNTED_ON_META

    reference, (summary, got) = parity_runs[f"{kind}_none"][1], parity_runs[f"{kind}_{parallel}"]
    assert len(reference) == STEPS and reference[-1] < reference[0]
    assert summary["status"] == "ok" and summary["mfu"] is not None
    assert summary["flops_counted"] == COUNTED_ON_META == parity_runs[f"{kind}_none"][0]["flops_counted"]
    assert summary["flops_per_token"] == parity_runs[f"{kind}_none"][0]["flops_per_token"]
    for step, (a, b) in enumerate(zip(got, reference, strict=True), start=1):
        assert abs(a - b) / abs(b) <= 1e-5, f"{kind} {parallel} step {step}: {a} vs one process {b}"
