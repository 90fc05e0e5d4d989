"""Model converters (torchtitan's ModelConverter protocol): what changes a model's structure, or
what of it trains, before it is laid out. They apply at one point of the build (`converted_model`)
to every model, one kept on the meta device or one built whole on the run's device, in order:
`peft=lora`'s adapters first (framework/peft.py), then each entry of the `converters` group in the
order listed (`converters=[freeze_emb]`, from conf/converters/freeze_emb.yaml holding
`freeze_emb: {_target_: pkg.Cls, ...its kwargs}`).

A converter is a class (framework/components.py: checked against its signature before any
worker starts) with
- `convert(model)`: in place, on the meta device or on the device the model was built on (a
  converter that fills values fills them on either);
- `post_optimizer_hook(model)` (optional): after every optimizer step, on the laid-out model
  (registered as the optimizer's step post hook: the loop names no converter);
- `line()` (optional): one line the run prints after converting (what changed, and how);
- `summary(flops_per_token)` (optional): summary.json's `converters.<entry>`.

Its constructor may take, beside its kwargs, what only the run knows: `run`, a `RunContext` (the
model's contract, the layout's config, the device); the framework passes it where it is named.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.components import ComponentError, build_component, check_component
from framework.contract import ModelSpec, build_model
from framework.peft import apply_peft, describe, enabled


@dataclass(frozen=True)
class RunContext:
    """What only the run knows, for a converter whose constructor takes `run`."""

    model_spec: ModelSpec
    parallel: Any  # the layout's config (cfg.parallel)
    device: Any


def converted_model(meta: nn.Module, spec: ModelSpec, cfg: DictConfig, info: Any) -> tuple[nn.Module, dict]:
    """The model the run lays out, through the one converter point: `meta` itself where its values
    come later, else built whole on the device; then every converter, once.

    Models with an init rule (gpt), and pretrained weights, stay on the meta device until the
    strategy says when to allocate them (`Strategy.materialise_late`): either way the values are
    the single-process model's (row-seeded: models/init.py). Models without one are built on the
    device whole, from the run's seed, with their own initialisation."""
    model = meta
    if not on_meta(spec, cfg):
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model, info.device)
    return model, convert_model(model, cfg, spec, info.device, verbose=info.is_main)


def on_meta(spec: ModelSpec, cfg: DictConfig) -> bool:
    """The model stays on the meta device until the strategy allocates this rank's part."""
    return spec.on_meta or cfg.model.get("pretrained") is not None


def convert_model(model: nn.Module, cfg: DictConfig, spec: ModelSpec, device: Any = "cpu",
                  verbose: bool = False) -> dict[str, Any]:  # fmt: skip
    """Apply every converter the config asks for to `model`, in place, in order; the converter
    objects by entry (their post-optimizer hooks, lines and summaries). `verbose`: print what
    LoRA adapted and each converter's line (rank 0's)."""
    apply_peft(model, cfg.get("peft"), spec.blocks, cfg.seed)
    if verbose and enabled(cfg.get("peft")):
        print(describe(model, cfg.peft), flush=True)
    converters = {}
    for name, node in (cfg.get("converters") or {}).items():
        converter = build_component(node, (), run=RunContext(spec, cfg.parallel, device))
        converter.convert(model)
        if verbose and callable(getattr(converter, "line", None)):
            print(converter.line(), flush=True)
        converters[name] = converter
    return converters


def converter_summaries(converters: dict[str, Any], flops_per_token: float | None) -> dict[str, dict] | None:
    """summary.json's `converters`: each converter's own summary, where it gives one."""
    out = {n: c.summary(flops_per_token) for n, c in converters.items() if callable(getattr(c, "summary", None))}
    return out or None


def check_converters(cfg: DictConfig) -> None:
    """Each entry of `converters`: its class imports, takes its keys, and has `convert(model)`."""
    for name in cfg.get("converters") or {}:
        key = f"converters.{name}"
        if not OmegaConf.is_dict(cfg.converters[name]):
            raise ComponentError(
                key, f"got {cfg.converters[name]!r}; a converter is a class by _target_ and its kwargs"
            )
        cls = check_component(cfg, key, runtime=0)
        if not callable(getattr(cls, "convert", None)):
            raise ComponentError(f"{key}._target_", f"{cfg.converters[name]._target_} has no convert(model): a "
                                 "converter changes the model in place in its convert(model)")  # fmt: skip


def hook_converters(converters: dict[str, Any], optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Each converter's `post_optimizer_hook(model)` after every optimizer step (on the laid-out model)."""
    for converter in converters.values():
        if callable(getattr(converter, "post_optimizer_hook", None)):
            optimizer.register_step_post_hook(lambda *_, c=converter: c.post_optimizer_hook(model))
