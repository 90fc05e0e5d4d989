"""Unit tests of the parts: models, precision, memory accounting, samplers, schedules."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from framework.config import compose
from framework.config.schema import AmpConfig, PrecisionConfig
from framework.data.datasets import VarlenSequences, VarlenShape
from framework.data.samplers import BatchSizes, distributed_sampler, permutation
from framework.levers import apply_activation_checkpointing
from framework.measure.memory import SavedActivationMeter, model_state_bytes
from framework.optimizers.build import build_optimizer
from framework.precision import build_precision
from framework.schedules.shapes import WarmupCosine
from models import GPT, MLP, LSTMClassifier, ResNet
from tests.helpers import ROOT


def test_models_never_import_torch_distributed():
    for path in (ROOT / "models").glob("*.py"):
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not any(name.startswith("torch.distributed") for name in names), path


def test_model_shapes():
    assert GPT(n_layer=2, n_head=2, n_embd=16, block_size=8)(torch.randint(256, (3, 8))).shape == (
        3,
        8,
        256,
    )
    assert MLP(in_dim=5, num_classes=3)(torch.randn(4, 5)).shape == (4, 3)
    assert ResNet(num_classes=7)(torch.randn(2, 3, 16, 16)).shape == (2, 7)
    lstm = LSTMClassifier(vocab_size=10, num_classes=3)
    assert lstm(torch.randint(1, 10, (4, 6)), torch.tensor([6, 3, 1, 2])).shape == (4, 3)


def test_gpt_is_causal():
    model = GPT(n_layer=2, n_head=2, n_embd=16, block_size=8).eval()
    x = torch.randint(256, (1, 8))
    y = x.clone()
    y[0, 5:] = (y[0, 5:] + 1) % 256  # change the future only
    assert torch.allclose(model(x)[0, :5], model(y)[0, :5], atol=1e-6)


def test_lstm_ignores_padding():
    torch.manual_seed(0)
    model = LSTMClassifier(vocab_size=10, num_classes=3).eval()
    seq = torch.tensor([[3, 4, 5]])
    padded = torch.tensor([[3, 4, 5, 0, 0, 0]])
    a = model(seq, torch.tensor([3]))
    b = model(padded, torch.tensor([3]))
    assert torch.allclose(a, b, atol=1e-6)


def test_lstm_trains_under_cpu_bf16_autocast_a_batch_of_one_length():
    """oneDNN's bfloat16 LSTM cannot build a primitive for a batch whose sequences all have one
    length (two micro-batches of a varlen batch under accumulation met it): such a batch trains,
    and oneDNN is on again after the recurrence."""
    torch.manual_seed(0)
    model = LSTMClassifier(embed_dim=16, hidden=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(1, 32, (3, 4)), torch.tensor([4, 4, 4])).float().sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.lstm.parameters())
    assert torch.backends.mkldnn.enabled


@pytest.mark.parametrize("checkpoint_every", [0, 1, 2])
def test_gpt_flops_per_token_match_flops_counted_on_a_real_training_step(checkpoint_every):
    """MFU's FLOPs (and HFU's, with the recomputation of checkpointed blocks) against what torch's
    FlopCounterMode counts in one forward + backward. Attention runs on SDPA's math path here:
    the fused CPU kernel has no FLOP formula in the counter, so it would count zero."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from framework.loss import cross_entropy

    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=64)
    recomputed = -(-4 // checkpoint_every) if checkpoint_every else 0
    predicted = model.flops_per_token(64, recomputed)
    if checkpoint_every:
        apply_activation_checkpointing(model, "blocks", checkpoint_every)
    tokens = torch.randint(0, 256, (2, 65))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    assert predicted == counter.get_total_flops() / (2 * 64)  # exact: the same matmuls, counted
    # the token embedding is a lookup, not a matmul; the output head is one
    assert model.matmul_params() == sum(
        p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "emb" not in n
    )


def test_state_bytes_are_exact_on_a_known_model():
    model = torch.nn.Sequential(torch.nn.Linear(10, 5), torch.nn.Linear(5, 2, bias=False))  # 55 + 10 params
    opt = build_optimizer(model, compose([]).optim)
    assert model_state_bytes(model, opt) == {
        "param_bytes": 65 * 4,
        "grad_bytes": 0,
        "optim_bytes": 0,
    }
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    # AdamW keeps exp_avg and exp_avg_sq per parameter (fp32) plus a scalar step per tensor
    steps = sum(s["step"].numel() * s["step"].element_size() for s in opt.state.values())
    assert model_state_bytes(model, opt) == {
        "param_bytes": 260,
        "grad_bytes": 260,
        "optim_bytes": 2 * 260 + steps,
    }


def test_saved_activation_meter_counts_saved_inputs_not_parameters():
    lin = torch.nn.Linear(100, 100, bias=False)
    meter = SavedActivationMeter(lin)
    x = torch.randn(8, 100, requires_grad=True)
    with meter.measure():
        y = lin(x)  # saves its input x (8*100 floats) and the weight (a parameter: not counted)
    assert meter.peak == 8 * 100 * 4
    y.sum().backward()


def test_a_forward_never_backwarded_leaves_nothing_saved_and_the_meter_changes_no_gradient():
    """An op that saves its own output (SDPA, exp) must not hold its graph through the meter: a
    pipeline's first stage runs one forward to infer shapes and never backwards it (issue 35)."""
    torch.manual_seed(0)
    model = GPT(n_layer=2, n_head=2, n_embd=32, block_size=16)
    meter, x = SavedActivationMeter(model), torch.randint(256, (4, 16))
    with meter.measure():
        model(x).exp().sum()  # dropped, as the shape inference drops it
        assert meter.live == 0
        model(x).exp().mean().backward()
    metered = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).exp().mean().backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(metered, model.parameters(), strict=True))


def test_activation_checkpointing_saves_less_and_keeps_gradients_identical():
    def grads_and_saved(checkpointed: bool):
        torch.manual_seed(0)
        model = GPT(n_layer=4, n_head=2, n_embd=32, block_size=16)
        if checkpointed:
            assert apply_activation_checkpointing(model, "blocks", every=1) == 4
        meter = SavedActivationMeter(model)
        x = torch.randint(256, (4, 16))
        with meter.measure():
            loss = model(x).logsumexp(-1).mean()
        loss.backward()
        return {n: p.grad for n, p in model.named_parameters()}, meter.peak

    plain, plain_bytes = grads_and_saved(False)
    ckpt, ckpt_bytes = grads_and_saved(True)
    assert ckpt_bytes <= 0.4 * plain_bytes
    strip = {n.replace("_checkpoint_wrapped_module.", ""): g for n, g in ckpt.items()}
    assert strip.keys() == plain.keys()
    for name in plain:
        assert torch.equal(plain[name], strip[name]), name


def test_amp_scales_the_loss_and_bf16_does_not():
    amp = build_precision(OmegaConf.structured(AmpConfig()), torch.device("cpu"))
    bf16 = build_precision(OmegaConf.structured(PrecisionConfig(name="bf16")), torch.device("cpu"))
    assert amp.scaler.is_enabled() and not bf16.scaler.is_enabled()
    lin = torch.nn.Linear(4, 4)
    with amp.autocast():
        assert lin(torch.randn(2, 4)).dtype == torch.float16
    with bf16.autocast():
        assert lin(torch.randn(2, 4)).dtype == torch.bfloat16
    assert amp.scaler.scale(torch.tensor(1.0)).item() == 65536.0


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    schedule = WarmupCosine(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), 100, 10, 0.1)
    factor = schedule.factor
    assert factor(0) == pytest.approx(0.1)
    assert factor(9) == pytest.approx(1.0)
    assert factor(100) == pytest.approx(0.1)
    assert factor(55) < factor(20)


def distributed(n: int, world: int, rank: int, seed: int, batch: int = 4, drop_last: bool = True):
    return distributed_sampler(partial(permutation, n, seed), world, rank, BatchSizes(batch * world), drop_last)


def flat(batches) -> list[int]:
    return [i for batch in batches for i in batch]


@pytest.mark.parametrize("world,drop_last", [(1, False), (2, False), (3, False), (3, True)])
def test_sampler_covers_every_sample_once_per_epoch(world, drop_last):
    n = 100
    per_rank = [flat(distributed(n, world, r, seed=1, drop_last=drop_last)) for r in range(world)]
    everything = flat(per_rank)
    if drop_last:  # documented: the tail that does not fill a global batch is dropped
        assert len(everything) == (n // (4 * world)) * 4 * world and len(set(everything)) == len(everything)
    else:  # documented: the tail padded with repeats from the start so every rank gets as many
        assert set(everything) == set(range(n)) and len(everything) - n < world
        assert len({len(p) for p in per_rank}) == 1


def test_sampler_order_does_not_depend_on_world_size():
    one = flat(distributed(40, 1, 0, seed=3, batch=8))
    two = [flat(distributed(40, 2, r, seed=3)) for r in range(2)]
    assert [i for pair in zip(*two, strict=True) for i in pair] == one


def test_resumed_sampler_continues_where_it_stopped_in_samples_whatever_the_batch():
    """The position counts samples of the epoch's order: a resume with another world size and
    another batch reads the samples an uninterrupted run would read next."""
    first = distributed(50, 2, 1, seed=7)
    first.set_epoch(3)
    full = list(first)
    resumed = distributed(50, 2, 1, seed=7)
    resumed.load_state_dict({"epoch": 3, "start": 16})
    assert list(resumed) == full[2:]  # 16 samples: two global batches of 2 ranks x 4
    assert list(resumed) == full  # only the resumed epoch starts part-way
    one = distributed(50, 1, 0, seed=7, batch=48)
    one.set_epoch(3)
    order = flat(one)
    wider = [distributed(50, 3, r, seed=7, batch=2) for r in range(3)]
    for s in wider:
        s.load_state_dict({"epoch": 3, "start": 16})
    batches = zip(*(list(s) for s in wider), strict=True)
    assert [i for step in batches for share in zip(*step, strict=True) for i in share] == order[16:46]


def test_varlen_lengths_are_long_tailed_and_labels_learnable():
    data = VarlenSequences(VarlenShape(2000, vocab_size=32, num_classes=4, min_len=4, max_len=128, mean_len=24), seed=0)
    lengths = data.lengths.float()
    assert lengths.min() >= 4 and lengths.max() <= 128
    assert lengths.max() > 3 * lengths.median()  # a long tail
    (tokens, lens), labels = data.collate([data[0], data[1]])
    assert tokens.shape == (2, int(lens.max())) and labels.shape == (2,)


def test_text_corpus_reads_a_folder(tmp_path: Path):
    from framework.data.datasets import ByteTextDataset

    (tmp_path / "a.txt").write_bytes(b"x" * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_bytes(b"y" * 50)
    data = ByteTextDataset(str(tmp_path), seq_len=9, max_bytes=1000)
    assert len(data) == 99 // 9
    (x,), y = data[0]
    assert torch.equal(x[1:], y[:-1])


def test_backend_knobs_of_one_sweep_job_do_not_leak_into_the_next(monkeypatch):
    import os

    from framework.doors.launch import export_backend_env

    monkeypatch.setenv("NCCL_DEBUG", "WARN")  # from the user's shell
    monkeypatch.delenv("NCCL_ALGO", raising=False)
    export_backend_env({"NCCL_ALGO": "Tree", "NCCL_DEBUG": "INFO"})
    assert os.environ["NCCL_ALGO"] == "Tree" and os.environ["NCCL_DEBUG"] == "INFO"
    export_backend_env({})  # the next job sets no knobs
    assert "NCCL_ALGO" not in os.environ and os.environ["NCCL_DEBUG"] == "WARN"


def test_varlen_text_source_reads_paragraphs_of_the_corpus(tmp_path):
    (tmp_path / "doc.txt").write_bytes(b"short one\n\n" + b"x" * 40 + b"\n\n" + b"y" * 300)
    data = VarlenSequences(VarlenShape(10, 256, 4, 4, 64, 24), seed=0, task="lm", source="text", path=str(tmp_path))
    assert data.lengths.tolist() == [9, 40, 64]  # paragraphs, cut at max_len
    (inputs,), target = data.collate([data[0], data[2]])
    assert inputs.shape == (2, 63) and (target[0, 8:] == -100).all()  # padding carries no loss


def test_amp_trains_with_a_dynamic_loss_scale(tmp_path):
    """precision=amp end to end: float16 autocast on CPU, the GradScaler's scale in every
    metrics line (65536 to start; halved after any step whose gradients overflow), loss falls."""
    from framework.run.trainer import run
    from tests.helpers import compose_config, read_metrics

    cfg = compose_config(["experiment=smoke", "logger=none", "parallel=none", "precision=amp", "steps=6"])
    summary = run(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)), str(tmp_path), {})
    metrics = read_metrics(tmp_path)
    scales = [m["loss_scale"] for m in metrics]
    assert all(s is not None and s > 0 for s in scales) and scales[0] <= 65536.0
    assert all(b in (a, a / 2) for a, b in zip(scales, scales[1:], strict=False))  # growth_interval 2000
    assert summary["final_loss"] < summary["first_loss"]


def test_host_allocator_policy_by_strategy_and_applied_through_glibc():
    """auto: lean where FSDP gathers unit by unit, steady elsewhere; glibc's mallopt accepts both
    (on glibc), and `glibc` leaves its defaults alone."""
    import sys

    from framework.measure.memory import host_allocator, set_host_allocator

    assert [host_allocator("auto", p) for p in ("fsdp", "hybrid", "ddp", "none", "pp")] == \
        ["lean", "lean", "steady", "steady", "steady"]  # fmt: skip
    assert host_allocator("glibc", "fsdp") == "glibc"
    assert set_host_allocator("glibc") is False
    if sys.platform.startswith("linux"):
        assert set_host_allocator("lean") and set_host_allocator("steady")


def test_amp_loss_scale_halves_on_overflow_and_grows_after_the_interval(tmp_path, monkeypatch):
    """The scaler is dynamic: growth_interval=2 clean steps double the scale, an injected
    overflow (a NaN loss at step 3, so inf/nan gradients) skips that update and halves it."""
    from framework.run.trainer import run
    from tests.helpers import compose_config, read_metrics

    monkeypatch.setenv("HYDRADIST_FAULT", "0:2:nan")
    cfg = compose_config(["experiment=smoke", "logger=none", "parallel=none", "precision=amp", "steps=6",
                          "precision.growth_interval=2", "nonfinite=skip", "launch.nproc_per_node=1"])  # fmt: skip
    run(OmegaConf.create(OmegaConf.to_container(cfg, resolve=True)), str(tmp_path), {})
    metrics = read_metrics(tmp_path)
    assert [m["loss_scale"] for m in metrics] == [65536.0, 131072.0, 65536.0, 65536.0, 131072.0, 131072.0]
    assert [m["skipped"] for m in metrics] == [False, False, True, False, False, False]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_a_rank_threads_over_the_cores_it_may_use_not_the_machines():
    """Under taskset or a SLURM/container cpuset, a one-process CPU run takes one thread per core
    it was given (not one per core of the machine, which would oversubscribe the ones it has)."""
    code = (
        "import os; os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})\n"
        "import torch; from framework.dist import init_distributed\n"
        "torch.set_num_threads(4); init_distributed('cpu', None, 60); print(torch.get_num_threads())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1"]


def test_the_export_cli_names_what_it_wrote():
    """An adapter is PEFT's, a Llama with routed experts transformers' Mixtral (not "a Llama"):
    read from the config.json the model declares (the contract's hf_config)."""
    from framework.doors.export import written_kind
    from models.llama import Llama

    with torch.device("meta"):
        dense, moe = Llama("debug").hf_config(), Llama("debug_moe").hf_config()
    assert written_kind(dense, "hf") == "Hugging Face LlamaForCausalLM (6 layers, dim 256, vocabulary 256)"
    assert written_kind(moe, "hf") == "Hugging Face MixtralForCausalLM (6 layers, dim 256, vocabulary 256, 4 experts)"
    assert written_kind(dense, "peft").startswith("a PEFT LoRA adapter of Hugging Face LlamaForCausalLM (")
