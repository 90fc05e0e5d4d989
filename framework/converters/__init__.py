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
  (registered as the optimizer's step post hook: the loop names no converter).
"""

from __future__ import annotations

import random
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from framework.components import ComponentError, build_component, check_component
from framework.contract import ModelSpec, build_model
from framework.peft import apply_peft, describe, enabled


def converted_model(meta: nn.Module, spec: ModelSpec, cfg: DictConfig, info: Any) -> tuple[nn.Module, list]:
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
    return model, convert_model(model, cfg, spec, verbose=info.is_main)


def on_meta(spec: ModelSpec, cfg: DictConfig) -> bool:
    """The model stays on the meta device until the strategy allocates this rank's part."""
    return spec.on_meta or cfg.model.get("pretrained") is not None


def convert_model(model: nn.Module, cfg: DictConfig, spec: ModelSpec, verbose: bool = False) -> list[Any]:
    """Apply every converter the config asks for to `model`, in place, in order; the converter
    objects (their post-optimizer hooks). `verbose`: print what LoRA adapted (rank 0's line)."""
    apply_peft(model, cfg.get("peft"), spec.blocks, cfg.seed)
    if verbose and enabled(cfg.get("peft")):
        print(describe(model, cfg.peft), flush=True)
    converters = []
    for node in (cfg.get("converters") or {}).values():
        converter = build_component(node, ())
        converter.convert(model)
        converters.append(converter)
    return converters


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


def hook_converters(converters: list[Any], optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Each converter's `post_optimizer_hook(model)` after every optimizer step (on the laid-out model)."""
    for converter in converters:
        if callable(getattr(converter, "post_optimizer_hook", None)):
            optimizer.register_step_post_hook(lambda *_, c=converter: c.post_optimizer_hook(model))
