"""The `model` group's schemas: what every choice has (`ModelConfig`, the model contract's keys:
framework/contract.py) and each built-in's factory arguments."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

__all__ = ["GPTConfig", "HFConfig", "LSTMConfig", "LlamaConfig", "MLPConfig", "ModelConfig", "ResNetConfig"]


@dataclass
class ModelConfig:
    """What every model choice has (framework/contract.py); the rest are its factory's arguments."""

    name: str | None = None  # the choice's name (display only)
    _target_: str = MISSING  # the model's class or factory, e.g. pkg.module.MyModel
    task: str | None = None  # lm | classify; null: what the model declares (else lm)
    blocks: str | None = None  # attribute path of the repeated layers; null: declared or found
    tp_plan: dict[str, str] | None = None  # tensor-parallel plan {submodule pattern: style}; null: declared
    pretrained: str | None = None  # a folder of *.safetensors to load (model=hf; models with a state-dict adapter)


@dataclass
class GPTConfig(ModelConfig):
    name: str | None = "gpt"
    _target_: str = "models.gpt.GPT"
    vocab_size: int = 256
    block_size: int = 128  # longest sequence the model accepts
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False


@dataclass
class MoEConfig:
    """model.moe (models/moe.py); null: the flavour's (debug_moe, mixtral_8x7b, qwen3_30b_a3b)."""

    experts: int | None = None  # routed experts in every block's MLP (0: dense)
    top_k: int | None = None  # experts each token goes to
    shared_experts: int | None = None  # 0 or more experts every token goes through
    hidden: int | None = None  # each expert's hidden width (null: the model's ffn_hidden)
    score: str | None = None  # softmax | sigmoid (DeepSeek-V3: the chosen weights normalised)
    norm_topk: bool | None = None  # softmax: the chosen weights renormalised to sum 1 (Mixtral, Qwen3-MoE)
    balance: str | None = None  # aux_loss | bias (DeepSeek-V3's, loss-free) | none
    balance_scope: str | None = None  # global: f over the whole global batch (default) | micro: each micro-batch's
    aux_loss_coef: float | None = None  # balance=aux_loss: its weight (0.01)
    bias_rate: float | None = None  # balance=bias: each update's step (1e-3)
    capacity_factor: float | None = None  # null: dropless; else tokens an expert takes at most, x its share


@dataclass
class LlamaConfig(ModelConfig):
    """model=llama (models/llama.py). Null shape keys: the flavour's (or, with model.pretrained,
    the folder's config.json)."""

    name: str | None = "llama"
    _target_: str = "models.llama.Llama"
    flavor: str = "debug"  # debug | 150m | 1b | 8b | 70b
    hf_config: str | None = None  # the folder whose config.json gives the shape (conf: model.pretrained)
    vocab_size: int | None = None  # conf: the data's tokenizer's (${data_vocab:}); null: the flavour's
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None
    norm_eps: float | None = None
    rope_theta: float | None = None
    rope_factor: float | None = None  # Llama-3.1 rope scaling factor (null: the flavour's)
    max_seq_len: int | None = None
    tie_embeddings: bool | None = None
    moe: MoEConfig = field(default_factory=MoEConfig)  # routed experts (model.moe.experts=4 model.moe.top_k=2)
    # the families beside Llama (a Mistral, Qwen2 or Qwen3 folder's config.json sets them)
    head_dim: int | None = None  # each head's width (null: dim / n_heads)
    qkv_bias: bool | None = None  # biases on the query, key and value projections (Qwen2)
    qk_norm: bool | None = None  # per-head RMS norms on queries and keys (Qwen3)
    sliding_window: int | None = None  # attention within the last N tokens (Mistral)
    family: str | None = None  # llama | mistral | qwen2 | qwen3: the Hugging Face architecture it exports as


@dataclass
class MLPConfig(ModelConfig):
    name: str | None = "mlp"
    _target_: str = "models.mlp.MLP"
    in_dim: int = 32
    hidden: int = 256
    depth: int = 3
    num_classes: int = 8
    dropout: float = 0.0


@dataclass
class ResNetConfig(ModelConfig):
    name: str | None = "resnet"
    _target_: str = "models.resnet.ResNet"
    arch: str = "resnet18"  # any torchvision.models resnet builder name
    num_classes: int = 10
    small_input: bool = True  # 3x3 stem without max-pool, for 32x32 images


@dataclass
class LSTMConfig(ModelConfig):
    name: str | None = "lstm"
    _target_: str = "models.lstm.LSTMClassifier"
    vocab_size: int = 32
    embed_dim: int = 64
    hidden: int = 128
    num_layers: int = 1
    num_classes: int = 4
    bidirectional: bool = False


@dataclass
class HFConfig(ModelConfig):
    """A Hugging Face causal LM: built from a config.json on the meta device (framework/hf.py)."""

    name: str | None = "hf"
    _target_: str = "framework.hf.from_config"
    config: str | None = None  # a folder with config.json (conf: model.pretrained's)
    trust_remote_code: bool = False  # run the folder's own modelling code (off unless named here)
    attn_implementation: str = "sdpa"  # sdpa | eager


@dataclass
class PeftConfig:
    """Parameter-efficient fine-tuning (framework/peft.py): none trains every parameter."""

    name: str = "none"


@dataclass
class LoraConfig(PeftConfig):
    """LoRA: low-rank adapters beside the targeted linears; only they train."""

    rank: int = 8
    alpha: float = 16.0  # the update is scaled by alpha / rank
    dropout: float = 0.0  # on the adapters' input
    # module-name patterns (fnmatch) of the blocks' linears to adapt, in the model's own names
    # (`*.wq`, `layers.*.attention.*`); a pattern without a dot matches the last name
    targets: list[str] = field(default_factory=lambda: ["*"])
