"""float8's price for the planner (`Float8.planner_price`; framework/plan/convert.py asks for it):
what converting a model's linears to torchao's Float8Linear changes in the forecast.

- **Matmuls.** Each converted linear's three matmuls (forward, the input's gradient, the weight's)
  run in "fp8": on a part with FP8 units at its FP8 rate (an H100: twice bf16's,
  framework/plan/gpu.py), elsewhere emulated at the compute dtype's rate (a CPU, an A100, or
  `emulate=true`: the high-precision matmul plus the casts, slower than bf16, never faster).
  `rowwise_with_gw_hp` keeps the weight's gradient in high precision. The linears the filter
  leaves (the output head, `filter_fqns`, dimensions not multiples of 16) are priced as before.
- **Casts and amax reductions**, memory-bound passes at HBM's rate, as torch.compile fuses them
  (torchtitan's float8 runs compiled): each operand cast from high precision is one pass reading
  it for its amax and one reading it and writing float8, 2 + 2 + 1 = 5 bytes a 16-bit element
  (9 from an fp32 weight under autocast). Forward: the input and the weight. Backward (torchao
  saves the high-precision input and weight and casts again): the output's gradient in both
  layouts (tensorwise: one amax, 5 + 3; rowwise: an amax per axis, 10), the weight again and the
  input again (`rowwise_with_gw_hp`: neither for the weight's gradient, which runs in bf16).
  Under float8 all-gather the weight is cast on its shard before the gather (1/shard of it, left
  out) and arrives in float8: no weight cast in the step.
- **FSDP2's all-gather** of a converted weight, with float8 all-gather (`fsdp_float8_all_gather`,
  on under FSDP2 with tensorwise): one byte an element, half of bf16's. The scales' one all-reduce
  a step (precompute_float8_dynamic_scale_for_fsdp) is a few bytes and is left out.
- **Memory.** torchao's Float8Linear saves the same high-precision input as nn.Linear: the saved
  activations are unchanged; FSDP's gathered unit holds float8 weights (the gather's bytes).
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from torch import nn

AMAX, CAST = 2, 3  # bytes a 16-bit element: the amax pass reads it; the cast reads it and writes float8
HP_CAST = AMAX + CAST  # one operand cast from 16-bit
FP32_CAST = 4 + 4 + 1  # one fp32 weight cast (autocast's master weights, no FSDP)
ALIGN = 16  # the float8 matmul's dimensions: multiples of 16 (float8.py's filter)


def price(kwargs: dict, model: nn.Module, spec: Any, parallel: Any) -> dict:
    """The planner's price of `model` as `converters.float8` (`kwargs`) converted it, under the
    layout's `parallel` config (framework/plan/convert.py's keys). It reads the converted model,
    never framework/converters/float8.py (which names this module): torchao's Float8Linear by
    name (its import registers with torch's pytree, a warning a rank)."""
    recipe = kwargs.get("recipe", "tensorwise")
    sharded = parallel is not None and shards_parameters(parallel)
    wanted = kwargs.get("fsdp_float8_all_gather")  # null: on with tensorwise where FSDP2 shards (float8.py's rule)
    all_gather = sharded and (recipe == "tensorwise" if wanted is None else bool(wanted))
    converted = [p for p, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
    filters = kwargs.get("filter_fqns") or []
    kept = {}
    for path, m in model.named_modules():
        if type(m) is nn.Linear:
            unaligned = m.in_features % ALIGN or m.out_features % ALIGN
            named = any(fnmatchcase(path, f) or path.split(".")[-1] == f for f in filters)
            kept[path] = "filter_fqns" if named else (f"not multiples of {ALIGN}" if unaligned else "the output head")
    fmt = None if kwargs.get("emulate") else "fp8"  # emulate=true: the high-precision matmul, on any part
    formats = (fmt, fmt, None if recipe == "rowwise_with_gw_hp" else fmt)
    weight = 0 if all_gather else (HP_CAST if sharded else FP32_CAST)
    entry = {"formats": formats, "casts": casts(recipe, weight)}
    gathered = {f"{p}.weight": 1 for p in converted} if all_gather else {}
    gather = "; weights all-gathered in float8 (1 byte an element)" if gathered else ""
    return {
        "modules": dict.fromkeys(converted, entry),
        "gather_bytes": gathered,
        "kept": kept,
        "line": f"float8 ({recipe}): {len(converted)} linears' matmuls in fp8, {len(kept)} in high precision{gather}",
    }


def shards_parameters(parallel: Any) -> bool:
    """FSDP2 shards this layout's parameters over dp_shard (fsdp, or hybrid with dp_shard > 1): the
    float8 converter's rule for its all-gather (torchtitan's `dp_shard_enabled`)."""
    if parallel.get("version", 2) != 2:
        return False
    name = parallel.get("name")
    return name == "fsdp" or (name == "hybrid" and (parallel.get("dp_shard") or 1) > 1)


def casts(recipe: str, weight: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(forward, backward) bytes of a converted linear's casts per element of its input, its
    weight and its output (framework/plan/convert.py's `casts`)."""
    forward = (HP_CAST, weight, 0)
    if recipe == "tensorwise":  # the output's gradient cast in both layouts from one amax
        return forward, (HP_CAST, weight, HP_CAST + CAST)
    if recipe == "rowwise":  # an amax along each axis: every operand cast again along the other
        return forward, (HP_CAST, weight, 2 * HP_CAST)
    return forward, (0, weight, HP_CAST)  # rowwise_with_gw_hp: the weight's gradient in high precision
