"""The peak-memory model: the most bytes one rank holds at once (CPU: resident set; CUDA: the
allocator's peak), what decides whether a layout fits.

    peak = baseline + parameters + optimizer state + persistent buffers + gathered parameters
           + max(saved activations + the head's transients, gradients + the update's temporaries)
           + allocator slack

- baseline: the process before the model (imports, the backend; CPU only, as CUDA's allocator
  counts from zero), measured once per device kind (`profile.baseline_bytes`);
- saved activations at the schedule's peak and FSDP's gathered units (the one running and the
  prefetched one, or all of them without resharding): `framework.plan.activations`;
- persistent buffers: DDP's gradient buckets (allocated at wrapping and kept between steps;
  under `gradient_as_bucket_view` the gradients are views into them, not a second copy);
- backward frees saved activations block by block while it produces gradients, so at most one of
  the two is whole; the head's transients (the logits' gradient) come at its start, FSDP's
  reduce-scatter input (one unit's unsharded gradient, in the reduce dtype) at each unit's end.
  Under a pipeline the two are whole at once: a stage's gradients live from its first
  micro-batch's backward to the step's end while later micro-batches' activations are held
  (`held_gradients`: under FSDP2 unsharded, in the reduce dtype, as torch's stage turns the
  gradient sync off until the last backward);
- slack: what the allocator keeps beyond the live bytes, a share measured on this machine
  (`profile.slack`).

On CUDA the allocator's reserved peak (`torch.cuda.max_memory_reserved`, what torchtitan's tables
publish) is more by the cached blocks that nothing live at the peak can use (`cached_bytes`).
"""

from __future__ import annotations

import math

from omegaconf import DictConfig

from framework.plan.activations import host_apart, micro_batch, tokens_per_rank
from framework.plan.model import Layout, Shapes, _tp_local, stage_rank

PARTS = ("baseline", "state", "buffers", "gathered", "transient", "slack")


def persistent_buffers(shapes: Shapes, cfg: DictConfig, layout: Layout) -> int:
    """DDP's buckets: one flat fp32 buffer per bucket, every gradient's size in all."""
    if layout.name != "ddp" or layout.world < 2:
        return 0
    return 4 * sum(math.prod(p.shape) for p in shapes.params)


def head_transient(shapes: Shapes, cfg: DictConfig, layout: Layout) -> int:
    """The loss's fp32 b x T x vocab tensors at the start of backward beside log-softmax's saved
    output: the gradient nll_loss hands back and the one it returns (eager cross-entropy); under
    loss parallel three, as torch's fused nll_loss/log_softmax backward
    (torch/distributed/tensor/parallel/loss.py) holds the scatter's zeros, exp(output) and their
    sum at once before scaling it."""
    if shapes.gpt is None:
        return 0
    vocab = shapes.gpt["vocab_size"] // (layout.tp if layout.loss_parallel else 1)
    copies = 3 if layout.loss_parallel else 2
    return copies * 4 * micro_batch(cfg, layout) * tokens_per_rank(cfg, layout) * vocab


def held_gradients(shapes: Shapes, cfg: DictConfig, layout: Layout, grads: int) -> int:
    """Gradients held beside the saved activations: a pipeline's, from the first micro-batch's
    backward to the step's end (0 without one). Under FSDP2 torch's stage
    (torch/distributed/pipelining/stage.py `backward_maybe_with_nosync`) turns the gradient sync
    and resharding off until the last backward, so FSDP accumulates each parameter's unsharded
    gradient (1/tp) in its reduce dtype; otherwise `grads`, the rank's own."""
    if layout.pp < 2:
        return 0
    if layout.fsdp != 2 or layout.shard < 2:
        return grads
    size = 2 if cfg.parallel.get("reduce_dtype", "fp32") in ("bf16", "fp16") else 4
    per_rank: dict[int, int] = {}
    for p in shapes.params:
        if p.trainable:
            rank = stage_rank(p.stage, layout)
            per_rank[rank] = per_rank.get(rank, 0) + math.prod(_tp_local(p, layout.tp))
    return size * max(per_rank.values(), default=0)


def cached_bytes(shapes: Shapes, cfg: DictConfig, layout: Layout) -> int:
    """CUDA's reserved peak beyond the allocated one: blocks the caching allocator keeps that no
    tensor live at the peak can take. FSDP's all-gather output of its largest unit (allocated on
    FSDP's copy-in stream, torch's _fsdp_collectives.foreach_all_gather; freed once copied out
    into the parameters, its block stays in that stream's pool, which the default stream's tensors
    cannot use); the forward's 16-bit logits (freed by the peak at the start of backward, where
    every tensor the loss allocates is fp32, twice its size: none fits its block). 0 on a CPU."""
    if shapes.gpt is None or not host_apart(cfg):
        return 0
    size = 4 if cfg.precision.name == "fp32" else 2
    logits = 0
    if size == 2 and layout.fsdp:  # under FSDP's mixed precision the head outputs 16 bits
        vocab = shapes.gpt["vocab_size"] // (layout.tp if layout.loss_parallel else 1)
        logits = 2 * micro_batch(cfg, layout) * tokens_per_rank(cfg, layout) * vocab
    gathered = size * max(_units(shapes, layout).values()) if layout.fsdp and layout.shard > 1 else 0
    return logits + gathered


def _units(shapes: Shapes, layout: Layout) -> dict[str, int]:
    """FSDP's units: elements each gathers on a rank (whole over the shards, 1/tp)."""
    units: dict[str, int] = {}
    for p in shapes.params:
        units[p.unit] = units.get(p.unit, 0) + math.prod(p.shape) // layout.tp
    return units


def reduce_buffer(shapes: Shapes, cfg: DictConfig, layout: Layout) -> int:
    """FSDP: one unit's unsharded gradient, the reduce-scatter's input (the largest unit)."""
    if not layout.fsdp or layout.shard < 2:
        return 0
    return 4 * max(_units(shapes, layout).values())


def peak_parts(shapes: Shapes, cfg: DictConfig, layout: Layout, memory: dict, profile) -> dict[str, int] | None:
    """The peak taken apart (bytes), or None where saved activations are not predicted."""
    if memory.get("activation_bytes") is None:
        return None
    params, grads, optim = memory["param_bytes"], memory["grad_bytes"], memory["optim_bytes"]
    buffers = persistent_buffers(shapes, cfg, layout)
    if buffers and cfg.parallel.get("gradient_as_bucket_view", True):
        grads = 0  # the gradients are views into DDP's buckets: counted there
    held = held_gradients(shapes, cfg, layout, grads)
    backward = memory["activation_bytes"] + head_transient(shapes, cfg, layout) + held
    update = grads + reduce_buffer(shapes, cfg, layout)
    live = {
        "baseline": profile.baseline_bytes,
        "state": params + optim,
        "buffers": buffers,
        "gathered": memory.get("gathered_bytes") or 0,
        "transient": max(backward, update),
    }
    live["slack"] = round(profile.slack * (sum(live.values()) - live["baseline"]))
    return live
