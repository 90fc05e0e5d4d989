"""Hugging Face <-> models/llama.py: config, parameter names and layouts, and safetensors reading.

Our Llama keeps Meta's layout: the rotary pairs of wq and wk are interleaved (x[2i], x[2i+1]).
Hugging Face's LlamaForCausalLM rotates halves instead (x[i], x[i + head_dim/2]), so its q_proj
and k_proj rows are permuted within each head (transformers' convert_llama_weights_to_hf
`permute`). Everything else is a rename. The permutation is a reshape and a transpose: exact,
so import then export gives back the same bits.

A Llama with routed experts maps to Mixtral's layout (MixtralForCausalLM), or a Qwen3 to
Qwen3-MoE's: the router is `block_sparse_moe.gate` (`mlp.gate`), and each expert's three
projections are tensors of their own (`block_sparse_moe.experts.{e}.w1.weight`,
`mlp.experts.{e}.gate_proj.weight`), which are slices of our grouped weights: a checkpoint tensor
is then a `Part` of one of ours (loading stacks the parts, framework/hf.py).

Reading streams one tensor at a time (`iter_hf_tensors`), from one model.safetensors or the
shards a model.safetensors.index.json lists; nothing here holds the whole model.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch

from models.llama_args import LlamaArgs
from models.moe import MoEArgs

Transform = Callable[[torch.Tensor], torch.Tensor]

# our name (layer index as {}) -> Hugging Face's
_LAYER_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}  # fmt: skip
_EXPERT_NAMES = {"feed_forward.experts.w1": "w1", "feed_forward.experts.w2": "w2", "feed_forward.experts.w3": "w3"}
_OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_DENSE_LAYER_NAMES = {k: v for k, v in _LAYER_NAMES.items() if not k.startswith("feed_forward.")}


class Routed(NamedTuple):
    """A family's routed layer in Hugging Face's files: the router's name in a block, the experts'
    stem, and our projections' names there (w1: gate, w2: down, w3: up)."""

    router: str
    experts: str
    projections: dict[str, str]

    def expert_name(self, layer: int, expert: int, ours: str) -> str:
        return f"model.layers.{layer}.{self.experts}.{expert}.{self.projections[ours]}.weight"

    def parse(self, name: str) -> tuple[int, str] | None:
        """(expert, our projection) of a block-relative name, or None."""
        stem, _, rest = name.partition(f"{self.experts}.")
        index, _, proj = rest.partition(".")
        ours = {v: k for k, v in self.projections.items()}.get(proj.removesuffix(".weight"))
        return (int(index), ours) if not stem and index.isdigit() and ours and proj.endswith(".weight") else None


ROUTED = {  # by LlamaArgs.family: a routed Llama goes out as Mixtral, a routed Qwen3 as Qwen3-MoE
    "llama": Routed("block_sparse_moe.gate.weight", "block_sparse_moe.experts", {"w1": "w1", "w2": "w2", "w3": "w3"}),
    "qwen3": Routed("mlp.gate.weight", "mlp.experts", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}),
}
# the families' extras: Qwen2's query/key/value biases, Qwen3's per-head query/key norms
_BIAS_NAMES = {f"attention.w{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}
_QK_NORM_NAMES = {f"attention.{x}_norm.weight": f"self_attn.{x}_norm.weight" for x in "qk"}
_HF_TO_OURS_TOP = {v: k for k, v in _TOP_NAMES.items()}
# the rotary pairs' rows: (our name, whose heads); a q/k norm's weight is one head's features
_ROTATED = {"attention.wq.weight": "n_heads", "attention.wk.weight": "n_kv_heads", "attention.wq.bias": "n_heads",
            "attention.wk.bias": "n_kv_heads", "attention.q_norm.weight": None, "attention.k_norm.weight": None}  # fmt: skip
# the architectures a Llama goes out as (LlamaArgs.family), and the model types it reads
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}  # fmt: skip
_ROUTED_TYPES = {"llama": "mixtral", "qwen3": "qwen3_moe"}  # a routed family's model type


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def interleaved_to_halves(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta's q/k rows (pairs interleaved per head) -> Hugging Face's (halves per head); a vector
    (a bias, a norm's weight) is one column."""
    rows, cols = w.shape[0], w[0].numel()
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(w.shape)


def halves_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    rows, cols = w.shape[0], w[0].numel()
    return w.view(n_heads, 2, rows // n_heads // 2, cols).transpose(1, 2).reshape(w.shape)


def _rope_transform(fn, n_heads: int) -> Transform:
    return lambda t: fn(t, n_heads)


def _layout_change(ours: str, args: LlamaArgs, fn) -> Transform:
    """The permutation `fn` for a tensor whose rows are rotary pairs (by its heads), else none."""
    if ours not in _ROTATED:
        return _identity
    heads = _ROTATED[ours]
    return _rope_transform(fn, 1 if heads is None else getattr(args, heads))


class Part(NamedTuple):
    """Slice `index` (of `count`) along dim 0 of our tensor `name`: one expert's projection."""

    name: str
    index: int
    count: int


def _layer_names(args: LlamaArgs) -> dict[str, str]:
    """Our names in a block -> Hugging Face's (with experts: the family's router; the experts are Parts)."""
    routed = {"feed_forward.gate.weight": ROUTED[args.family].router} if args.moe.experts else None
    names = _DENSE_LAYER_NAMES | routed if routed else dict(_LAYER_NAMES)
    return names | (_BIAS_NAMES if args.qkv_bias else {}) | (_QK_NORM_NAMES if args.qk_norm else {})


def to_hf_name(name: str, args: LlamaArgs) -> tuple[str, Transform]:
    """Our parameter name -> (Hugging Face's name, the layout change to apply to the tensor)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name], _identity
    m = _OURS_LAYER.match(name)
    if m is None or m.group(2) not in _layer_names(args):
        raise KeyError(f"llama: no Hugging Face name for parameter {name!r}")
    hf = f"model.layers.{m.group(1)}.{_layer_names(args)[m.group(2)]}"
    return hf, _layout_change(m.group(2), args, interleaved_to_halves)


def from_hf_name(name: str, args: LlamaArgs) -> tuple[str | Part, Transform]:
    """Hugging Face's parameter name -> (our name, or the Part of ours it is, and the layout change
    to apply to the tensor)."""
    if name in _HF_TO_OURS_TOP:
        return _HF_TO_OURS_TOP[name], _identity
    m = _HF_LAYER.match(name)
    expert = ROUTED[args.family].parse(m.group(2)) if m is not None and args.moe.experts else None
    if expert is not None and expert[0] < args.moe.experts:
        ours = f"layers.{m.group(1)}.feed_forward.experts.{expert[1]}"
        return Part(ours, expert[0], args.moe.experts), _identity
    layer_names = {v: k for k, v in _layer_names(args).items()}
    if m is None or m.group(2) not in layer_names:
        raise KeyError(f"llama: Hugging Face parameter {name!r} has no counterpart here")
    ours = layer_names[m.group(2)]
    return f"layers.{m.group(1)}.{ours}", _layout_change(ours, args, halves_to_interleaved)


def hf_names(args: LlamaArgs) -> list[str]:
    """Our parameter names a Hugging Face checkpoint of this shape holds, in our order (a tied
    head has no lm_head.weight of its own)."""
    names = ["tok_embeddings.weight"]
    for i in range(args.n_layers):
        names += [f"layers.{i}.{k}" for k in _layer_names(args)]
        names += [f"layers.{i}.{k}" for k in (_EXPERT_NAMES if args.moe.experts else ())]
    names.append("norm.weight")
    return names if args.tie_embeddings else [*names, "output.weight"]


def hf_entries(args: LlamaArgs) -> list[tuple[str, str, int | None, Transform]]:
    """The Hugging Face checkpoint's tensors in order: (its name, our tensor's, the expert it is
    a slice of or None, the layout change)."""
    out = []
    for name in hf_names(args):
        m = _OURS_LAYER.match(name)
        if m is not None and m.group(2) in _EXPERT_NAMES:
            layer, proj = int(m.group(1)), _EXPERT_NAMES[m.group(2)]
            out += [(ROUTED[args.family].expert_name(layer, e, proj), name, e, _identity)
                    for e in range(args.moe.experts)]  # fmt: skip
        else:
            hf, transform = to_hf_name(name, args)
            out.append((hf, name, None, transform))
    return out


def to_hf(state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Our state dict -> Hugging Face's (a tied head's duplicate dropped)."""
    return {hf: fn(state[ours] if e is None else state[ours][e]) for hf, ours, e, fn in hf_entries(args)}


def from_hf(state: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    """Hugging Face's state dict -> ours (a tied head gets the embedding)."""
    out = {ours: fn(t) for name, t in state.items() for ours, fn in [from_hf_name(name, args)]}
    if args.tie_embeddings:
        out.pop("output.weight", None)
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# ----------------------------------------------------------------------------- config.json


def args_from_hf_config(cfg: dict) -> LlamaArgs:
    """LlamaArgs from a Hugging Face config dict of the Llama family: Llama, Mixtral, Mistral,
    Qwen2 and Qwen3 (rope scaling in either the old `rope_theta` + `rope_scaling` form or
    transformers 5's `rope_parameters`; a key config.json leaves out takes transformers' default)."""
    kind = cfg.get("model_type", "llama")
    if kind not in _ARCHITECTURES:
        raise ValueError(f"model.pretrained: config.json is a {kind!r} model; allowed: {', '.join(_ARCHITECTURES)}")
    family = {v: k for k, v in _ROUTED_TYPES.items()}.get(kind, kind)
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "llama3"):
        raise ValueError(f"model.pretrained: rope type {kind!r} is not supported (default or llama3)")
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim", 128 if family == "qwen3" else None)  # transformers' Qwen3 default
    for key in ("attention_bias", "mlp_bias"):  # Qwen2's q/k/v biases are its architecture's, not this key's
        if cfg.get(key):
            raise ValueError(f"model.pretrained: {key}=true (a bias on every projection) is not supported")
    llama3 = kind == "llama3"
    return LlamaArgs(
        dim=cfg["hidden_size"], n_layers=cfg["num_hidden_layers"], n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads, vocab_size=cfg["vocab_size"],
        ffn_hidden=cfg["intermediate_size"], norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta),
        rope_factor=float(rope["factor"]) if llama3 else None,
        rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        rope_original_max_pos=int(rope.get("original_max_position_embeddings", 8192)),
        max_seq_len=cfg.get("max_position_embeddings", 8192), tie_embeddings=bool(cfg.get("tie_word_embeddings")),
        moe=_moe_from_hf(cfg), head_dim=None if head_dim == cfg["hidden_size"] // heads else head_dim,
        qkv_bias=family == "qwen2", qk_norm=family == "qwen3", sliding_window=_sliding_window(cfg, family),
        family=family,
    )  # fmt: skip


def _sliding_window(cfg: dict, family: str) -> int | None:
    """Mistral's window (every layer; 4096 where config.json is silent). Qwen's windowed layers
    (use_sliding_window: those past max_window_layers only) are refused."""
    if family in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        raise ValueError("model.pretrained: use_sliding_window=true (windows in some layers) is not supported")
    if family != "mistral":
        return None
    if len(set(cfg.get("layer_types") or ())) > 1:
        raise ValueError("model.pretrained: a Mistral with mixed layer_types (sliding and full) is not supported")
    return cfg.get("sliding_window", 4096)


def _moe_from_hf(cfg: dict) -> MoEArgs:
    """Mixtral's experts (softmax router, top_k weights renormalised, no shared expert), or
    Qwen3-MoE's (the same router, renormalised as norm_topk_prob says; experts of
    moe_intermediate_size, in every layer)."""
    if cfg.get("model_type") == "qwen3_moe":
        if cfg.get("decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
            raise ValueError("model.pretrained: a Qwen3-MoE with dense layers (decoder_sparse_step, "
                             "mlp_only_layers) is not supported: experts in every layer only")  # fmt: skip
        experts = cfg.get(
            "num_experts", cfg.get("num_local_experts")
        )  # the published name; transformers 5 writes the other
        return MoEArgs(experts=experts, top_k=cfg["num_experts_per_tok"],
                       norm_topk=bool(cfg.get("norm_topk_prob", False)), hidden=cfg["moe_intermediate_size"],
                       aux_loss_coef=cfg.get("router_aux_loss_coef", 0.001))  # fmt: skip
    if cfg.get("model_type") != "mixtral":
        return MoEArgs()
    if cfg.get("sliding_window") is not None:
        raise ValueError("model.pretrained: Mixtral's sliding_window attention is not supported (null only)")
    return MoEArgs(experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"], norm_topk=True,
                   aux_loss_coef=cfg.get("router_aux_loss_coef", 0.01))  # fmt: skip


def hf_config(args: LlamaArgs, dtype: str = "float32") -> dict:
    """A Hugging Face config dict of the model's family (old-style rope keys, which every
    transformers reads)."""
    cfg = {
        "architectures": [_ARCHITECTURES[args.family]], "model_type": args.family, "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers, "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads, "intermediate_size": args.ffn_hidden, "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps, "rope_theta": args.rope_theta, "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "mlp_bias": False, "torch_dtype": dtype, "rope_scaling": None, "head_dim": args.head_size,
    }  # fmt: skip
    if args.family == "mistral":
        cfg["sliding_window"] = args.sliding_window
    if args.family in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    if args.moe.experts:  # Mixtral or Qwen3-MoE (framework/config/model.py refuses what they cannot hold)
        kind, moe = _ROUTED_TYPES[args.family], args.moe
        cfg |= {"architectures": [_ARCHITECTURES[kind]], "model_type": kind, "num_experts_per_tok": moe.top_k,
                "router_aux_loss_coef": moe.aux_loss_coef, "output_router_logits": False}  # fmt: skip
        if kind == "mixtral":
            cfg |= {"sliding_window": None, "num_local_experts": moe.experts}
        else:
            cfg |= {"num_experts": moe.experts, "moe_intermediate_size": moe.hidden or args.ffn_hidden,
                    "norm_topk_prob": moe.norm_topk, "decoder_sparse_step": 1, "mlp_only_layers": []}  # fmt: skip
    if args.rope_factor is not None:
        cfg["rope_scaling"] = {
            "rope_type": "llama3", "factor": args.rope_factor, "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_pos,
        }  # fmt: skip
    return cfg


# ----------------------------------------------------------------------------- safetensors


def hf_weight_files(folder: str) -> list[str]:
    """The safetensors files of a Hugging Face checkpoint folder: the shards its
    model.safetensors.index.json lists, else its model.safetensors (else every *.safetensors)."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, s) for s in shards]
    single = os.path.join(folder, "model.safetensors")
    files = [single] if os.path.exists(single) else sorted(
        os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))  # fmt: skip
    if not files:
        raise FileNotFoundError(f"model.pretrained: no *.safetensors in {folder}")
    return files


def iter_hf_tensors(folder: str, names: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) pairs, one tensor in memory at a time (safetensors.safe_open
    maps the file and reads each tensor on demand); `names`: only these."""
    from safetensors import safe_open

    for path in hf_weight_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if names is None or name in names:
                    yield name, f.get_tensor(name)


def hf_tensor_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, read from the files' headers only."""
    from safetensors import safe_open

    shapes = {}
    for path in hf_weight_files(folder):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes
