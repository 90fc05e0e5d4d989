"""The shape of a Llama (models/llama.py) and its published flavours: plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from models.moe import MoEArgs


@dataclass(frozen=True)
class LlamaArgs:
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    n_kv_heads: int = 8
    vocab_size: int = 256
    ffn_hidden: int = 768
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama-3.1 rope scaling (null factor: none): long wavelengths divided by `rope_factor`
    rope_factor: float | None = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_pos: int = 8192
    max_seq_len: int = 8192
    tie_embeddings: bool = False
    moe: MoEArgs = field(default_factory=MoEArgs)  # routed experts in every block's MLP (0 experts: dense)
    # the decoder families beside Llama (models/llama_hf.py reads them from their config.json)
    head_dim: int | None = None  # each head's width (null: dim / n_heads; Qwen3 and Mistral-Nemo set theirs)
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    qk_norm: bool = False  # each head's queries and keys RMS-normed before rotation (Qwen3)
    sliding_window: int | None = None  # a token sees itself and the window - 1 before it (Mistral)
    family: str = "llama"  # the Hugging Face architecture it goes out as: llama, mistral, qwen2, qwen3

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # LlamaArgs.family (a routed Llama goes out as Mixtral)

_LLAMA31 = {"rope_factor": 8.0, "rope_theta": 500000.0}
# The published shapes: Llama 3.2 1B, Llama 3.1 8B and 70B (128256-token vocabulary). debug is
# torchtitan's debug model with grouped-query attention on; 150m is not a published Llama but the
# GPT-2-small shape in Llama form (12 x 768), a size that trains on one GPU.
FLAVORS: dict[str, LlamaArgs] = {
    "debug": LlamaArgs(),
    # mixtures of experts: a small one, and published shapes for the planner (Mixtral 8x7B:
    # 8 experts, 2 active; Qwen3-30B-A3B: 128 experts of 768, 8 active, softmax, no shared one, its
    # heads 128 wide and q/k-normed)
    "debug_moe": LlamaArgs(moe=MoEArgs(experts=4, top_k=2)),
    "mixtral_8x7b": LlamaArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        ffn_hidden=14336,
        rope_theta=1e6,
        max_seq_len=32768,
        moe=MoEArgs(experts=8, top_k=2, norm_topk=True),
    ),
    "qwen3_30b_a3b": LlamaArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        vocab_size=151936,
        ffn_hidden=6144,
        rope_theta=1e6,
        max_seq_len=40960,
        moe=MoEArgs(experts=128, top_k=8, hidden=768, norm_topk=True),
        head_dim=128,
        qk_norm=True,
        family="qwen3",
    ),
    "150m": LlamaArgs(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        vocab_size=32000,
        ffn_hidden=2048,
        rope_theta=10000.0,
        max_seq_len=2048,
    ),  # fmt: skip
    "1b": LlamaArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=8192,
        rope_factor=32.0,
        max_seq_len=131072,
        tie_embeddings=True,
    ),  # fmt: skip
    "8b": LlamaArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=14336,
        max_seq_len=131072,
        **_LLAMA31,
    ),  # fmt: skip
    "70b": LlamaArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        ffn_hidden=28672,
        max_seq_len=131072,
        **_LLAMA31,
    ),  # fmt: skip
}
