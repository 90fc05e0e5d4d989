"""A decoder-only transformer in the nanoGPT mould: single-device code, no torch.distributed.

Its blocks sit in ``self.blocks`` (an nn.ModuleList) so the framework can wrap them (activation
checkpointing, FSDP units) or split them (pipeline stages) without touching this file.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.init import Rule, fill_
from models.kv_cache import attend


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.head_dim = n_embd // n_head
        # Separate q/k/v projections (not one fused qkv matrix): a tensor-parallel split of each
        # along its output features hands every rank whole heads of q, k and v.
        self.q = nn.Linear(n_embd, n_embd, bias=bias)
        self.k = nn.Linear(n_embd, n_embd, bias=bias)
        self.v = nn.Linear(n_embd, n_embd, bias=bias)
        self.proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.dropout = dropout
        self.resid_dropout = nn.Dropout(dropout)
        self.cache = None  # a models.kv_cache.KVCache while generating

    def cache_shape(self) -> tuple[int, int]:
        return self.k.out_features // self.head_dim, self.head_dim

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # (B, T, heads*head_dim) -> (B, heads, T, head_dim); the head count comes from the
        # projection's width, so a tensor-parallel shard (fewer heads per rank) works unchanged.
        q, k, v = (lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        dropout = self.dropout if self.training else 0.0
        if self.cache is not None:  # generating: these tokens follow the cached ones
            y = attend(q, *self.cache.append(k, v))
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:  # (B, 1, T, T) boolean: True where a query may attend
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float, bias: bool):
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.proj = nn.Linear(4 * n_embd, n_embd, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, dropout, bias)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    task = "lm"
    trains_on = ("text", "varlen", "tokens", "chat", "hf")
    blocks_path = "blocks"
    # Tensor parallel (Megatron-style), in the model contract's plain strings (framework/contract.py):
    # q/k/v and the MLP's first linear split by output features (each rank computes whole heads and a
    # slice of the hidden units), the two output projections by input features (partial sums, one
    # all-reduce; a reduce-scatter under sequence parallel). Under sequence parallel the norms,
    # dropouts and residual stream are split along the sequence too, gathered before attention and
    # the MLP; the embeddings come out split along the sequence.
    tp_plan = {
        "tok_emb": "embedding",
        "pos_emb": "position_embedding",
        "blocks.*.ln_1": "sequence_parallel",
        "blocks.*.attn": "gather_input",
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.ln_2": "sequence_parallel",
        "blocks.*.mlp": "gather_input",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "ln_f": "sequence_parallel",
        "lm_head": "output",
    }

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = False,
    ):
        super().__init__()
        if n_embd % n_head:  # "<argument>: ..." names the config key (framework/config/model.py)
            raise ValueError(f"n_head: n_embd={n_embd} must divide evenly into n_head={n_head} heads")
        self.vocab_size, self.block_size = vocab_size, block_size
        self.n_layer, self.n_head, self.n_embd = n_layer, n_head, n_embd
        self.tok_emb = nn.Embedding(vocab_size, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        # Not tied to tok_emb: tied weights would have to live on two pipeline stages at once.
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.cache = None  # the first block's KVCache while generating (models/kv_cache.py): where positions start
        self.reset_parameters()

    def init_rule(self, name: str, dim: int) -> Rule:
        """How parameter `name` (of `dim` dimensions) starts: norms' weights 1, biases 0, matrices
        normal(0, 0.02), residual projections scaled down by depth (GPT-2)."""
        if dim == 1:
            return ("ones", 0.0) if name.endswith("weight") else ("zeros", 0.0)
        return "normal", 0.02 / math.sqrt(2 * self.n_layer) if name.endswith("proj.weight") else 0.02

    def reset_parameters(self) -> None:
        """Row-seeded from torch's seed (models/init.py): a shard filled on its own rank gets these
        values too. Built on the meta device, there is nothing to fill (the framework does it)."""
        for name, p in self.named_parameters():
            if not p.is_meta:
                fill_(p, self.init_rule(name, p.dim()), torch.initial_seed(), name)

    def forward(
        self, idx: torch.Tensor, doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """idx: (B, T) token ids -> logits (B, T, vocab).

        doc_ids: (B, T) document of each position, for packed sequences: attention stays within
        a document and positions restart at each document's start.
        positions: (T,) the position of each of these tokens in its sequence, where `idx` is a part
        of it (context parallel: a zigzag shard); default 0..T-1. Not combined with doc_ids."""
        B, T = idx.shape
        start = self.cache.pos if self.cache is not None else 0  # generating: the cached tokens come first
        assert start + T <= self.block_size, f"sequence of {start + T} tokens > block_size {self.block_size}"
        pos = torch.arange(start, start + T, device=idx.device)
        mask = None
        if doc_ids is not None:
            starts = torch.ones_like(doc_ids, dtype=torch.bool)
            starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
            start_pos = torch.cummax(torch.where(starts, pos, 0), dim=1).values
            pos = pos - start_pos  # (B, T): position within the document
            same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
            mask = (same_doc & torch.ones(T, T, dtype=torch.bool, device=idx.device).tril())[:, None]
        if positions is not None:
            pos = positions
        # (B, T) positions (packed) go in sequence-first: sequence parallel splits the output's dim 0
        pos_emb = self.pos_emb(pos) if pos.dim() == 1 else self.pos_emb(pos.t()).transpose(0, 1)
        x = self.drop(self.tok_emb(idx) + pos_emb)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(x)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """What runs before the blocks (a pipeline's first stage): token and position embeddings
        (`positions`: as forward's)."""
        pos = torch.arange(idx.size(1), device=idx.device) if positions is None else positions
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """What runs after the blocks (a pipeline's last stage): the final norm and the output head."""
        return self.lm_head(self.ln_f(x))

    def planner_shape(self) -> dict[str, int]:
        """The dimensions the planner's activation formula for this block (framework/plan/model.py) reads."""
        return {"n_layer": self.n_layer, "n_head": self.n_head, "n_embd": self.n_embd, "vocab_size": self.vocab_size}

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; position embeddings excluded by default (they cost no matmul FLOPs)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.pos_emb.weight.numel() if non_embedding else n

    def matmul_params(self) -> int:
        """Weights that multiply activations: every Linear's (the output head's included). The
        embeddings are lookups, and norms and biases elementwise: they are not counted."""
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))

    def flops_per_token(self, seq_len: int, recomputed_blocks: int = 0) -> float:
        """Training FLOPs per token (forward + backward) of the matmuls, PaLM appendix B as in
        nanoGPT: 6N over the N matmul weights (2 forward, 4 backward per weight) plus 12·L·H·Q·T
        for attention's scores and weighted sum over T positions (causal masking not discounted,
        as FlopCounterMode and the usual MFU convention count it).

        recomputed_blocks: blocks whose forward runs again in backward (activation checkpointing):
        the hardware FLOPs (HFU) add their recomputation, 2 per block weight and 4·H·Q·T, less the
        block's last projection, which non-reentrant checkpointing does not rerun (it stops once
        every tensor backward needs is back)."""
        L, D = self.n_layer, self.n_embd
        model_flops = 6 * self.matmul_params() + 12 * L * D * seq_len
        block = self.blocks[0]
        rerun = (
            sum(m.weight.numel() for m in block.modules() if isinstance(m, nn.Linear)) - block.mlp.proj.weight.numel()
        )
        return model_flops + recomputed_blocks * (2 * rerun + 4 * D * seq_len)
