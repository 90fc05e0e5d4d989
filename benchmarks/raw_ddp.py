"""A plain, hand-written DDP training loop (nanoGPT style), the baseline of `overhead.py`.

Same model class (models.GPT), data (the framework's byte-level text windows of this Python's
standard library), sampler, optimizer, clipping, threads and world size as `train.py`'s default
gpt + DDP job; none of the framework. Run under torchrun:

    torchrun --standalone --nproc_per_node=2 benchmarks/raw_ddp.py --steps 30 --precision fp32

Rank 0 prints one JSON line: per-step seconds and tokens, and for startup.py, when its process
started and when its first step ended (time.time()).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from framework.data.datasets import ByteTextDataset  # noqa: E402
from framework.machine import process_start_time  # noqa: E402
from models import GPT  # noqa: E402


def job_arguments() -> argparse.ArgumentParser:
    """The job's knobs, shared with peers_ddp.py so every loop runs the same job."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--n-head", type=int, default=4)
    return parser


def main() -> None:
    args = job_arguments().parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    torch.manual_seed(1337)

    model = GPT(vocab_size=256, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    model = DDP(model, gradient_as_bucket_view=True)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.95)
    )
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps, eta_min=1e-4)
    dataset = ByteTextDataset(None, args.seq_len, 4_000_000)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=1337, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16")

    seconds, tokens, epoch, first_step_at = [], [], 0, None
    batches = iter(loader)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        try:
            (x,), y = next(batches)  # the dataset's (inputs, target) pairs
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            batches = iter(loader)
            (x,), y = next(batches)
        with autocast:
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        # the global mean loss, as a training script logs it (one small all-reduce, a sync point)
        dist.all_reduce(loss.detach(), op=dist.ReduceOp.AVG)
        seconds.append(time.perf_counter() - t0)
        tokens.append(x.numel() * world)
        if len(seconds) == 1:
            first_step_at = time.time()
    if rank == 0:
        times = {"process_started_at": process_start_time(), "first_step_at": first_step_at}
        print(json.dumps({"seconds": seconds, "tokens": tokens, **times}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
