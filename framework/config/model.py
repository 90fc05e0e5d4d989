"""The model's part of validation: the ``model`` group names something that imports, takes the
keys given to it, builds on the meta device, and declares what the chosen strategy needs
(framework/contract.py). Every problem is one ConfigError naming the key and what to declare."""

from __future__ import annotations

import inspect

import torch
from omegaconf import DictConfig, OmegaConf, open_dict
from torch import nn
from torch.torch_version import TorchVersion

from framework.components import ComponentError, nearest
from framework.config.errors import ConfigError
from framework.contract import (
    LM_DATA,
    RESERVED_KEYS,
    ContractError,
    ModelSpec,
    blocks_of,
    build_model,
    check_plan,
    locate_target,
    spec_of,
)
from framework.converters import convert_model

_BUILT: dict[str, tuple[nn.Module, ModelSpec]] = {}  # one meta build per model config


def meta_model(cfg: DictConfig) -> nn.Module:
    return _meta(cfg)[0]


def model_spec(cfg: DictConfig) -> ModelSpec:
    return _meta(cfg)[1]


def _meta(cfg: DictConfig) -> tuple[nn.Module, ModelSpec]:
    key = OmegaConf.to_yaml(cfg.model, resolve=True) + OmegaConf.to_yaml(
        {k: cfg.get(k) for k in ("peft", "converters")}
    )
    if key not in _BUILT:
        target = locate_target(cfg.model)
        try:
            model = build_model(cfg.model, "meta")
        except Exception as err:
            err = err.__cause__ or err  # Hydra's InstantiationException wraps the factory's own
            arg, _, rest = str(err).partition(": ")
            if arg in cfg.model and rest:  # the factory named its argument
                raise ConfigError(f"model.{arg}", rest) from None
            raise ConfigError("model", f"{cfg.model._target_} does not build: {type(err).__name__}: {err}") from None
        _BUILT.clear()
        spec = _spec(model, cfg, target)
        _check_peft_settings(cfg.get("peft"))  # before the adapters are built from them (a rank of 0 would raise)
        try:  # the converters, as the run applies them: the planner counts what trains
            convert_model(model, cfg, spec)
        except ComponentError as err:  # a converter's refusal of this model (float8: no eligible linear)
            raise ConfigError(err.key, str(err).split(": ", 1)[1]) from None
        except ValueError:  # LoRA's targets that match nothing: _check_peft names them
            pass
        _BUILT[key] = model, spec
    return _BUILT[key]


def _spec(model: nn.Module, cfg: DictConfig, target) -> ModelSpec:
    try:
        return spec_of(model, cfg.model)
    except ContractError as err:
        raise ConfigError(err.key, str(err).split(": ", 1)[1]) from None


def model_dims_of(cfg: DictConfig) -> tuple[int | None, int | None]:
    """(blocks, attention heads) of the configured model, for the parallel degrees' checks."""
    model, spec = _meta(cfg)
    return len(blocks_of(model, spec)) or None, spec.heads


def check_model(cfg: DictConfig) -> None:
    """Before any worker starts: the model imports, takes its keys, builds, suits the data."""
    try:
        target = locate_target(cfg.model)
    except ContractError as err:
        raise ConfigError(err.key, str(err).split(": ", 1)[1]) from None
    if cfg.model._target_ == "framework.hf.from_config":
        from framework.hf import check_config_folder

        config, pretrained = cfg.model.get("config"), cfg.model.get("pretrained")
        key = "model.pretrained" if pretrained is not None and config == pretrained else "model.config"  # its default
        if problem := check_config_folder(config, key):
            raise ConfigError(key, problem)
    declared = getattr(target, "trains_on", None)  # read before building: its keys may point into data
    if declared is not None and cfg.data.name not in (*declared, "custom"):
        raise ConfigError("data", f"{cfg.model._target_} trains on data={'|'.join(declared)}, got data={cfg.data.name}")
    _check_arguments(cfg, target)
    if cfg.model.get("pretrained") is not None:
        from framework.hf import check_pretrained_folder

        problem = check_pretrained_folder(cfg.model.pretrained)
        if problem:
            raise ConfigError("model.pretrained", problem)
    _check_moe_settings(cfg.model.get("moe"))
    model, spec = _meta(cfg)
    data = cfg.data.name
    trains_on = spec.trains_on or (LM_DATA if spec.task == "lm" else None)
    if trains_on is not None and data not in (*trains_on, "custom"):
        raise ConfigError("data", f"{cfg.model._target_} trains on data={'|'.join(trains_on)}, got data={data}")
    if spec.task == "lm" and data in LM_DATA and cfg.data.get("seq_len") is not None:
        _check_sequence(cfg, model)
    if cfg.memory.name in ("checkpoint", "selective", "offload_activations") and not blocks_of(model, spec):
        raise ConfigError(
            "memory",
            f"memory={cfg.memory.name} works on a model's blocks; {type(model).__name__} has none found "
            "(declare blocks_path or set model.blocks=<path>). Use memory=none",
        )
    _check_peft(cfg, model, spec.blocks)
    _check_moe(cfg, model, spec.blocks)
    _check_family(cfg, getattr(model, "args", None))


def _check_moe_settings(moe) -> None:
    """model.moe's own values, before the model builds with them."""
    if not moe:
        return
    for key, low in (("experts", 0), ("top_k", 1), ("shared_experts", 0), ("hidden", 1)):
        if moe.get(key) is not None and moe[key] < low:
            raise ConfigError(f"model.moe.{key}", f"got {moe[key]}; must be an integer >= {low}")
    for key, allowed in (("score", ("softmax", "sigmoid")), ("balance", ("aux_loss", "bias", "none")),
                         ("balance_scope", ("global", "micro"))):  # fmt: skip
        if moe.get(key) is not None and moe[key] not in allowed:
            raise ConfigError(f"model.moe.{key}", f"got {moe[key]!r}; allowed: {', '.join(allowed)}")
    for key in ("aux_loss_coef", "bias_rate"):  # the balancing loss's weight, the bias's step (0: off)
        if moe.get(key) is not None and moe[key] < 0:
            raise ConfigError(f"model.moe.{key}", f"got {moe[key]}; must be >= 0, or null: the flavour's")
    if moe.get("capacity_factor") is not None and not moe.capacity_factor > 0:
        raise ConfigError("model.moe.capacity_factor", f"got {moe.capacity_factor}; > 0, or null: dropless")


def _check_moe(cfg: DictConfig, model, blocks: str | None) -> None:
    """Routed experts (models/moe.py): top_k within the experts; the strategies they run under."""
    from framework.moe import routed_layers

    layers, ep = routed_layers(model, blocks or ""), cfg.parallel.get("ep", 1)
    if not layers:
        if ep > 1:
            raise ConfigError("parallel.ep", f"got {ep}; expert parallel splits routed experts, and this model has "
                              "none (a mixture of experts: model=llama model.moe.experts=4)")  # fmt: skip
        return
    args = layers[0][1].args
    if args.top_k > args.experts:
        raise ConfigError("model.moe.top_k", f"got {args.top_k}; at most model.moe.experts={args.experts}")
    if cfg.compile:  # found by the matrix's covering subset: 4 layers of 4 experts, top 2, fp32
        raise ConfigError("compile", "compiled routed experts do not follow the eager run (by the third step "
                          "24 of 1,024 token assignments go to other experts); set compile=false")  # fmt: skip
    if args.experts % ep:
        raise ConfigError("parallel.ep", f"got {ep}; each ep rank holds experts / ep of the "
                          f"{args.experts} experts, so it must divide them")  # fmt: skip
    hidden = args.hidden in (None, getattr(getattr(model, "args", None), "ffn_hidden", None))
    family = getattr(getattr(model, "args", None), "family", "llama")
    mixtral = family == "llama" and args.norm_topk and hidden
    held = args.score == "softmax" and not args.shared_experts and (mixtral or family == "qwen3")
    if (cfg.checkpoint.get("export") or cfg.model.get("pretrained")) and not held:
        key = "checkpoint.export" if cfg.checkpoint.get("export") else "model.pretrained"
        raise ConfigError(key, "routed experts go to and from Hugging Face in Mixtral's layout (model.moe.score="
                          "softmax, norm_topk=true, shared_experts=0, hidden=null: model.flavor=mixtral_8x7b) or "
                          "Qwen3-MoE's (model.family=qwen3, score=softmax, shared_experts=0)")  # fmt: skip


def _check_family(cfg: DictConfig, args) -> None:
    """A Llama's family options (models/llama_args.py): its window under torch's context parallel
    (our ring applies it), and what its Hugging Face architecture (model.family) holds when it goes out."""
    window, seq_len, impl = getattr(args, "sliding_window", None), cfg.data.get("seq_len") or 0, "ring"
    if window is not None and window < seq_len and cfg.parallel.get("cp", 1) != 1 and _cp_degree(cfg) > 1:
        impl = cfg.parallel.get("cp_impl", "ring")
    if impl == "torch":
        raise ConfigError("parallel.cp_impl", f"torch's context parallel has no sliding window ({window} tokens, "
                          f"shorter than data.seq_len={seq_len}); use parallel.cp_impl=ring")  # fmt: skip
    if getattr(args, "family", None) is None or not cfg.checkpoint.get("export"):
        return
    needs = {"qwen2": ("qkv_bias", True), "qwen3": ("qk_norm", True)}
    for family, (key, value) in needs.items():
        if (args.family == family) != (getattr(args, key) == value):
            raise ConfigError("model.family", f"got {args.family}; model.{key}={getattr(args, key)} goes out as "
                              f"Hugging Face's {family} (model.family={family}) and only there")  # fmt: skip
    if args.sliding_window is not None and args.family != "mistral":
        raise ConfigError("model.family", f"got {args.family}; a sliding window goes out as mistral only")


def _cp_degree(cfg: DictConfig) -> int:
    from framework.config.resolve import world_size_of
    from framework.parallel.dims import ParallelDims

    return ParallelDims.from_config(cfg.parallel, world_size_of(cfg), *model_dims_of(cfg)).cp


def _check_peft(cfg: DictConfig, model, blocks: str | None) -> None:
    """peft=lora's settings, where its adapters can go, and the strategies it runs under."""
    from framework.peft import enabled, targets_of

    p = cfg.get("peft")
    if not enabled(p):
        return
    _check_peft_settings(p)
    if not targets_of(model, blocks, list(p.targets)):
        linears = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear][:4]
        raise ConfigError("peft.targets", f"{list(p.targets)} match no linear layer of the blocks; some of the "
                          f"model's: {', '.join(linears)}")  # fmt: skip


def _check_peft_settings(p: DictConfig | None) -> None:
    from framework.peft import enabled

    if not enabled(p):
        return
    for key, ok, allowed in (("rank", p.rank >= 1, ">= 1"), ("alpha", p.alpha > 0, "> 0"),
                             ("dropout", 0 <= p.dropout < 1, "in [0, 1)")):  # fmt: skip
        if not ok:
            raise ConfigError(f"peft.{key}", f"got {p[key]}; must be {allowed}")


def _check_arguments(cfg: DictConfig, target) -> None:
    """Every key of the group is an argument of the factory (or the framework's own)."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for key in cfg.model:
        if key not in RESERVED_KEYS and key != "_target_" and key not in params:
            names = [n for n in params if n != "self"]
            hint = f"did you mean {near!r}? " if (near := nearest(key, names)) else ""
            raise ConfigError(f"model.{key}", f"{cfg.model._target_} takes no argument {key!r}; {hint}it takes: "
                              f"{', '.join(names) or 'none'}")  # fmt: skip


def _check_sequence(cfg: DictConfig, model: nn.Module) -> None:
    seq_len = cfg.data.seq_len
    if cfg.data.name == "varlen":
        seq_len = cfg.data.pack_len if cfg.data.pack else cfg.data.max_len - 1
        if cfg.data.min_len < 2:
            raise ConfigError("data.min_len", "language modelling needs sequences of >= 2 tokens")
    elif seq_len < 2:
        raise ConfigError("data.seq_len", "must be >= 2")
    longest = getattr(model, "block_size", None)
    if longest is not None and seq_len > longest:
        key = "model.block_size" if cfg.data.name == "varlen" else "data.seq_len"
        raise ConfigError(key, f"the longest input is {seq_len} tokens; the model takes at most block_size={longest}")


def check_tensor_parallel(cfg: DictConfig) -> None:
    """parallel with tp > 1: the model declares a plan whose submodules exist; not compiled."""
    if cfg.compile:  # torch 2.14.1: the gpt trains compiled bitwise as eager, the Llama's backward fails
        raise ConfigError(
            "compile",
            f"torch {torch.__version__.split('+')[0]} does not compile tensor-parallel blocks reliably: a "
            "compiled block's backward hands DTensor's redistribute a plain tensor (upstream: "
            "pytorch/pytorch#173123); set compile=false with tensor parallel",
        )
    model, spec = _meta(cfg)
    if not spec.tp_plan:
        raise ConfigError(
            "parallel.tp",
            f"tensor parallel needs the model's plan; {type(model).__name__} declares none. Declare tp_plan "
            "(submodule pattern -> colwise|rowwise|...) or set model.tp_plan",
        )
    try:
        check_plan(model, spec)
    except ContractError as err:
        raise ConfigError(err.key, str(err).split(": ", 1)[1]) from None
    if cfg.parallel.get("sequence_parallel", None) and not _plans_sequence_parallel(spec):
        raise ConfigError(
            "parallel.sequence_parallel",
            f"{type(model).__name__}'s plan has no sequence-parallel entries (embedding, sequence_parallel "
            "norms); set parallel.sequence_parallel=false or declare them",
        )


def _plans_sequence_parallel(spec: ModelSpec) -> bool:
    """A plan runs sequence parallel when it splits the embeddings' output along the sequence and
    runs its norms on sequence shards; without both the residual stream has no sequence layout."""
    styles = set(spec.tp_plan.values())
    return bool({"embedding", "vocab_embedding"} & styles) and "sequence_parallel" in styles


def resolve_sequence_parallel(cfg: DictConfig, tp: int) -> str | None:
    """`parallel.sequence_parallel` null (auto, the default) becomes a bool in `cfg`, the one place
    it is decided: on where the model's plan has sequence-parallel entries, else off, said in one
    line (a plan without them, like docs/own_model.md's TinyLM or a Hugging Face model's, trains without
    a flag). Workers and the planner read the bool. A widened tp axis (parallel=fsdp
    parallel.tp=2) gets the key too. An explicit value stays; check_tensor_parallel refuses a true
    that the plan cannot run. Returns the line to print when auto turned it off under tp."""
    p = cfg.parallel
    if p.get("sequence_parallel", None) is not None or (tp <= 1 and "sequence_parallel" not in p):
        return None
    model, spec = _meta(cfg)
    with open_dict(p):
        p.sequence_parallel = bool(spec.tp_plan) and _plans_sequence_parallel(spec)
    if tp > 1 and not p.sequence_parallel:
        return f"parallel.sequence_parallel: off ({type(model).__name__}'s plan has no sequence-parallel entries)"
    return None


PIPELINE_TORCH = "2.14"  # the oldest torch whose pipelining trains equal to one process here (2.11 does not)


def pipeline_torch_too_old(version: str) -> bool:
    return TorchVersion(version) < PIPELINE_TORCH


def check_pipeline(cfg: DictConfig) -> None:
    """parallel with pp > 1: the model has blocks and splits cleanly around them."""
    from framework.parallel.pipeline import trace_split

    if pipeline_torch_too_old(torch.__version__):
        raise ConfigError(
            "parallel.pp",
            f"pipeline parallel needs torch >= {PIPELINE_TORCH}; this is torch {torch.__version__.split('+')[0]}, "
            "whose torch.distributed.pipelining (shape inference, schedule order) this project does not train "
            "right with (benchmarks/gpu_rehearsal.sh); use pp=1 here, or a newer torch",
        )
    if cfg.data.get("pack"):
        raise ConfigError(
            "data.pack",
            "a pipeline's stages hand each other one activation, not each micro-batch's document ids, "
            "which every block's mask reads; set parallel.pp=1 or data.pack=false",
        )
    model, spec = _meta(cfg)
    if spec.task != "lm" or not blocks_of(model, spec):
        raise ConfigError(
            "parallel.pp",
            f"a pipeline splits a language model's blocks; {type(model).__name__} has none found "
            "(declare blocks_path or set model.blocks=<path>)",
        )
    try:
        trace_split(model, spec, 2)
    except ContractError as err:
        raise ConfigError(err.key, str(err).split(": ", 1)[1]) from None
