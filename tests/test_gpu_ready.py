"""Ready for the first GPU (issue 27): each CUDA-path decision that can be separated from the
hardware, as a pure function of (device count, local rank, device name, dtype, ...) tested with
those values on CPU; the rest are `gpu`-marked tests that benchmarks/gpu.sh runs on a GPU."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from framework.config import ConfigError
from framework.config.resolve import assume_cuda_devices, cuda_device_count, resolve_device
from framework.doors.compose import compose_run
from tests.helpers import compose_config, count_syncs, world_config

# --------------------------------------------------------------------------- devices


@pytest.mark.parametrize("gpus", [1, 8])
def test_the_suites_configs_compose_on_a_machine_with_gpus(gpus, tmp_path):
    """The suite's own composition (tests.helpers pins device=cpu) as on a machine with `gpus`
    visible GPUs, through the resolver every device decision reads: the experiments, the
    device-bound groups' choices, and the 2- and 4-worker CPU groups the suite starts."""
    from tests import test_config

    with assume_cuda_devices(gpus):
        assert cuda_device_count() == gpus and resolve_device(compose_config([])) == "cpu"
        for group in ("backend", "parallel", "memory", "precision", "experiment")[: 5 if gpus == 1 else 1]:
            for name in test_config.choices(group):
                if group == "experiment":
                    test_config.test_every_experiment_composes(name)
                elif name != "auto":  # parallel=auto: the planner's choice, composed by test_config
                    test_config.test_every_group_choice_composes(group, name, tmp_path)
        for parallel in ("ddp", "fsdp", "tp", "pp"):
            assert world_config(["experiment=smoke", f"parallel={parallel}"], 2)["device"] == "cpu"
        assert world_config(["experiment=smoke", "parallel=hybrid", "parallel.tp=2"], 4)["device"] == "cpu"
        if gpus == 1:  # unpinned, the same 2-worker config is refused on one GPU: the pin is what lets it run
            with pytest.raises(ConfigError, match="only 1 GPUs"):
                compose_run(["experiment=smoke", "logger=none", "launch.nproc_per_node=2"])
    assert cuda_device_count() == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_run_configs_take_the_configs_device_and_backend():
    from framework.run.sweep import device_and_backend

    cpu = world_config(["experiment=smoke"], 2)
    assert device_and_backend({"a": cpu, "b": cpu}) == ("cpu", "gloo")
    with assume_cuda_devices(2):  # resolved on a 2-GPU machine, a device=auto config runs on CUDA with NCCL
        auto = {**cpu, "device": "auto"}
        assert device_and_backend({"a": auto}) == ("cuda", "nccl")
        with pytest.raises(ValueError, match="one device and backend"):
            device_and_backend({"a": auto, "b": cpu})


# --------------------------------------------------------------------------- peaks


def test_the_peak_is_per_part_and_per_dtype():
    from framework.measure.datasheet import datasheet_tflops as peak

    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    sxm = "NVIDIA H100 80GB HBM3"
    assert (peak(sxm, bf16), peak(sxm, fp32, tf32=True), peak(sxm, fp32, tf32=False)) == (989.0, 494.7, 66.9)
    assert peak("NVIDIA H100 PCIe", bf16) == 756.5 and peak("NVIDIA H100 PCIe", fp32, True) == 378.0
    assert peak("NVIDIA H100 NVL", bf16) == 835.5 and peak("NVIDIA H100 NVL", fp32) == 60.0
    assert peak("NVIDIA H200", bf16) == 989.0 and peak("NVIDIA H200 NVL", bf16) == 835.5
    assert peak("NVIDIA H200 NVL", fp32, tf32=True) == 417.5
    assert peak("NVIDIA GH200 480GB", bf16) == 989.0 and peak("NVIDIA GH200 480GB", fp32) == 66.9
    assert peak("NVIDIA A100-SXM4-80GB", fp32, True) == 156.0 and peak("NVIDIA A100 80GB PCIe", fp32) == 19.5
    assert peak("NVIDIA A100-SXM4-40GB", fp16) == 312.0
    assert peak("NVIDIA L40", bf16) == 181.0 and peak("NVIDIA L4", bf16) == 121.0  # an L40 is not an L4
    assert peak("Tesla V100-SXM2-16GB", fp32, tf32=True) == 15.7  # no TF32 cores: fp32 either way
    assert peak("Tesla V100-SXM2-16GB", bf16) is None and peak("Tesla T4", bf16) is None


def test_tf32_is_on_for_cuda_fp32_by_default_and_the_planner_takes_its_peak():
    from framework.config.schema import PrecisionConfig
    from framework.precision import apply_tf32

    assert compose_config([]).precision.tf32 is True and PrecisionConfig().tf32 is True
    assert apply_tf32(True, torch.device("cpu")) is False  # no TF32 on a CPU: nothing set, none claimed
    assert compose_config(["precision.tf32=false"]).precision.tf32 is False


# --------------------------------------------------------------------------- parallel=dp


def _replica_thread(call, *args):
    """Run `call` as nn.DataParallel's parallel_apply runs a replica: in a thread of its own that
    re-enters autocast with the enabled flag only (no dtype)."""
    out, enabled = {}, torch.is_autocast_enabled("cpu")  # read in the caller, as parallel_apply does

    def worker():
        with torch.autocast("cpu", enabled=enabled):
            out["dtype"] = torch.get_autocast_dtype("cpu")
            out["y"] = call(*args)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    return out


def test_dp_replica_threads_compute_in_the_callers_autocast_dtype_and_record_its_saved_tensors():
    """CPU stands in for CUDA: autocast's default dtype is bf16 on CPU (fp16 on CUDA), so a
    replica thread that loses the caller's fp16 computes in bf16 here, as dp bf16 computed in fp16."""
    from framework.measure.memory import SavedActivationMeter
    from framework.parallel.dp import CallerState, InCallerState

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    x = torch.randn(4, 8, requires_grad=True)
    meter = SavedActivationMeter(model)
    with torch.autocast("cpu", dtype=torch.float16), meter.measure():
        bare = _replica_thread(model, x)  # what nn.DataParallel did
        assert bare["y"].dtype == torch.bfloat16 and meter.live == 0  # wrong dtype, nothing recorded
        fixed = _replica_thread(InCallerState(model, CallerState.capture()), x)
        assert fixed["y"].dtype == torch.float16
        assert meter.live > 0  # the replica's saved activations reached the caller's meter
        fixed["y"].float().sum().backward()
    assert meter.peak > 0 and meter.live == 0


# --------------------------------------------------------------------------- memory accounting


def test_state_in_host_memory_is_not_counted_in_a_device_reading():
    """FSDP CPU offload keeps shards and optimizer state in host memory: a CUDA reading holds
    none of it (the placement decision, with CPU tensors and a CUDA compute device)."""
    from framework.measure.memory import SavedActivationMeter, model_state_bytes
    from framework.measure.peak import PeakProbe

    model = nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    total = sum(p.numel() * 4 for p in model.parameters())  # params; grads and AdamW's two moments alike
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    on_cuda = model_state_bytes(model, optimizer, cuda)
    held = on_cuda["param_bytes"] + on_cuda["grad_bytes"] + on_cuda["optim_bytes"]
    assert on_cuda["param_bytes"] == total and on_cuda["offloaded_bytes"] == held > 3 * total  # all on the host
    assert model_state_bytes(model, optimizer, cpu)["offloaded_bytes"] == 0
    meter = SavedActivationMeter(model)
    assert PeakProbe(model, optimizer, meter, cuda)._take(())["state_bytes"] == 0
    assert PeakProbe(model, optimizer, meter, cpu)._take(())["state_bytes"] >= 4 * total


# --------------------------------------------------------------------------- communication accounting


def _hook_collectives(rank: int, world: int) -> dict[str, dict]:
    """One DDP step's collectives as counted with its backward on the main thread, on a thread
    that carries the counting mode (as autograd's device threads carry the caller's thread-local
    state into a CUDA backward), and on a thread without it."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from framework.measure.comm import CommCounter

    torch.manual_seed(0)
    ddp = DDP(nn.Linear(16, 4))
    ddp.register_comm_hook(None, default_hooks.allreduce_hook)  # a Python-level dist.all_reduce
    for _ in range(2):  # DDP rebuilds its buckets in the second step (broadcasting their sizes): steady from the third
        ddp(torch.randn(8, 16)).sum().backward()
    counts = {}
    for where in ("main thread", "device thread", "bare thread"):
        counter = CommCounter()
        with counter:
            loss = ddp(torch.randn(8, 16)).sum()
            if where == "main thread":
                _backward(loss, counter, False)
            else:
                args = (loss, counter, where == "device thread")
                thread = threading.Thread(target=_backward, args=args)
                thread.start()
                thread.join()
        counts[where] = counter.totals()["by_op"]
    return counts


def _backward(loss: torch.Tensor, counter, carry: bool) -> None:
    """`loss.backward()` on this thread, with `counter` active on it when `carry`."""
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    if carry:
        _push_mode(counter)
    try:
        loss.backward()
    finally:
        if carry:
            _pop_mode()


def test_hook_issued_collectives_are_counted_once_on_whichever_thread_backward_runs():
    from tests.helpers import run_workers

    one_bucket = {"all_reduce": {"calls": 1, "bytes": 4 * (16 * 4 + 4)}}  # the step's one gradient bucket
    for counts in run_workers(_hook_collectives, 2).values():
        assert counts == dict.fromkeys(("main thread", "device thread", "bare thread"), one_bucket), counts


# --------------------------------------------------------------------------- clipping


def _clip_today(grads: list[tuple[torch.Tensor, int]], max_norm: float) -> torch.Tensor:
    """The per-parameter loop clip_sharded_grad_norm ran before the fused kernels (world of one)."""
    total = torch.zeros((), dtype=torch.float32)
    for g, replicas in grads:
        total += g.float().pow(2).sum() / replicas
    norm = total.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g, _ in grads:
        g.mul_(coef.to(g.dtype))
    return norm


@pytest.mark.parametrize("max_norm", [0.5, 1e9, float("inf")])
def test_fused_clipping_matches_the_per_parameter_loop(max_norm):
    from framework.parallel.apply import clip_local_grad_norm, local_squared_norm, scale_grads_

    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (7, 3, 5), (1,)]
    grads = [(torch.randn(s, dtype=dt) * 3, r) for s, dt, r in
             zip(shapes, (torch.float32, torch.bfloat16, torch.float32, torch.float32), (1, 2, 1, 4), strict=True)]  # fmt: skip
    reference = [(g.clone(), r) for g, r in grads]
    expected = _clip_today(reference, max_norm)
    norm = local_squared_norm(grads, torch.device("cpu")).sqrt()
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    before = [g.clone() for g, _ in grads]
    scale_grads_(grads, norm, max_norm)
    for (g, _), (want, _) in zip(grads, reference, strict=True):
        torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-6)
    if max_norm == float("inf"):  # no clipping configured: the gradients are left alone, bit for bit
        assert all(torch.equal(g, b) for (g, _), b in zip(grads, before, strict=True))
    model, twin = nn.Linear(8, 4), nn.Linear(8, 4)
    twin.load_state_dict(model.state_dict())
    for m in (model, twin):
        m(torch.ones(2, 8)).pow(2).sum().backward()
    want = torch.nn.utils.clip_grad_norm_(twin.parameters(), max_norm)
    assert torch.equal(clip_local_grad_norm(model, max_norm), want)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), twin.parameters(), strict=True))


# --------------------------------------------------------------------------- host syncs


@pytest.mark.parametrize("precision", ["fp32", "amp"])
def test_the_loop_syncs_once_per_logged_step(monkeypatch, tmp_path, precision):
    """Eight more steps at log_every=4 add two logged steps, and two host syncs: the steps between
    do not wait (gradient norm, loss, loss scale and the skip decision stay on the device)."""
    base = ["experiment=smoke", f"precision={precision}", "metrics.log_every=4", "metrics.sample_every=0",
            "model.n_layer=1", "model.n_embd=32", "data.batch_size=2", "data.seq_len=16"]  # fmt: skip
    short = count_syncs(monkeypatch, [*base, "steps=8"], tmp_path / "short")
    long = count_syncs(monkeypatch, [*base, "steps=16"], tmp_path / "long")
    assert long - short == 2, (short, long)
    metrics = [line for line in (tmp_path / "long" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4  # steps 4, 8, 12, 16


# --------------------------------------------------------------------------- data, link probe, profiler


def test_loader_workers_and_pinning_resolve_auto_by_device():
    from framework.data import loader_settings

    assert loader_settings("auto", "auto", "cuda", 16, 1) == (4, True)  # a few loader processes, pinned
    assert loader_settings("auto", "auto", "cuda", 16, 8) == (1, True)  # cores per GPU - 1
    assert loader_settings("auto", "auto", "cpu", 2, 0) == (0, False)  # CPU ranks share the cores already
    assert loader_settings(3, False, "cuda", 16, 1) == (3, False) and loader_settings(2, True, "cpu", 2, 0) == (
        2,
        False,
    )
    with pytest.raises(ConfigError, match="data.num_workers"):
        from framework.config import validate

        validate(compose_config(["data.num_workers=-1"]))


def test_lstm_lengths_stay_in_host_memory():
    """The meta device stands in for CUDA: the tokens move, the lengths (read by
    pack_padded_sequence on the host) do not."""
    from framework.data import to_device
    from framework.data.datasets import VarlenSequences, VarlenShape

    data = VarlenSequences(VarlenShape(8, 32, 4, 2, 10, 5.0), 0, "classify", "synthetic", None)
    (tokens, lengths), target = to_device(data.collate([data[i] for i in range(4)]), torch.device("meta"),
                                          host=data.host_inputs)  # fmt: skip
    assert tokens.device.type == "meta" and target.device.type == "meta" and lengths.device.type == "cpu"
    assert VarlenSequences(VarlenShape(8, 32, 4, 2, 10, 5.0), 0, "lm", "synthetic", None).host_inputs == ()


def test_the_link_probe_reaches_a_few_hundred_megabytes_on_cuda():
    from framework.plan.link import probe_sizes

    assert max(probe_sizes("cuda")) * 4 >= 256 * 2**20 and max(probe_sizes("cpu")) * 4 == 16 * 2**20


def test_the_memory_history_covers_the_profilers_active_steps_only():
    from framework.measure.profiling import memory_window

    assert memory_window(compose_config(["profile=true"]).profiler) == (3, 5)  # wait 2, warmup 1, active 2


def test_every_rank_pops_its_forward_timings():
    """Tensor-parallel peers do not report forward times, but pop them: on CUDA each holds two
    events per micro-batch, which piled up for the whole run."""
    from framework.measure.metrics import ForwardTimer
    from framework.run.ledger import Entry, record_steps
    from framework.run.step import StepFigures
    from framework.run.summary import RunStats

    timer, stats = ForwardTimer(torch.device("cpu")), RunStats(losses=[])
    for _ in range(3):
        with timer:
            pass
        timer.end_step()
    figures = [StepFigures(loss=1.0, tokens=8, samples=2, grad_norm=0.5, seconds=0.1, sampled=False,
                           applied=True, loss_scale=None) for _ in range(3)]  # fmt: skip
    record_steps(stats, [Entry(None, k, 0, 8, 8, f) for k, f in enumerate(figures)], False, timer)
    assert timer.steps == [] and stats.forward_s == [] and stats.losses == [1.0] * 3


# --------------------------------------------------------------------------- hang diagnosis under NCCL


def _dump_after_collectives(rank: int, world: int, folder: str) -> None:
    """Both ranks run 2 all-reduces; rank 0 enters a third, rank 1 writes its flight recorder
    before it joins: as when rank 1 hangs and the watchdogs dump. Rank 0 writes the binary
    (pickle) dump NCCL's watchdog writes, rank 1 the JSON one."""
    import os

    import torch.distributed as dist

    c10d = torch._C._distributed_c10d
    x = torch.ones(4)
    for _ in range(2):
        dist.all_reduce(x)
    if rank == 0:
        work = dist.all_reduce(x, async_op=True)
        with open(os.path.join(folder, "rank_0"), "wb") as f:
            f.write(c10d._dump_fr_trace(True, True))
        work.wait()
    else:
        with open(os.path.join(folder, "rank_1.json"), "wb") as f:
            f.write(c10d._dump_fr_trace_json(True, True))
        dist.all_reduce(x)


def test_the_flight_recorder_dumps_name_the_collective_and_the_missing_rank(tmp_path, monkeypatch):
    """The launcher's reading of the per-rank dumps an NCCL timeout leaves (real flight-recorder
    dumps of a 2-rank gloo group: the format is the backend's recorder, not NCCL's kernels)."""
    from framework.run.resilience import read_dumps
    from tests.helpers import run_workers

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    run_workers(_dump_after_collectives, 2, str(tmp_path))
    line = read_dumps(str(tmp_path))
    assert line is not None and "all_reduce #3" in line and "ranks that never joined it: [1]" in line, line
    (tmp_path / "rank_1.json").unlink()  # a rank that wrote no dump at all is missing too
    assert "ranks that never joined it: [1]" in read_dumps(str(tmp_path))
    assert read_dumps(str(tmp_path / "none")) is None


def test_nccl_runs_get_the_watchdog_dump_settings_and_gloo_runs_none(tmp_path):
    from framework.run.resilience import flight_recorder_env

    env = flight_recorder_env("nccl", 2000, str(tmp_path))
    assert env == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "flight_recorder" / "rank_")}  # fmt: skip
    assert (tmp_path / "flight_recorder").is_dir()  # NCCL's writer does not create it
    assert flight_recorder_env("cpu:gloo,cuda:nccl", 10, str(tmp_path))["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "10"
    assert flight_recorder_env("gloo", 2000, str(tmp_path / "g")) == {} and not (tmp_path / "g").exists()
    assert flight_recorder_env("nccl", 0, str(tmp_path / "g")) == {}
