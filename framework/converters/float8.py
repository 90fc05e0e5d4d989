"""`converters=[float8]`: float8 training of a model's linears through torchao
(`convert_to_float8_training`), torchtitan's recipes and filter, as a model converter.

- Recipes (`converters.float8.recipe`): `tensorwise` (one dynamic scale per tensor, the default:
  its weights can be all-gathered in float8 under FSDP2), `rowwise` (a scale per row of each
  operand) and `rowwise_with_gw_hp` (rowwise, the weight gradient's matmul kept in high precision).
- Which linears: every `nn.Linear` but those `filter_fqns` names (a path's fnmatch pattern, or its
  last name; `head`, the default, is the output head: the plan's `output` entry, or the last
  linear of a model that declares none) and, with `auto_filter`, those whose dimensions are not
  multiples of 16 (the float8 matmul's alignment; torchtitan's auto-filter). What is left trains
  in the run's precision.
- Emulation (`emulate`: null decides): a CPU, or a GPU below compute capability 8.9, has no
  float8 matmul; torchao emulates it there (the same casts and scales, the matmul in high
  precision), and the run says so in one line. The numerics are float8's; the speed is not.
- Under FSDP2 (`fsdp_float8_all_gather`: null is on with `tensorwise` where parameters are
  sharded, as torchtitan's), the weights are all-gathered in float8 (half bf16's bytes) and their
  scales computed for every linear at once after each optimizer step (`post_optimizer_hook`).
- Under tensor parallel on CUDA, `tensorwise` linears take torchao's float8 styles (their
  collectives in float8): each converted linear says its own style (`tensor_parallel_style`,
  which framework/parallel/tensor.py asks every module for). The rowwise recipes, and gloo (which
  has no float8 type: "Invalid scalar type"), keep DTensor's own, with the same numerics.

Checkpoints hold the high-precision weights (a Float8Linear's state is a Linear's): a float8 run
resumes, reshards, loads into a bf16 run and exports to Hugging Face as ordinary weights. The
planner's price: framework/converters/float8_price.py.
"""

from __future__ import annotations

import dataclasses
import logging
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from framework.components import ComponentError
from framework.converters import float8_price

logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao 0.18's import warns on every rank
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
ALIGN = float8_price.ALIGN  # the float8 matmul's dimensions: multiples of 16
KEY = "converters.float8"
HEAD = "head"  # in filter_fqns: the model's output head (its plan's `output` entry, else its last linear)


class Float8:
    planner_price = staticmethod(float8_price.price)  # what it changes in the planner's forecast

    def __init__(self, recipe: str = "tensorwise", filter_fqns: tuple[str, ...] = (HEAD,), auto_filter: bool = True,
                 emulate: bool | None = None, fsdp_float8_all_gather: bool | None = None, *, run: Any = None):  # fmt: skip
        self.recipe, self.auto_filter = recipe, auto_filter
        self.skip_head = HEAD in filter_fqns
        self.filter_fqns = [f for f in filter_fqns if f != HEAD]
        self.spec = getattr(run, "model_spec", None)
        self.device = torch.device(getattr(run, "device", None) or "cpu")
        self.emulate = needs_emulation(self.device) if emulate is None else bool(emulate)
        sharded = run is not None and float8_price.shards_parameters(run.parallel)
        self.all_gather = (recipe == "tensorwise" and sharded) if fsdp_float8_all_gather is None else (
            bool(fsdp_float8_all_gather) and sharded)  # fmt: skip
        self.converted: list[str] = []
        self.sizes: dict[str, int] = {}  # path -> in x out, of each converted linear
        self.kept: dict[str, str] = {}  # path -> why it stays in high precision

    @classmethod
    def check(cls, cfg) -> None:
        """Refusals before any worker starts (framework/components.py asks)."""
        node = cfg.converters.float8
        if node.get("recipe", "tensorwise") not in RECIPES:
            raise ValueError(f"{KEY}.recipe: got {node.recipe!r}; torchao's recipes: {', '.join(RECIPES)}")
        try:
            import torchao.float8  # noqa: F401
        except ImportError:
            raise ValueError(f"{KEY}: needs torchao (pip install torchao; README's set-up installs it)") from None
        if node.get("fsdp_float8_all_gather") and node.get("recipe", "tensorwise") != "tensorwise":
            raise ValueError(f"{KEY}.fsdp_float8_all_gather: torchao gathers float8 weights with one scale per "
                             f"tensor: recipe=tensorwise only (got {node.recipe})")  # fmt: skip
        if cfg.get("compile") and (cfg.get("device") == "cpu" or not torch.cuda.is_available()):
            raise ValueError("compile: emulated float8 on a CPU is not compiled (torchao's float8 compiles for "
                             "CUDA's float8 kernels; eager emulation trains the same numerics): set compile=false")  # fmt: skip
        if cfg.get("peft") is not None and cfg.peft.get("name", "none") != "none":  # LoRALinear is no nn.Linear
            raise ValueError(f"{KEY}: with peft=lora, the adapted linears are LoRA's, not float8's; use one or the "
                             "other")  # fmt: skip

    def config(self):
        from torchao.float8 import Float8LinearConfig

        config = Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(config, emulate=self.emulate, enable_fsdp_float8_all_gather=self.all_gather)

    def convert(self, model: nn.Module) -> None:
        from torchao.float8 import convert_to_float8_training

        self.kept = self._kept(model)
        self.converted = [p for p, m in model.named_modules() if type(m) is nn.Linear and p not in self.kept]
        if not self.converted:
            raise ComponentError(KEY, f"no linear of {type(model).__name__} is eligible ({self._why_none()}); "
                             "float8 converts nn.Linear layers")  # fmt: skip
        chosen = set(self.converted)
        self.sizes = {p: model.get_submodule(p).in_features * model.get_submodule(p).out_features for p in chosen}
        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in chosen, config=self.config())
        if self.recipe == "tensorwise" and self.device.type == "cuda":  # gloo cannot move a float8 tensor
            for path in self.converted:
                model.get_submodule(path).tensor_parallel_style = float8_style

    def _kept(self, model: nn.Module) -> dict[str, str]:
        linears = [(p, m) for p, m in model.named_modules() if isinstance(m, nn.Linear)]
        for pattern in self.filter_fqns:
            if not any(_matches(p, pattern) for p, _ in linears):
                raise ComponentError(f"{KEY}.filter_fqns", f"{pattern!r} matches no linear of {type(model).__name__} "
                                     f"(its linears: {', '.join(p for p, _ in linears[:4])}, ...)")  # fmt: skip
        heads = head_paths(model, self.spec, [p for p, _ in linears]) if self.skip_head else set()
        kept = {}
        for path, module in linears:
            if type(module) is not nn.Linear:
                kept[path] = f"a {type(module).__name__}"
            elif path in heads:
                kept[path] = "the output head"
            elif any(_matches(path, f) for f in self.filter_fqns):
                kept[path] = "filter_fqns"
            elif self.auto_filter and (module.in_features % ALIGN or module.out_features % ALIGN):
                kept[path] = f"{module.in_features}x{module.out_features}: not multiples of {ALIGN}"
        return kept

    def _why_none(self) -> str:
        if not self.kept:
            return "it has none"
        return "kept: " + "; ".join(f"{p}, {why}" for p, why in list(self.kept.items())[:3])

    def post_optimizer_hook(self, model: nn.Module) -> None:
        """With float8 all-gather: every converted weight's scale, computed once for all after the
        step (one all-reduce of their amaxes), not per layer in the next forward."""
        if self.all_gather:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(model)

    def line(self) -> str:
        """The run's one line: what is in float8, how, and what is not."""
        how = "emulated: this device has no float8 matmul (the numerics are float8's, the speed is not)" if (
            self.emulate) else "torch._scaled_mm"  # fmt: skip
        gather = ", weights all-gathered in float8" if self.all_gather else ""
        left = f"; {len(self.kept)} kept in high precision ({self._why_kept()})" if self.kept else ""
        return f"float8: {self.recipe}, {len(self.converted)} linears{gather}{left}; {how}"

    def _why_kept(self) -> str:
        counts: dict[str, int] = {}
        for why in self.kept.values():
            kind = why.split(":")[-1].strip() if "multiples" in why else why
            counts[kind] = counts.get(kind, 0) + 1
        return ", ".join(f"{why}: {n}" if n > 1 else why for why, n in counts.items())

    def summary(self, flops_per_token: float | None = None) -> dict:
        """summary.json's `converters.float8`: the recipe, how it ran, and the share of the model's
        training FLOPs a token that run in float8 (6 x in x out per converted linear)."""
        share = 6 * sum(self.sizes.values()) / flops_per_token if flops_per_token else None
        return {"recipe": self.recipe, "linears": len(self.converted), "elements": sum(self.sizes.values()),
                "kept": dict(self.kept),
                "emulated": self.emulate, "fsdp_float8_all_gather": self.all_gather,
                "flops_share": round(share, 4) if share is not None else None,
                "mfu_peak": "bf16: MFU counts the float8 matmuls against the bf16 peak, as torchtitan's does"}  # fmt: skip


def _matches(path: str, pattern: str) -> bool:
    """torchtitan's filter: a path matching the pattern (fnmatch), or whose last name is it."""
    return fnmatchcase(path, pattern) or path.split(".")[-1] == pattern


def needs_emulation(device: torch.device) -> bool:
    """No float8 matmul here: a CPU, or a GPU below compute capability 8.9."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device) < (8, 9)


def head_paths(model: nn.Module, spec: Any, linears: list[str]) -> set[str]:
    """The output head: the plan's `output` entries, else the model's last linear."""
    plan = getattr(spec, "tp_plan", None) or {}
    heads = {p for p in linears if any(fnmatchcase(p, pat) for pat, s in plan.items() if s == "output")}
    return heads or set(linears[-1:])


def float8_style(style):
    """torchao's float8 counterpart of a DTensor column-/row-wise style (its layouts kept): the
    input cast to float8 before its collective. Other styles as they are."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    twin = {ColwiseParallel: Float8ColwiseParallel, RowwiseParallel: Float8RowwiseParallel}.get(type(style))
    if twin is None:
        return style
    out = twin.__new__(twin)
    out.__dict__.update(style.__dict__)
    return out
