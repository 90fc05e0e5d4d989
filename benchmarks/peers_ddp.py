"""The raw loop of `raw_ddp.py` written with Lightning Fabric or Hugging Face Accelerate: the same
model class, data, sampler, optimizer, clipping, threads and world size, each library wrapping
the model and handling the backward as its documentation shows. Extra rows of `overhead.py`
when the optional extra `peers` is installed (`pip install -e ".[peers]"`). Under torchrun:

    torchrun --standalone --nproc_per_node=2 benchmarks/peers_ddp.py --peer fabric --steps 30

Rank 0 prints one JSON line: per-step seconds and tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from raw_ddp import job_arguments  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from framework.data.datasets import ByteTextDataset  # noqa: E402
from models import GPT  # noqa: E402


class LogitsOnly(torch.nn.Module):
    """A Hugging Face causal LM returning its logits tensor, as a hand-written loop uses it."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).logits


def main() -> None:
    parser = job_arguments()
    parser.add_argument("--peer", choices=["fabric", "accelerate"], required=True)
    parser.add_argument("--hf-config", default=None, help="a Hugging Face config folder: train that model instead")
    args = parser.parse_args()
    world = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    torch.manual_seed(1337)

    if args.hf_config:  # as the framework's model=hf builds it: from the config, sdpa attention
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(args.hf_config, local_files_only=True)
        hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        model = LogitsOnly(hf)
    else:
        model = GPT(
            vocab_size=256, block_size=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.0)
    dataset = ByteTextDataset(None, args.seq_len, 4_000_000)
    if args.peer == "fabric":
        from lightning.fabric import Fabric

        precision = "bf16-mixed" if args.precision == "bf16" else "32-true"
        fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp", precision=precision)
        fabric.launch()  # already launched by torchrun: joins the process group
        model, optimizer = fabric.setup(model, optimizer)
        rank = fabric.global_rank
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=1337, drop_last=True)
        loader = fabric.setup_dataloaders(
            DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True),
            use_distributed_sampler=False,
        )
        backward, clip = fabric.backward, lambda: fabric.clip_gradients(model, optimizer, max_norm=1.0)
        mean = lambda t: fabric.all_reduce(t, reduce_op="mean")  # noqa: E731
    else:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True, mixed_precision="bf16" if args.precision == "bf16" else "no")
        loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # shards the loader per rank
        rank = accelerator.process_index
        backward, clip = accelerator.backward, lambda: accelerator.clip_grad_norm_(model.parameters(), 1.0)
        mean = lambda t: accelerator.reduce(t, reduction="mean")  # noqa: E731
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps, eta_min=1e-4)

    seconds, tokens = [], []
    batches = iter(loader)
    for _ in range(args.steps):
        t0 = time.perf_counter()
        try:
            (x,), y = next(batches)
        except StopIteration:
            batches = iter(loader)
            (x,), y = next(batches)
        loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
        backward(loss)
        clip()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        mean(loss.detach())  # the global mean loss, as a training script logs it
        seconds.append(time.perf_counter() - t0)
        tokens.append(x.numel() * world)
    if rank == 0:
        print(json.dumps({"seconds": seconds, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    main()
