"""A Llama-3-family decoder (torchtitan's `llama3` in plain single-device code, no torch.distributed).

RMSNorm, rotary position embeddings (`rope_theta`, optional Llama-3.1 frequency scaling), a
SwiGLU MLP, grouped-query attention (`n_kv_heads` key/value heads shared by `n_heads` query
heads) and optionally an output head tied to the token embedding. The weights are in Meta's
layout (rotary pairs interleaved, as the original checkpoints); `models/llama_hf.py` maps them
to and from Hugging Face's `LlamaForCausalLM`.

Its blocks sit in ``self.layers`` and its forward is the plain chain tok_embeddings -> layers ->
norm -> output, which the framework splits into pipeline stages. Nothing is kept in buffers
(the rotary tables are recomputed each forward from plain numbers), so a model built on the
meta device needs only its parameters filled.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields, replace

import torch
import torch.nn.functional as F
from torch import nn

from models.init import Rule, fill_
from models.kv_cache import attend
from models.llama_args import FAMILIES, FLAVORS, LlamaArgs
from models.llama_hf import args_from_hf_config, from_hf_name, hf_config, hf_entries, to_hf_name
from models.moe import MoE, MoEArgs
from models.swiglu import FeedForward


def rope_frequencies(args: LlamaArgs, device: torch.device | None = None) -> torch.Tensor:
    """The (head_dim / 2,) inverse frequencies, with Llama-3.1 scaling when `rope_factor` is set:
    wavelengths above original_max_pos / low_freq_factor divided by the factor, below
    original_max_pos / high_freq_factor kept, and smoothly interpolated in between."""
    d = args.head_size
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2, device=device, dtype=torch.int64).float() / d))
    if args.rope_factor is None:
        return inv
    factor, low, high, old = (
        args.rope_factor,
        args.rope_low_freq_factor,
        args.rope_high_freq_factor,
        args.rope_original_max_pos,
    )
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of x (B, heads, T, head_dim) by the angles whose
    cos and sin are (B or 1, 1, T, head_dim / 2)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (as Hugging Face's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.type_as(x)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.args = args
        hd, bias = args.head_size, args.qkv_bias
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=bias)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        if args.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, args.norm_eps), RMSNorm(hd, args.norm_eps)
        self.cache = None  # a models.kv_cache.KVCache while generating

    def cache_shape(self) -> tuple[int, int]:
        return self.wk.out_features // self.args.head_size, self.args.head_size

    def forward(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, T, _ = x.shape
        hd = self.args.head_size
        # head counts come from the projections' widths: a tensor-parallel shard has fewer heads
        q, k, v = (lin(x).view(B, T, -1, hd) for lin in (self.wq, self.wk, self.wv))
        if self.args.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        window = self.args.sliding_window
        pos, mask = positions_and_mask(T, doc_ids, x.device, window)
        if positions is not None:  # these tokens' places in their sequence (context parallel's part)
            pos = positions if positions.dim() == 2 else positions[None]  # (B, T): within documents
        if self.cache is not None:  # these tokens follow the cached ones
            pos = pos + self.cache.pos
        angles = pos[..., None].float() * rope_frequencies(self.args, x.device)  # (B or 1, T, hd/2)
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.cache is not None:
            k, v = self.cache.append(k, v)
        groups = q.shape[1] // k.shape[1]  # query heads per key/value head (GQA)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        if self.cache is not None:
            y = attend(q, k, v, window)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


def positions_and_mask(T: int, doc_ids: torch.Tensor | None, device: torch.device, window: int | None = None):
    """Positions (1, T) and no mask (causal), or a mask where plain causal attention is not
    enough: within a sliding `window` (a token sees itself and the window - 1 before it), and for
    packed sequences (doc_ids (B, T)) positions restarting at each document and a (B, 1, T, T)
    mask keeping attention within a document."""
    pos = torch.arange(T, device=device)
    banded = window is not None and T > window
    if doc_ids is None and not banded:
        return pos[None], None
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    if banded:
        causal = causal.triu(1 - window)
    if doc_ids is None:
        return pos[None], causal[None, None]
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    pos = pos - torch.cummax(torch.where(starts, pos, 0), dim=1).values
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    return pos, (same_doc & causal)[:, None]


class TransformerBlock(nn.Module):
    def __init__(self, args: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        if args.moe.experts:
            self.feed_forward = MoE(args.dim, args.ffn_hidden, args.moe)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden)

    def forward(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), doc_ids, positions)
        return x + self.feed_forward(self.ffn_norm(x))


def llama_args(flavor: str = "debug", hf_config: str | None = None, **overrides) -> LlamaArgs:
    """The flavour's shape (or that of a Hugging Face folder's config.json), with the non-null overrides."""
    if hf_config is not None:
        with open(os.path.join(hf_config, "config.json")) as f:
            base = args_from_hf_config(json.load(f))
    elif flavor in FLAVORS:
        base = FLAVORS[flavor]
    else:
        raise ValueError(f"model.flavor: got {flavor!r}; allowed: {', '.join(FLAVORS)}")
    if overrides.get("family") not in (None, *FAMILIES):
        raise ValueError(f"model.family: got {overrides['family']!r}; allowed: {', '.join(FAMILIES)}")
    known = {f.name for f in fields(LlamaArgs)}
    unknown = set(overrides) - known
    if unknown:
        raise TypeError(f"Llama: unknown arguments {sorted(unknown)}")
    moe = overrides.get("moe")
    if moe is not None and not isinstance(moe, MoEArgs):  # model.moe.*: over the flavour's experts
        overrides["moe"] = replace(base.moe, **{k: v for k, v in dict(moe).items() if v is not None})
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})


class Llama(nn.Module):
    task = "lm"
    blocks_path = "layers"
    # Tensor parallel, in the contract's plain strings (Megatron-style: q/k/v and w1/w3 split by
    # output features, wo and w2 by input features; norms sequence-parallel; the sequence gathered
    # before attention and the MLP; the embedding and head split over the vocabulary). n_heads and
    # n_kv_heads must both divide by the tensor-parallel degree.
    tp_plan = {
        "tok_embeddings": "vocab_embedding",
        "layers.*.attention_norm": "sequence_parallel",
        "layers.*.attention": "gather_input",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.q_norm": "head_norm",
        "layers.*.attention.k_norm": "head_norm",
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "sequence_parallel",
        "layers.*.feed_forward": "gather_input",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "norm": "sequence_parallel",
        "output": "output",
    }

    def __init__(self, flavor: str = "debug", hf_config: str | None = None, **overrides):
        super().__init__()
        self.args = args = llama_args(flavor, hf_config, **overrides)
        if args.moe.experts:  # routed experts run whole on every tp rank (on its replicated tokens)
            self.tp_plan = {k: v for k, v in self.tp_plan.items() if ".feed_forward" not in k}
        if not args.qk_norm:
            self.tp_plan = {k: v for k, v in self.tp_plan.items() if not k.endswith(("q_norm", "k_norm"))}
        # what the contract checks tensor-parallel degrees against (they must split whole heads): the
        # key/value heads, which under GQA are fewer than the query heads and divide them
        self.n_heads = args.n_kv_heads
        self.sliding_window = args.sliding_window  # the contract's window (context parallel applies it)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:  # one parameter; every strategy keeps it one (framework/parallel/ties.py)
            self.output.weight = self.tok_embeddings.weight
        self.reset_parameters()

    def forward(
        self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """tokens (B, T) -> logits (B, T, vocab). doc_ids (B, T): packed documents (see
        positions_and_mask). positions (T,) or (B, T): each token's place in its sequence (or
        document), where `tokens` is a part of it (context parallel's zigzag share: the rotary
        angles follow them)."""
        assert tokens.shape[1] <= self.args.max_seq_len, f"{tokens.shape[1]} tokens > max_seq_len"
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, doc_ids, positions)
        return self.output(self.norm(h))

    def init_rule(self, name: str, dim: int) -> Rule:
        """Biases 0; norm weights 1; matrices normal(0, 0.02), the residual projections (wo, w2) scaled
        down by depth (GPT-2)."""
        if name.endswith(".bias"):
            return "zeros", 0.0
        if dim == 1:
            return "ones", 0.0
        deep = name.endswith(("wo.weight", "w2.weight", "experts.w2"))
        return "normal", 0.02 / math.sqrt(2 * self.args.n_layers) if deep else 0.02

    def reset_parameters(self) -> None:
        """Row-seeded (models/init.py), so a shard filled on its own rank gets the same values;
        on the meta device there is nothing to fill (the framework does it)."""
        for name, p in self.named_parameters():
            if not p.is_meta:
                fill_(p, self.init_rule(name, p.dim()), torch.initial_seed(), name)

    def from_hf_name(self, name: str):
        """A Hugging Face checkpoint's tensor name -> (ours, the layout change): model.pretrained."""
        return from_hf_name(name, self.args)

    # Hugging Face's files out (framework/checkpoint/export.py): LlamaForCausalLM's, or MixtralForCausalLM's
    def to_hf_name(self, name: str):
        """Our tensor name -> (Hugging Face's, the layout change): a LoRA adapter's module names."""
        return to_hf_name(name, self.args)

    def hf_entries(self):
        """The checkpoint's tensors in order: (Hugging Face's name, ours, an expert's index or None, the layout change)."""
        return hf_entries(self.args)

    def hf_config(self, dtype: str = "float32") -> dict:
        """Its config.json (transformers' LlamaConfig or MixtralConfig)."""
        return hf_config(self.args, dtype)

    def planner_shape(self) -> dict[str, int]:
        """gpt-like dimensions for the planner's activation formula (framework/plan/model.py)."""
        a, moe = self.args, self.args.moe
        shape = {"n_layer": a.n_layers, "n_head": a.n_heads, "n_embd": a.dim, "vocab_size": a.vocab_size,
                 "ffn_hidden": a.ffn_hidden, "kv_width": a.n_kv_heads * a.head_size, "norm": "rms"}  # fmt: skip
        if moe.experts:  # routed experts in place of the MLP (each expert's width, the shared experts')
            hidden = moe.hidden or a.ffn_hidden
            shape |= {"moe_experts": moe.experts, "moe_top_k": moe.top_k, "moe_hidden": hidden,
                      "moe_shared_hidden": hidden * moe.shared_experts}  # fmt: skip
        return shape

    def flops_per_token(self, seq_len: int, recomputed_blocks: int = 0) -> float:
        """Training FLOPs per token: 6 per matmul weight (the output head's included, tied or not)
        plus 12·L·H·Q·T for attention's scores and weighted sum (causal masking not discounted),
        as in models/gpt.py. recomputed_blocks (activation checkpointing): their forward again,
        2 per block weight and 4·H·Q·T, less the last projection (w2), which non-reentrant
        checkpointing does not rerun."""
        a = self.args
        attn_width = a.n_heads * a.head_size
        model_flops = 6 * active_weights(self) + 12 * a.n_layers * attn_width * seq_len
        block = self.layers[0]
        rerun = active_weights(block) - (0 if a.moe.experts else block.feed_forward.w2.weight.numel())
        return model_flops + recomputed_blocks * (2 * rerun + 4 * attn_width * seq_len)


def active_weights(module: nn.Module) -> int:
    """Matmul weights a token goes through: every nn.Linear's (the router's and a shared expert's
    included), and of each routed MoE layer its top_k experts' (active, not total, parameters)."""
    dense = sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))
    routed = sum(m.args.top_k * sum(p[0].numel() for p in (m.experts.w1, m.experts.w2, m.experts.w3))
                 for m in module.modules() if isinstance(m, MoE))  # fmt: skip
    return dense + routed
