"""What a model converter costs the planner: each entry of `converters` is asked, by its class, for
its price (framework/components.py's `planner_price`); the planner names no converter.

A converter's class may declare `planner_price(kwargs, model, spec, parallel) -> dict`, called
with its config's kwargs, the model as the run converts it (built on the meta device, its
converters applied), the model's contract and the layout's `parallel` config. The dict says,
each key optional:

- `modules`: {module path: {"formats": (forward, input_grad, weight_grad), "casts": (forward,
  backward)}}: the modules whose work the converter prices. Each matmul they run is priced in the
  format named for each of a linear layer's three matmuls (None: the compute dtype's; "fp8": at
  the kernels' rate for it, `format_share`, where the part has one, else emulated at the compute
  dtype's). Their other operators are replaced by their `casts`: bytes per element of the matmul's
  input (M x K), weight (K x N) and output (M x N), in forward and in backward, memory-bound
  passes priced at the memory rate (framework.plan.ops records them, framework.plan.timing prices them);
- `gather_bytes`: {parameter name: bytes per element FSDP all-gathers it in} (default: the mixed
  precision's);
- `kept`: {module path: why it is left as it was}, and `line`: one line the forecast may print.

A converter without `planner_price` is planned as if it changed nothing but the model the planner
sees (what trains, its shapes), and `unpriced` says so for the forecast to print.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from framework.components import kwargs_of, locate

_PRICES: dict[tuple, tuple[Any, list[dict]]] = {}  # the model held: its id is the key's


def converter_prices(cfg: DictConfig, model, spec) -> list[dict]:
    """Each priced converter's price of `model` under `cfg`'s layout, in the listed order (once
    per model, converters and layout: a search asks for it hundreds of times)."""
    entries = cfg.get("converters") or {}
    if not entries:
        return []
    key = (id(model), OmegaConf.to_yaml(entries), OmegaConf.to_yaml(cfg.parallel))
    if key not in _PRICES:
        if len(_PRICES) > 64:
            _PRICES.clear()
        prices = []
        for name, node in entries.items():
            price = getattr(locate(node, f"converters.{name}"), "planner_price", None)
            if price is not None:
                prices.append(price(kwargs_of(node), model, spec, cfg.parallel) or {})
        _PRICES[key] = model, prices
    return _PRICES[key][1]


def owned_modules(prices: list[dict]) -> dict[str, dict]:
    """module path -> its converter's price of it (a later converter's over an earlier one's)."""
    return {path: entry for price in prices for path, entry in (price.get("modules") or {}).items()}


def gather_bytes(prices: list[dict]) -> dict[str, float]:
    """parameter name -> bytes per element FSDP all-gathers it in, where a converter says."""
    return {name: size for price in prices for name, size in (price.get("gather_bytes") or {}).items()}


def unpriced(cfg: DictConfig) -> dict[str, str]:
    """`converters.<entry>` -> the forecast's line, for each converter that declares no price."""
    out = {}
    for name, node in (cfg.get("converters") or {}).items():
        cls = locate(node, f"converters.{name}")
        if getattr(cls, "planner_price", None) is None:
            label = f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else str(cls)
            out[f"converters.{name}"] = (f"{label} declares no planner_price; planned as if it cost nothing beyond "
                                         "the model it leaves (framework/plan/convert.py says how to declare one)")  # fmt: skip
    return out
