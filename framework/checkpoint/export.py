"""Export a checkpoint for use outside this framework (the library; its command line is
framework/doors/export.py): `python -m framework.export CHECKPOINT OUT --format hf` writes OUT/config.json and
OUT/model.safetensors that `transformers.AutoModelForCausalLM.from_pretrained(OUT)` loads, and the
run's tokenizer (tokenizer.json, tokenizer_config.json with its chat template) that
`transformers.AutoTokenizer.from_pretrained(OUT)` loads.

CHECKPOINT is a `step-NNNNNN` folder saved under any layout and world size (DCP reshards on
read). The export streams parameter by parameter: each tensor is read whole from the checkpoint
(DCP gathers its shards), converted to Hugging Face's name and layout (what the model declares: the contract's
`hf_entries`, `to_hf_name` and `hf_config`; export imports no model) and
written at its place in the safetensors file, whose header is written first from the
checkpoint's metadata. No more than one full parameter is in memory at a time.

The command line (framework/doors/export.py) reads the run's config as every door does
(framework/config/door.py: the config saved beside the checkpoints, the overrides on top, checked)
and also takes a run folder: `python -m framework.export RUN_DIR OUT [key=value ...]`.

`checkpoint.export=true` writes the same files through the same writer at the end of a run
(`export_at_end`: RUN_DIR/hf for model=llama and model=hf), from the model gathered in memory
instead of streamed from a checkpoint.

A peft=lora run exports the merged model (each adapted weight W + (alpha / rank) B A) with
`--format hf`, and its adapters alone in PEFT's format with `--format peft` (OUT/adapter_model.
safetensors and OUT/adapter_config.json, which `peft.PeftModel.from_pretrained(base, OUT)` loads
onto the Hugging Face base); `checkpoint.export=true` writes both (RUN_DIR/hf, RUN_DIR/adapter).
"""

from __future__ import annotations

import functools
import json
import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from omegaconf import OmegaConf, open_dict
from torch import nn

from framework.checkpoint.full import full_model_state_dict
from framework.contract import build_model, locate_target
from framework.hf import ties_embeddings
from framework.peft import enabled, is_adapter

SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}


class ExportError(ValueError):
    pass


def write_safetensors(path: str, entries: Sequence[tuple[str, torch.Size, torch.dtype]],
                      fetch: Callable[[int], torch.Tensor]) -> None:  # fmt: skip
    """A safetensors file of `entries` (name, shape, dtype), the header first; tensor i comes
    from `fetch(i)`, called once each, in order, so only one is held at a time."""
    header, offset = {}, 0
    for name, shape, dtype in entries:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for i, (name, shape, dtype) in enumerate(entries):
            t = fetch(i).to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ExportError(f"{name}: got shape {list(t.shape)}, the header says {list(shape)}")
            f.write(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    os.replace(tmp, path)


def checkpoint_tensors(checkpoint: str) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """The model tensors a DCP checkpoint holds (our names), from its metadata only."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(checkpoint).read_metadata()
    return {k[len("model.") :]: (m.size, m.properties.dtype) for k, m in meta.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}  # fmt: skip


def read_tensor(checkpoint: str, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """One whole model tensor from a DCP checkpoint (its shards gathered), on the CPU."""
    import torch.distributed.checkpoint as dcp

    from framework.dist import one_process_checkpoint_io

    out = torch.empty(shape, dtype=dtype)
    with one_process_checkpoint_io():
        dcp.load({"model": {name: out}}, checkpoint_id=checkpoint)
    return out


def has_hf_layout(cfg) -> bool:
    """Whether the run's model exports to Hugging Face's format: model=hf (a transformers model
    already), or a model class that declares its layout (the contract's `hf_entries`: model=llama)."""
    if cfg.model.get("name") == "hf":
        return True
    try:
        return hasattr(locate_target(cfg.model), "hf_entries")
    except ValueError:  # no importable _target_: nothing to export in Hugging Face's format
        return False


def hf_model_of(cfg, tensors: dict[str, tuple[torch.Size, torch.dtype]]) -> nn.Module:
    """The run's model on the meta device, with the vocabulary it trained with: what it declares
    of Hugging Face's layout (hf_entries, to_hf_name, hf_config) is read from it."""
    if not has_hf_layout(cfg) or cfg.model.get("name") == "hf":
        raise ExportError(f"--format hf: {cfg.model.get('_target_')} declares no Hugging Face layout (the "
                          "contract's hf_entries); model=llama does, and model=hf exports at the run's end")  # fmt: skip
    model_cfg = OmegaConf.create(OmegaConf.to_container(cfg.model, resolve=False))  # read, never written back
    with open_dict(model_cfg):
        model_cfg.vocab_size = _trained_vocab(model_cfg, tensors)
    return build_model(model_cfg, "meta")


def _trained_vocab(model_cfg, tensors: dict[str, tuple[torch.Size, torch.dtype]]) -> int | None:
    """The rows of the model's token embedding (its first nn.Embedding) in the checkpoint: the
    config's `${data_vocab:}` may no longer resolve (the data gone, or read elsewhere)."""
    probe = model_cfg.copy()
    with open_dict(probe):
        probe.vocab_size = 1
    embedding = next(name for name, m in build_model(probe, "meta").named_modules() if isinstance(m, nn.Embedding))
    return int(tensors[f"{embedding}.weight"][0][0])


def write_model_hf(cfg, out: str, tensors: dict[str, tuple[torch.Size, torch.dtype]],
                   read: Callable[[str], torch.Tensor], tokenizer=None) -> dict:  # fmt: skip
    """OUT/config.json, OUT/model.safetensors (and the run's `tokenizer`) of a model that declares
    its Hugging Face layout, whose tensors (our names: shape, dtype) are `tensors`; `read(name)`
    gives one whole tensor, called once per tensor, in order. Returns the config.json written."""
    model = hf_model_of(cfg, tensors)
    if enabled(cfg.get("peft")):  # the adapters folded into their weights
        read = merged(tensors, read, cfg.peft.alpha / cfg.peft.rank)
    hf = model.hf_entries()  # (Hugging Face name, ours, expert or None, layout change)
    missing = sorted({ours for _, ours, _, _ in hf} - set(tensors))
    if missing:
        raise ExportError(f"CHECKPOINT: the model state lacks {', '.join(missing[:5])}")
    os.makedirs(out, exist_ok=True)
    dtype = tensors[hf[0][1]][1]
    entries = [(name, tensors[ours][0][1:] if e is not None else tensors[ours][0], tensors[ours][1])
               for name, ours, e, _ in hf]  # fmt: skip
    read = functools.lru_cache(maxsize=1)(read)  # a grouped expert weight is read once for its experts
    write_safetensors(os.path.join(out, "model.safetensors"), entries,
                      lambda i: hf[i][3](read(hf[i][1]) if hf[i][2] is None else read(hf[i][1])[hf[i][2]]))  # fmt: skip
    config_json = model.hf_config(str(dtype).removeprefix("torch."))
    Path(out, "config.json").write_text(json.dumps(config_json, indent=2))
    write_tokenizer(tokenizer, out)
    return config_json


def merged(tensors: dict, read: Callable[[str], torch.Tensor], scaling: float) -> Callable[[str], torch.Tensor]:
    """`read`, with each adapted linear's update folded into its weight: W + scaling B A."""

    def read_merged(name: str) -> torch.Tensor:
        weight = read(name)
        stem = name.removesuffix(".weight")
        if f"{stem}.lora_A.weight" in tensors:
            update = read(f"{stem}.lora_B.weight").double() @ read(f"{stem}.lora_A.weight").double()
            weight = (weight.double() + scaling * update).to(weight.dtype)
        return weight

    return read_merged


def write_peft_adapter(cfg, out: str, tensors: dict, read: Callable[[str], torch.Tensor]) -> dict:
    """OUT/adapter_model.safetensors and OUT/adapter_config.json in PEFT's format: the adapters of
    a peft=lora llama under Hugging Face's module names (B's rows in its rotary layout, as W's).
    Returns the base model's config.json (what the adapter applies to)."""
    if not enabled(cfg.get("peft")):
        raise ExportError("--format peft: the run trained no adapters (peft=none)")
    model = hf_model_of(cfg, tensors)
    names = sorted(n for n in tensors if is_adapter(n))
    keys, transforms = [], []
    for name in names:
        stem, _, kind = name.partition(".lora_")
        hf, transform = model.to_hf_name(f"{stem}.weight")
        keys.append(f"base_model.model.{hf.removesuffix('.weight')}.lora_{kind}")
        transforms.append(transform if kind.startswith("B") else (lambda t: t))
    os.makedirs(out, exist_ok=True)
    entries = [(key, *tensors[name]) for key, name in zip(keys, names, strict=True)]
    write_safetensors(os.path.join(out, "adapter_model.safetensors"), entries,
                      lambda i: transforms[i](read(names[i])))  # fmt: skip
    modules = sorted({k.removeprefix("base_model.model.").rpartition(".lora_")[0] for k in keys})
    p = cfg.peft
    config_json = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": p.rank, "lora_alpha": p.alpha,
                   "lora_dropout": p.dropout, "target_modules": "|".join(m.replace(".", r"\.") for m in modules),
                   "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
                   "base_model_name_or_path": cfg.model.get("pretrained")}  # fmt: skip
    Path(out, "adapter_config.json").write_text(json.dumps(config_json, indent=2))
    return model.hf_config(str(tensors[names[0]][1]).removeprefix("torch."))


def export_hf(cfg, checkpoint: str, out: str, fmt: str = "hf", tokenizer=None) -> dict:
    """The CLI's export of `checkpoint` trained under `cfg` (the door's, checked): streamed from a DCP
    checkpoint, one whole tensor in memory at a time. Returns the (base) model's Hugging Face
    config.json."""
    tensors = checkpoint_tensors(checkpoint)
    read = lambda name: read_tensor(checkpoint, name, *tensors[name])  # noqa: E731
    if fmt == "peft":
        return write_peft_adapter(cfg, out, tensors, read)
    return write_model_hf(cfg, out, tensors, read, tokenizer)


def write_transformers_hf(cfg, out: str, state: dict[str, torch.Tensor], tokenizer=None) -> None:
    """model=hf: the state dict already has transformers' names and layout; its config.json is
    the run's `model.config` (training changes no shape). A tied head is left out, as
    `save_pretrained` does (from_pretrained ties it again); whether it ties is transformers' reading
    of the config (its model type's default when config.json does not say), so a trained untied
    head is never dropped."""
    config_json = json.loads(Path(cfg.model.config, "config.json").read_text())
    if ties_embeddings(cfg.model.config, bool(cfg.model.get("trust_remote_code", False))):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    os.makedirs(out, exist_ok=True)
    names = list(state)
    entries = [(n, state[n].shape, state[n].dtype) for n in names]
    write_safetensors(os.path.join(out, "model.safetensors"), entries, lambda i: state[names[i]])
    Path(out, "config.json").write_text(json.dumps(config_json, indent=2))
    write_tokenizer(tokenizer, out)


def export_at_end(cfg, run_dir: str, par, is_main: bool, tokenizer=None) -> str:
    """checkpoint.export=true, after the last step: the full model, gathered from shards and
    stages (collective: every rank calls it), written by rank 0 with the run's `tokenizer`. Models with a Hugging Face
    layout go to RUN_DIR/hf (config.json + model.safetensors, through the CLI's writer, which
    `AutoModelForCausalLM.from_pretrained` loads); others to RUN_DIR/model.pt (`torch.load(path,
    weights_only=True)` into the plain model). Returns the path written."""
    state = full_model_state_dict(par)
    path = os.path.join(run_dir, "hf" if has_hf_layout(cfg) else "model.pt")
    if not is_main:
        return path
    written = f"{path} (Hugging Face: config.json + model.safetensors)"
    if cfg.model.get("name") == "hf":
        write_transformers_hf(cfg, path, state, tokenizer)
    elif has_hf_layout(cfg):
        tensors = {k: (v.shape, v.dtype) for k, v in state.items()}
        write_model_hf(cfg, path, tensors, state.__getitem__, tokenizer)
        if enabled(cfg.get("peft")):
            write_peft_adapter(cfg, os.path.join(run_dir, "adapter"), tensors, state.__getitem__)
            written = (
                f"{path} (LoRA merged in; Hugging Face) and {os.path.join(run_dir, 'adapter')} (the adapter, PEFT's)"
            )
    else:
        torch.save(state, path)
        written = f"{path} (the full state dict: torch.load(path, weights_only=True))"
    print(f"export: {written}", flush=True)
    return path


def write_tokenizer(tok, out: str) -> None:
    """The run's tokenizer (framework.data.tokenizer's, which the caller loads) beside the weights,
    as transformers' `AutoTokenizer.from_pretrained(OUT)` loads it: tokenizer.json (with the
    end-of-document token it may have gained) and tokenizer_config.json (its own, else a fast
    tokenizer's), with the chat template the run's conversations were rendered with and the
    end-of-document token as `eos_token`. config.json's `eos_token_id` follows that token where it
    names none, so transformers' generate stops where `framework.generate` does. None, or a bytes
    run's tokenizer (no Hugging Face one): nothing is written."""
    if tok is None or not hasattr(tok, "chat_template"):
        return
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tok.config, "eos_token": tok.eos_token}
    if template := tok.chat_template():
        config["chat_template"] = template
    Path(out, "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))
    model_config = Path(out, "config.json")
    model_json = json.loads(model_config.read_text())
    if model_json.get("eos_token_id") is None:
        model_config.write_text(json.dumps(model_json | {"eos_token_id": tok.eos_id}, indent=2))
