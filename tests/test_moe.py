"""Mixture of experts (models/moe.py, framework/callbacks/model.py): the routed layer against a
token-by-token computation, dropped tokens and load imbalance against hand counts, the auxiliary
loss's gradient (global-batch balance: the same however the batch is split), and a Llama with
experts through the training loop. Its parity with one process under
every strategy is the compatibility matrix's (tests/matrix.py: the llama(moe) row)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from framework.callbacks.model import ModelSteps
from framework.contract import spec_of
from framework.dist import DistInfo
from framework.figures import Registry
from framework.hooks import Control, Run
from framework.moe import routed_layers
from models.llama import Llama
from models.moe import MoE, MoEArgs
from tests.helpers import count_syncs, read_metrics, read_summary, train_cli

SHAPE = {"dim": 16, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "ffn_hidden": 32, "vocab_size": 64}
ONE = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"), backend=None)


def layer(**moe) -> MoE:
    torch.manual_seed(0)
    m = MoE(8, 16, MoEArgs(**{"experts": 4, "top_k": 2, **moe}))
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def by_hand(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its top_k experts one at a time, weighted (softmax over all experts)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        scores = m.gate(x[t]).softmax(-1)
        for e in scores.topk(m.args.top_k).indices.tolist():
            w1, w2, w3 = m.experts.w1[e], m.experts.w2[e], m.experts.w3[e]
            out[t] += scores[e] * (w2 @ (F.silu(w1 @ x[t]) * (w3 @ x[t])))
    return out


@pytest.mark.parametrize("shared", [0, 1])
def test_a_dropless_layer_equals_each_token_through_its_experts(shared):
    m, x = layer(shared_experts=shared), torch.randn(24, 8, generator=torch.Generator().manual_seed(1))
    want = by_hand(m, x) + (m.shared(x) if shared else 0)
    assert torch.allclose(m(x[None])[0], want, atol=1e-5)
    counts = m.read_counts()
    assert counts["dropped"] == 0 and counts["tokens"].sum() == 24 * 2
    assert torch.allclose(counts["probs"].sum(), torch.tensor(24.0))  # each token's probabilities sum to 1
    assert m.read_counts() == {}  # read once: the next step counts afresh


def test_capacity_drops_what_a_hand_count_drops():
    """The gate sends every token to experts 0 and 1 (2 of 4): each expert takes at most
    ceil(1.0 x 24 tokens x 2 / 4) = 12, in token order, so 12 + 12 of the 48 assignments drop,
    and a dropped token's share of that expert is missing from its output."""
    m, x = layer(capacity_factor=1.0), torch.randn(24, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        m.gate.weight.zero_()
        m.gate.weight[0, 0], m.gate.weight[1, 0] = 50.0, 40.0
        x[:, 0] = 1.0
    out = m(x[None])[0]
    counts = m.read_counts()
    assert counts["dropped"] == 24 and counts["tokens"].tolist() == [24, 24, 0, 0]
    assert torch.allclose(out[:12], by_hand(m, x[:12]), atol=1e-5)  # the first 12 tokens: both experts
    assert torch.allclose(out[12:], torch.zeros_like(out[12:]), atol=1e-6)  # the rest: dropped by both


def one_rank_run(model) -> tuple[ModelSteps, Run]:
    """The model's step protocol as a one-process run sees it (framework/callbacks/model.py)."""
    parts = SimpleNamespace(par=SimpleNamespace(module=model, mesh=None, pipeline=None), n_blocks=2,
                            spec=spec_of(model, {}), precision=SimpleNamespace(scaler=torch.amp.GradScaler("cpu", enabled=False)))  # fmt: skip
    run = Run(SimpleNamespace(accumulation_steps=1), ONE, parts, Registry(), Control(), "", "")
    steps = ModelSteps()
    steps.on_build(run)
    return steps, run


def test_load_imbalance_and_bias_balancing_follow_a_hand_count():
    """Two blocks' counts through the step protocol into the step's figures: the imbalance is the
    mean over blocks of max/mean; balance=bias moves each expert's bias by rate x sign(mean - load);
    the balancing loss is coef x E x sum f_e P_e of the whole step."""
    model = Llama("debug", **SHAPE, moe={"experts": 4, "top_k": 2, "balance": "bias", "bias_rate": 0.5})
    tokens = torch.randint(0, 64, (3, 10), generator=torch.Generator().manual_seed(3))
    layers = routed_layers(model, "layers")
    counts, probs = [], []
    for _, m in layers:  # the routing by hand, from each block's own input

        def by_hand(mod, inp, out):
            chosen, _, scores = mod.route(inp[0].reshape(-1, 16))
            counts.append(torch.bincount(chosen.flatten(), minlength=4).float())
            probs.append((scores / scores.sum(-1, keepdim=True)).mean(0).detach())

        m.register_forward_hook(by_hand)
    steps, run = one_rank_run(model)
    model(tokens)
    reduced = run.figures.pack(steps.on_step_end(0), 0, torch.device("cpu"))  # one rank: its sum is its own
    steps.on_step_reduced(0, run.figures.totals(reduced))
    figures = steps.on_settled(0, run.figures.read(reduced.tolist()))
    want = sum(float(c.max() / c.mean()) for c in counts) / 2
    assert figures["moe_load_imbalance"] == pytest.approx(want)
    assert figures["moe_tokens_per_expert"] == (counts[0] + counts[1]).tolist() and figures["moe_dropped_tokens"] == 0
    aux = [0.01 * 4 * float((c / c.sum() * p).sum()) for c, p in zip(counts, probs, strict=True)]
    assert figures["moe_aux_loss"] == pytest.approx(sum(aux) / 2, rel=1e-5)
    for (_, m), c in zip(layers, counts, strict=True):
        assert torch.equal(m.expert_bias, 0.5 * torch.sign(c.mean() - c))
        assert torch.allclose(m.balance_share, c / c.sum())  # f of the next step: this step's shares


def test_the_auxiliary_loss_gradient_joins_the_training_loss():
    """balance_scope=micro adds coef x E x sum f_e P_e of the forward's own tokens to the loss
    through backward: the router's gradient equals autograd's of loss + aux (scaled by the
    framework's share of the step)."""
    m, x = (
        layer(balance="aux_loss", aux_loss_coef=0.1, balance_scope="micro"),
        torch.randn(1, 24, 8, generator=torch.Generator().manual_seed(4)),
    )
    m.set_aux_scale(torch.tensor(0.5))
    m(x).square().sum().backward()
    got = m.gate.weight.grad.clone()
    m.zero_grad()
    m.set_aux_scale(torch.zeros(()))  # the same forward without the aux gradient, plus the aux loss by hand
    y = m(x)
    flat = x.reshape(-1, 8)
    scores = m.gate(flat).softmax(-1)
    f = torch.bincount(scores.topk(2).indices.flatten(), minlength=4).float() / 48
    (y.square().sum() + 0.5 * 0.1 * 4 * (f * scores.mean(0)).sum()).backward()
    assert torch.allclose(got, m.gate.weight.grad, atol=1e-6)


def aux_gradient(m: MoE, pieces: list[torch.Tensor]) -> torch.Tensor:
    """The router's gradient from the auxiliary loss alone, over the batch given in `pieces`
    (micro-batches, each weighing its share of the step, as the framework scales them)."""
    m.zero_grad()
    for x in pieces:
        m.set_aux_scale(torch.tensor(1.0 / len(pieces)))
        (m(x) * 0).sum().backward()
    return m.gate.weight.grad.clone()


def test_the_global_balance_trains_the_same_however_the_batch_is_split():
    """balance_scope=global: f is the last step's share over the whole global batch, so the
    gradient of one batch equals the summed gradients of its halves (the micro scope's does
    not), and it is the gradient of coef x E x sum f_e P_e over the whole batch."""
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(5))
    m = layer(balance="aux_loss", aux_loss_coef=0.1)
    with torch.no_grad():
        m.balance_share.copy_(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    whole, halves = aux_gradient(m, [x]), aux_gradient(m, [x[:1], x[1:]])
    assert torch.allclose(whole, halves, atol=1e-7)
    m.zero_grad()
    scores = m.gate(x.reshape(-1, 8)).softmax(-1)
    (0.1 * 4 * (m.balance_share * scores.mean(0)).sum()).backward()
    assert torch.allclose(whole, m.gate.weight.grad, atol=1e-7)
    micro = layer(balance="aux_loss", aux_loss_coef=0.1, balance_scope="micro")
    assert not torch.allclose(aux_gradient(micro, [x]), aux_gradient(micro, [x[:1], x[1:]]), atol=1e-5)


def test_flops_count_active_experts_not_all():
    dense = Llama("debug", **SHAPE)
    moe = Llama("debug", **SHAPE, moe={"experts": 8, "top_k": 2})
    expert = 3 * 16 * 32  # one expert's three matrices
    gate = 16 * 8
    assert moe.flops_per_token(10) - dense.flops_per_token(10) == 6 * 2 * (gate + (2 - 1) * expert)


def test_a_llama_with_experts_trains_and_logs_its_routing(tmp_path):
    """ddp x2, balance=bias: metrics.jsonl carries the load imbalance, auxiliary loss and dropped
    tokens each step, and the tokens each expert got sum to every token x top_k; with activation
    checkpointing, whose backward runs each block's forward again, the same counts (counted once)."""
    args = ["model=llama", "model.flavor=debug_moe", "model.dim=32", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "model.ffn_hidden=64", "model.moe.balance=bias", "data.seq_len=32",
            "data.max_bytes=50000", "data.batch_size=4", "steps=4", "parallel=ddp", "launch.nproc_per_node=2",
            "progress=false", "metrics.sample_every=0"]  # fmt: skip
    proc = train_cli(args, tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics, summary = read_metrics(tmp_path / "run"), read_summary(tmp_path / "run")
    for m in metrics:
        assert m["moe_dropped_tokens"] == 0 and m["moe_load_imbalance"] >= 1.0 and m["moe_aux_loss"] > 0
        assert sum(m["moe_tokens_per_expert"]) == 2 * (8 * 32) * 2  # blocks x tokens of the step x top_k
    assert summary["moe"]["dropped_tokens"] == 0
    assert math.isclose(summary["moe"]["load_imbalance_first"], metrics[0]["moe_load_imbalance"])
    proc = train_cli([*args, "memory=checkpoint"], tmp_path / "recomputed")
    assert proc.returncode == 0, proc.stderr[-3000:]
    recomputed = read_summary(tmp_path / "recomputed")["moe"]
    assert recomputed["tokens_per_expert"] == summary["moe"]["tokens_per_expert"], recomputed


def test_routed_experts_are_refused_where_they_cannot_run():
    from framework.config import ConfigError, validate
    from tests.helpers import compose_config

    base = ["model=llama", "model.flavor=debug_moe", "model.n_layers=2"]
    cp2 = ["parallel=hybrid", "parallel.cp=2", "parallel.tp=1", "parallel.pp=1"]
    cases = [
        ("model.moe.top_k", [*base, "model.moe.top_k=5", "parallel=none"]),
        ("model.moe.balance", [*base, "model.moe.balance=loss", "parallel=none"]),
        ("parallel.ep", [*base, *EP2, "model.moe.experts=3"]),  # 3 experts do not split over 2 ranks
        ("parallel.ep", [*base, "parallel=fsdp", "parallel.ep=2", "launch.nproc_per_node=3"]),  # nor 3 dp ranks
        ("parallel.ep", ["model=llama", "model.n_layers=2", *EP2]),  # a dense model
        # with context parallel ep spans whole cp groups: 2 is not a multiple of cp=4
        ("parallel.ep", [*base, *cp2[:-1], "parallel.cp=4", "parallel.ep=2", "launch.nproc_per_node=4"]),
        ("parallel.version", [*base, *EP2, "parallel.version=1"]),
    ]
    for key, args in cases:
        with pytest.raises(ConfigError) as err:
            validate(compose_config(args))
        assert err.value.key == key and "\n" not in str(err.value), str(err.value)


# A Llama with 4 routed experts (top 2, dropless), 5 steps on a global batch of 8, with the default
# balance: the auxiliary loss over the global batch (model.moe.balance_scope=global: f is the last
# step's over every rank and micro-batch), so every split of the batch trains as one process
MOE_RUN = ["model=llama", "model.flavor=debug_moe", "model.dim=32", "model.n_layers=2", "model.n_heads=4",
           "model.n_kv_heads=2", "model.ffn_hidden=64", "model.moe.experts=4", "model.moe.top_k=2",
           "data.seq_len=16", "data.max_bytes=20000", "steps=5", "progress=false"]  # fmt: skip
ONE_PROCESS = ["parallel=none", "data.batch_size=8"]
EP2 = ["parallel=fsdp", "parallel.ep=2", "launch.nproc_per_node=2"]


def moe_run(tmp_path, name: str, *overrides: str) -> list[float]:
    """The run's losses, then its gradient norms (one list). Its collectives are counted (every
    step sampled): the planner's check is in its summary."""
    proc = train_cli([*MOE_RUN, "metrics.sample_every=1", *overrides], tmp_path / name)
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = read_metrics(tmp_path / name)
    return [m["loss"] for m in metrics] + [m["grad_norm"] for m in metrics]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """(losses then gradient norms, run folder) of MOE_RUN in one process on the global batch of 8:
    the reference of every default-suite parity test here, run once."""
    root = tmp_path_factory.mktemp("moe")
    return moe_run(root, "one", *ONE_PROCESS), root / "one"


def close(got: list[float], want: list[float], tol: float = 1e-5) -> bool:
    return len(got) == len(want) and all(abs(g - w) <= tol * abs(w) for g, w in zip(got, want, strict=True))


COUNT = ["+callbacks.count._target_=tests.probes.CountCollectives", "metrics.sample_every=0"]


def collectives(run) -> list[dict[str, int]]:
    return json.loads((run / "collectives-rank0.json").read_text())


@pytest.mark.slow  # the covering subset trains llama(moe) on its defaults under ddp, fsdp, tp, pp, cp, hybrid
def test_the_default_balance_trains_as_one_process_under_ddp_fsdp_ep_and_pp(tmp_path, one_process):
    """The default config (balance=aux_loss, balance_scope=global): 5 steps in fp32 under ddp x2,
    fsdp x2, ep x2 (fsdp) and pp x2 (4 micro-batches) equal one process within 1e-5, losses and
    gradient norms (balance_scope=micro, each rank's own batch's balance, does not: the unit test
    above). A step's collectives, counted from its start to its figures' all-reduce, are a dense
    step's under ddp and fsdp, plus expert parallel's all-to-alls (5 a routed layer): the routing's
    counts ride the step's one all-reduce, and DDP leaves the routers' buffers alone."""
    want = one_process[0]
    ddp = ["parallel=ddp", "launch.nproc_per_node=2", "data.batch_size=4"]
    fsdp = ["parallel=fsdp", "launch.nproc_per_node=2", "data.batch_size=4"]
    layouts = {"ddp": [*ddp, *COUNT], "fsdp": [*fsdp, *COUNT], "ep": [*fsdp, "parallel.ep=2", *COUNT],
               "pp": ["parallel=pp", "launch.nproc_per_node=2", "data.batch_size=8"]}  # fmt: skip
    for name, overrides in layouts.items():
        got = moe_run(tmp_path, name, *overrides)
        assert close(got, want), (name, got, want)
    for name, overrides in (("dense_ddp", ddp), ("dense_fsdp", fsdp)):
        proc = train_cli([*MOE_RUN, "model.moe.experts=0", *overrides, *COUNT], tmp_path / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert collectives(tmp_path / "ddp") == collectives(tmp_path / "dense_ddp")
    assert collectives(tmp_path / "fsdp") == collectives(tmp_path / "dense_fsdp")
    dense_plus = [step | {"all_to_all": 2 * 5} for step in collectives(tmp_path / "dense_fsdp")]
    assert collectives(tmp_path / "ep") == dense_plus and len(dense_plus) == 5


def test_sequence_parallel_and_context_parallel_route_every_token_once_as_one_process(tmp_path, one_process):
    """tp x2 with sequence parallel (each tp rank routes its own half of each sequence through
    experts whole on it: the routed layers' gradients summed over tp, each rank's auxiliary loss
    weighing half) and ep x2 over a cp x2 group (both halves of each sequence routed to the
    experts split over the two cp ranks): 5 steps in fp32 with the default balance equal one
    process within 1e-5, losses, gradient norms and the routing figures (every token counted once)."""
    want, one = one_process
    layouts = {"tp_sp": ["parallel=tp", "parallel.sequence_parallel=true", "launch.nproc_per_node=2", "data.batch_size=8"],
               "cp_ep": ["parallel=fsdp", "parallel.cp=2", "parallel.ep=2", "launch.nproc_per_node=2", "data.batch_size=8"]}  # fmt: skip
    figures = [[m[k] for m in read_metrics(one)] for k in ("moe_aux_loss", "moe_tokens_per_expert")]
    for name, overrides in layouts.items():
        assert close(moe_run(tmp_path, name, *overrides), want), name
        metrics = read_metrics(tmp_path / name)
        assert close([m["moe_aux_loss"] for m in metrics], figures[0]), name
        assert [m["moe_tokens_per_expert"] for m in metrics] == figures[1], name


@pytest.mark.slow
def test_routed_layers_under_sequence_parallel_and_context_parallel_compose_as_one_process(tmp_path):
    """The long tier of the test above: sequence parallel with FSDP (dp_shard 2 x tp 2), with
    expert parallel (ep 2 x tp 2: each tp rank's tokens to its ep peers) and with a pipeline
    (pp 2 x tp 2); ep 4 over dp_shard 2 x cp 2 (ep spans the cp groups of two dp_shard ranks), and
    ep 2 over cp 2 with the experts sharded by FSDP over dp_shard 2: each equals one process
    within 1e-5 for 5 steps and routes the same tokens to each expert; under ep x cp the planner's
    state bytes, calls and all-to-all bytes are the measured exactly."""
    want = moe_run(tmp_path, "one", *ONE_PROCESS)
    hybrid = ["parallel=hybrid", "parallel.dp_replicate=1", "launch.nproc_per_node=4"]
    sp = ["parallel.sequence_parallel=true", "parallel.cp=1"]
    layouts = {
        "fsdp2_tp2_sp": [*hybrid, *sp, "parallel.tp=2", "parallel.pp=1", "parallel.dp_shard=2", "data.batch_size=4"],
        "ep2_tp2_sp": [*hybrid, *sp, "parallel.tp=2", "parallel.pp=1", "parallel.dp_shard=2", "parallel.ep=2",
                       "data.batch_size=4"],
        "pp2_tp2_sp": [*hybrid, *sp, "parallel.tp=2", "parallel.pp=2", "parallel.dp_shard=1", "data.batch_size=8"],
        "cp2_ep4": [*hybrid, "parallel.tp=1", "parallel.pp=1", "parallel.cp=2", "parallel.dp_shard=2", "parallel.ep=4",
                    "data.batch_size=4"],
        "cp2_ep2_fsdp2": [*hybrid, "parallel.tp=1", "parallel.pp=1", "parallel.cp=2", "parallel.dp_shard=2",
                          "parallel.ep=2", "data.batch_size=4"],
    }  # fmt: skip
    routed = read_summary(tmp_path / "one")["moe"]["tokens_per_expert"]
    for name, overrides in layouts.items():
        got = moe_run(tmp_path, name, *overrides)
        assert close(got, want), (name, got, want)
        summary = read_summary(tmp_path / name)
        assert summary["moe"]["tokens_per_expert"] == routed, name
        if name.startswith("cp"):  # the planner's experts over dp_shard x cp / ep ranks: its state and calls exact
            exact = ("param_bytes", "grad_bytes", "optim_bytes", "comm_calls", "all_to_all_bytes")
            assert all(summary["plan"]["error"][k] == 0.0 for k in exact), (name, summary["plan"]["error"])


@pytest.mark.slow  # the default balance's parity above is the default suite's; this is bias's
def test_bias_balancing_trains_as_one_process_under_ddp_ep_and_pp(tmp_path):
    """model.moe.balance=bias (DeepSeek-V3's loss-free balancing: each expert's routing bias moves
    after the step by the step's global loads, on the device): 5 steps in fp32 under ddp x2, ep x2
    and pp x2 equal one process within 1e-5, losses and gradient norms."""
    bias = ["model.moe.balance=bias"]
    want = moe_run(tmp_path, "one", *bias, *ONE_PROCESS)
    layouts = {"ddp": ["parallel=ddp", "launch.nproc_per_node=2", "data.batch_size=4"], "ep": [*EP2, "data.batch_size=4"],
               "pp": ["parallel=pp", "launch.nproc_per_node=2", "data.batch_size=8"]}  # fmt: skip
    for name, overrides in layouts.items():
        got = moe_run(tmp_path, name, *bias, *overrides)
        assert close(got, want), (name, got, want)


def test_an_moe_step_syncs_the_host_no_more_than_a_dense_step(monkeypatch, tmp_path):
    """The framework reads no routed figure on the host between the ledger's syncs (one per logged
    step): 8 more steps at log_every=4 add 2 syncs, with experts as without."""
    base = [*MOE_RUN[:-2], "metrics.log_every=4", "metrics.sample_every=0", "data.batch_size=2"]
    for experts in (4, 0):
        model = [*base, f"model.moe.experts={experts}"]
        short = count_syncs(monkeypatch, [*model, "steps=8"], tmp_path / f"short{experts}")
        long = count_syncs(monkeypatch, [*model, "steps=16"], tmp_path / f"long{experts}")
        assert long - short == 2, (experts, short, long)


@pytest.mark.slow
def test_expert_parallel_composes_with_fsdp_hsdp_tp_pipelines_and_accumulation(tmp_path):
    """The must-hold layouts beside ep x2: ep 2 x fsdp 2 (experts sharded by FSDP over the 2 ranks
    left), HSDP 2 x 2 with ep 2, ep 2 x tp 2 (each tp rank runs the routed layers whole on its
    replicated tokens), pipeline 2 x ep 2, and ep x2 with 2 micro-batches a step: each equals one
    process within 1e-5 for 5 steps (losses and gradient norms) and routes the same tokens to each
    expert; its state bytes per rank and all-to-all bytes (the mean rank's) are the planner's
    forecast exactly (under bf16 and amp too), its saved activations within 15%."""
    want = moe_run(tmp_path, "one", *ONE_PROCESS)
    hybrid = ["parallel=hybrid", "parallel.cp=1", "parallel.ep=2", "launch.nproc_per_node=4"]
    layouts = {
        "ep2_fsdp2": ["parallel=fsdp", "parallel.ep=2", "launch.nproc_per_node=4", "data.batch_size=2"],
        "hsdp_ep2": [
            *hybrid,
            "parallel.tp=1",
            "parallel.pp=1",
            "parallel.dp_replicate=2",
            "parallel.dp_shard=2",
            "data.batch_size=2",
        ],  # fmt: skip
        "ep2_tp2": [  # without sequence parallel (the planner's layout: tp ranks route the same tokens)
            *hybrid,
            "parallel.sequence_parallel=false",
            "parallel.tp=2",
            "parallel.pp=1",
            "parallel.dp_replicate=1",
            "parallel.dp_shard=2",
            "data.batch_size=4",
        ],  # fmt: skip
        "pp2_ep2": [
            *hybrid,
            "parallel.tp=1",
            "parallel.pp=2",
            "parallel.dp_replicate=1",
            "parallel.dp_shard=2",
            "data.batch_size=4",
        ],  # fmt: skip
        "ep2_accumulation": [*EP2, "data.batch_size=2", "accumulation_steps=2"],
    }
    for name, overrides in layouts.items():
        got = moe_run(tmp_path, name, *overrides)
        assert close(got, want), (name, got, want)
        summary = read_summary(tmp_path / name)
        exact = ("param_bytes", "grad_bytes", "optim_bytes", "comm_calls", "all_to_all_bytes")
        assert all(summary["plan"]["error"][k] == 0.0 for k in exact), (name, summary["plan"]["error"])
        # the same routing, counted once (tp ranks route the same tokens)
        assert summary["moe"]["tokens_per_expert"] == read_summary(tmp_path / "one")["moe"]["tokens_per_expert"], name
        assert abs(summary["plan"]["error"]["activation_bytes"]) < 0.15, (name, summary["plan"])  # 5-11% under
    # 16-bit runs (FSDP2's mixed precision) send 2-byte rows: still the forecast to the byte
    for precision in ("bf16", "amp"):
        moe_run(tmp_path, precision, *EP2, "data.batch_size=4", f"precision={precision}")
        assert read_summary(tmp_path / precision)["plan"]["error"]["all_to_all_bytes"] == 0.0, precision


# ----------------------------------------------------------------------------- Mixtral in and out

VOCAB = 257  # the bytes tokenizer's


def mixtral(folder, seed: int = 0):
    """A tiny random MixtralForCausalLM (4 experts, top-2, GQA), saved to `folder`."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.MixtralConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.MixtralForCausalLM(config).eval()
    model.save_pretrained(folder)
    return model


def test_a_mixtral_loads_with_transformers_loss_and_goes_back_bitwise(tmp_path):
    """Mixtral's per-expert tensors stack into our grouped weights (softmax router, top-2
    renormalised): the logits and the loss are transformers' own within 1e-5, and our state dict
    in Mixtral's layout is the checkpoint's tensors bit for bit."""
    from framework.hf import load_pretrained
    from models.llama_hf import iter_hf_tensors, to_hf

    hf = mixtral(tmp_path)
    ours = Llama(hf_config=str(tmp_path)).eval()
    assert ours.args.moe.experts == 4 and ours.args.moe.norm_topk
    assert load_pretrained(ours, str(tmp_path), torch.device("cpu"), ours.from_hf_name) == []
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, want = ours(tokens), hf(tokens, labels=tokens)
    assert torch.allclose(logits, want.logits, atol=1e-5, rtol=0)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    assert abs(loss.item() - want.loss.item()) <= 1e-5 * want.loss.item()
    files = dict(iter_hf_tensors(str(tmp_path)))
    back = to_hf(ours.state_dict(), ours.args)
    assert set(back) == set(files)
    assert all(torch.equal(back[name], tensor) for name, tensor in files.items())


@pytest.fixture(scope="module")
def mixtral_ep(tmp_path_factory):
    """A tiny Mixtral written here, trained 6 steps on a global batch of 8 from its weights: in one
    process; under fsdp ep x2 (2 of its 4 experts a rank), saving at steps 3 and 6 and exporting;
    and in one process again, resumed from the ep run's step-3 checkpoint."""
    root = tmp_path_factory.mktemp("mixtral_ep")
    hf = mixtral(root / "hf")
    base = ["model=llama", f"model.pretrained={root / 'hf'}", "data.seq_len=16",
            "data.max_bytes=20000", "steps=6", "progress=false", "metrics.sample_every=0"]  # fmt: skip
    runs = {
        "one": [*ONE_PROCESS],
        "ep": [*EP2, "data.batch_size=4", "checkpoint.every=3", "checkpoint.export=true", "metrics.sample_every=1"],
        "resumed": [*ONE_PROCESS, f"checkpoint.resume={root / 'ep/checkpoints/step-000003'}"],
    }
    for name, args in runs.items():
        proc = train_cli([*base, *args], root / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root, hf, {name: read_metrics(root / name) for name in runs}


def series(metrics: list[dict], key: str = "loss") -> list[float]:
    return [m[key] for m in metrics]


def test_expert_parallel_trains_as_one_process(mixtral_ep):
    """fp32, dropless: ep x2 (tokens exchanged by all-to-all) equals one process on the same
    global batch within 1e-5 for 6 steps, losses and gradient norms (AdamW would hide a gradient
    off by a constant factor from the losses); each routed layer's forward and backward are 5
    all-to-alls a step (counts, tokens, outputs; their gradients), 2 layers; the state bytes per
    rank and the all-to-all bytes a rank sends a step (the mean rank's) are the planner's
    forecast exactly."""
    root, _, runs = mixtral_ep
    assert close(series(runs["ep"]), series(runs["one"])), runs
    assert close(series(runs["ep"], "grad_norm"), series(runs["one"], "grad_norm")), runs
    summary = read_summary(root / "ep")
    assert summary["parallel_dims"]["ep"] == 2
    assert summary["comm"]["by_op"]["all_to_all"]["calls"] == 2 * 5
    # each rank's state, experts included (2 of 4 a rank, whole: dp_shard / ep = 1), as the planner forecast it
    error = summary["plan"]["error"]
    assert error["param_bytes"] == error["grad_bytes"] == error["optim_bytes"] == 0.0, error
    # 2 layers x (8 B x 4 experts + 4 x 4 x 16 tokens x top-2 x 32 wide x 4 B), as the ranks sent it
    all_to_all = summary["comm_by_op"]["all_to_all"]  # over the ranks: the mean rank's, the busiest's over it
    assert (
        all_to_all["mean_bytes"]
        == 2 * (8 * 4 + 4 * 4 * 16 * 2 * 32 * 4)
        == summary["plan"]["predicted"]["all_to_all_bytes"]
    )
    assert error["all_to_all_bytes"] == 0.0 and all_to_all["imbalance"] >= 1.0


def test_an_expert_parallel_checkpoint_resumes_in_one_process(mixtral_ep):
    """The ep run's checkpoint holds whole experts (DCP): one process resumes it at step 3 and
    continues the reference's losses."""
    _, _, runs = mixtral_ep
    assert close(series(runs["resumed"]), series(runs["one"])[3:]), runs


def test_a_mixtral_trained_under_expert_parallel_exports_what_transformers_reloads(mixtral_ep):
    """model.pretrained=<a Mixtral folder>, trained under fsdp ep x2, checkpoint.export=true: the
    exported folder loads in transformers with the trained model's logits (read back from its
    last DCP checkpoint), and training moved them away from the pretrained ones."""
    transformers = pytest.importorskip("transformers")
    from framework.checkpoint.export import checkpoint_tensors, read_tensor

    root, hf, _ = mixtral_ep
    ckpt = root / "ep/checkpoints/step-000006"
    trained = Llama(hf_config=str(root / "hf")).eval()
    state = {n: read_tensor(str(ckpt), n, *meta) for n, meta in checkpoint_tensors(str(ckpt)).items()}
    assert not trained.load_state_dict({k: v for k, v in state.items() if k in trained.state_dict()}).missing_keys
    exported = transformers.AutoModelForCausalLM.from_pretrained(root / "ep/hf").eval()
    assert type(exported).__name__ == "MixtralForCausalLM"
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.allclose(exported(tokens).logits, trained(tokens), atol=1e-5, rtol=0)
        assert not torch.allclose(exported(tokens).logits, hf(tokens).logits, atol=1e-3)


# ----------------------------------------------------------------------------- the planner


def test_the_planner_prices_expert_parallel_and_auto_chooses_it_where_only_it_fits():
    """Mixtral-like experts (8 of 2048 wide) at 4 ranks: the search ranks fsdp with ep 2 and 4 and
    the hybrids with ep beside the layouts that hold every expert; each ep layout's experts' state
    is experts / ep sharded over the ranks left, its all-to-all bytes the routed layers' 8 E + 4 T
    k dim each (whatever ep), and FSDP's gathered units hold experts / ep. A budget between the
    smallest peak without ep and the smallest with it: parallel=auto runs an ep layout that fits."""
    from framework.plan.profile import machine_profile
    from framework.plan.search import memory_budget_bytes, rank
    from tests.helpers import compose_config

    cfg = compose_config(["model=llama", "model.flavor=debug_moe", "model.dim=64", "model.n_layers=2",
                          "model.moe.experts=8", "model.moe.hidden=2048", "data.seq_len=32", "data.batch_size=2",
                          "plan.latency_us=100", "plan.intra_node_gbps=1", "plan.peak_tflops=0.05",
                          "plan.op_overhead_us=20", "launch.nproc_per_node=4"])  # fmt: skip
    profile = machine_profile(cfg, 4, "config")
    ranked = rank(cfg, 4, profile, memory_budget_bytes(cfg, 4))
    ep = {r.prediction["layout"] for r in ranked if "ep" in r.prediction["layout"].split()[-1]}
    assert {"fsdp ep2", "fsdp ep4", "hybrid dp2xpp2 ep2", "hybrid dp2xtp2 ep2"} <= ep, ep
    plain = [r for r in ranked if r.knobs.checkpoint_every == 0 and r.knobs.accumulation_steps == 1]
    by_layout = {r.prediction["layout"]: r.prediction for r in plain}
    experts = 2 * 3 * 8 * 2048 * 64  # 2 layers x w1, w2, w3 (8 x 2048 x 64 each): every rank's share is a quarter
    rest = by_layout["fsdp"]["memory"]["param_bytes"] - 4 * experts // 4
    for name in ("fsdp ep2", "fsdp ep4"):
        assert by_layout[name]["memory"]["param_bytes"] == rest + 4 * experts // 4, name
        tokens = 32 * cfg.data.batch_size  # a rank's micro-batch: T = 64 tokens, top-2, 64 wide
        assert by_layout[name]["all_to_all_bytes"] == 2 * (8 * 8 + 4 * tokens * 2 * 64 * 4), name
    assert by_layout["fsdp ep4"]["memory"]["gathered_bytes"] < by_layout["fsdp ep2"]["memory"]["gathered_bytes"]
    assert by_layout["fsdp ep2"]["memory"]["gathered_bytes"] < by_layout["fsdp"]["memory"]["gathered_bytes"]
    without = min(r.footprint() for r in ranked if r.prediction["layout"] not in ep)
    least = min(r.footprint() for r in ranked if r.prediction["layout"] in ep)
    assert least < without - 4 * 2**20, (least, without)  # ep saves what every expert gathered at once costs
    best = rank(cfg, 4, profile, (least + without) / 2)[0]
    assert best.fits and "parallel.ep" in " ".join(best.overrides), best.overrides


def test_a_sweep_report_shows_the_experts_load_and_all_to_all_where_runs_have_experts(tmp_path):
    """The report's columns: the expert load imbalance and expert parallel's all-to-all MB a step
    where a run has routed experts (the best marked), none in a sweep of dense runs."""
    import json

    from framework.doors.report import find_runs, markdown

    def job(root, num: int, parallel: str, moe: dict | None) -> None:
        run = root / str(num)
        (run / ".hydra").mkdir(parents=True)
        (run / ".hydra" / "overrides.yaml").write_text(f"- parallel={parallel}\n")
        summary = {"status": "ok", "choices": {"parallel": parallel}, "world_size": 2, "final_loss": 2.0,
                   "throughput": {"tokens_per_s": 1000.0 + num}}  # fmt: skip
        if moe is not None:  # as a run with routed experts writes it: the figures' block, their declared column
            sent = moe.pop("all_to_all_bytes")
            summary |= {"moe": moe, "figure_columns": [["expert load", "moe", "load_imbalance", "min"]],
                        "comm_by_op": {"all_to_all": {"mean_bytes": sent}} if sent else {}}  # fmt: skip
        (run / "summary.json").write_text(json.dumps(summary))
        (run / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')

    job(tmp_path / "moe", 0, "fsdp", {"load_imbalance": 1.31, "all_to_all_bytes": None})
    job(tmp_path / "moe", 1, "fsdp", {"load_imbalance": 1.52, "all_to_all_bytes": 2.5e6})
    text = markdown(find_runs(tmp_path / "moe"), "t", [])
    header = next(line for line in text.splitlines() if line.startswith("| job"))
    assert "expert load" in header and "all-to-all MB/step" in header, header
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert "**1.31**" in rows["0"] and "| 2.5 |" in rows["1"], rows
    job(tmp_path / "dense", 0, "ddp", None)
    assert "expert load" not in markdown(find_runs(tmp_path / "dense"), "t", [])
