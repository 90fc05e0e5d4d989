"""One registry of step figures: a figure is declared once, with how ranks combine it and where it
goes, and every writer (metrics.jsonl, W&B, TensorBoard, summary.json, the sweep report) iterates
the registry. No run file gains a field for a feature.

A figure is one of two kinds:
- *reduced* (`reduce` set): its owner hands a value each step (a device tensor, or a float); the
  values of every figure ride the step's one all-reduce, packed into one vector (`Registry.pack`).
  `sum` and `mean` take one slot per value; `max` and `min` take a row per rank (the all-reduce
  sums rows that only their rank fills), so one collective serves all four;
- *derived* (`reduce=None`): its owner computes it on the host from the step's reduced figures
  (`on_settled` of framework/callbacks), e.g. the experts' load imbalance from their token counts.

`log`: a metrics.jsonl field (and W&B/TensorBoard) each logged step. `summary`: how the run's
steps combine into summary.json (`mean`, `sum`, `first`, `last`, `max`, `min`; a vector sums
elementwise), under `group` (a block of its own, e.g. `moe`) as `key` (default: the name); the
first statistic is `key`, the others `key_<stat>`. `report`: a column title of the sweep report.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from framework.dist import host_values

REDUCES = ("sum", "max", "min", "mean")
STATS = ("mean", "sum", "first", "last", "max", "min")
# the loop's own fields of a step (metrics.jsonl, on_settled's figures) and the prefixes of the
# framework's own figures: a user's figure takes another name (it would overwrite one of them)
RESERVED = ("step", "loss", "lr", "grad_norm", "step_time_s", "samples_per_s", "tokens_per_s", "mfu", "epoch",
            "loss_scale", "skipped", "comm_calls", "comm_bytes", "tokens", "samples", "applied")  # fmt: skip
RESERVED_PREFIXES = ("control/", "val_", "eval_", "moe_", "sources")


class FigureError(ValueError):
    """A figure declared wrongly: one line naming it and what is allowed."""


@dataclass(frozen=True)
class Figure:
    name: str
    reduce: str | None = "sum"  # over ranks: sum | max | min | mean; None: derived on the host
    width: int = 1  # values a step (a vector: a list in metrics.jsonl)
    log: bool = True  # a metrics.jsonl / W&B field each logged step
    summary: tuple[str, ...] = ("mean",)  # over the run's steps, into summary.json ( (): none )
    group: str | None = None  # summary.json block (None: summary["figures"])
    key: str | None = None  # its name in that block (None: `name`)
    report: str | None = None  # a sweep-report column title
    better: str | None = "min"  # the report's ranking: min | max | None

    def check(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise FigureError(f"figure name {self.name!r}: a non-empty string")
        if self.reduce is not None and self.reduce not in REDUCES:
            raise FigureError(
                f"figure {self.name!r}: reduce={self.reduce!r}; allowed: {', '.join(REDUCES)} (or None: derived)"
            )
        if unknown := [s for s in self.summary if s not in STATS]:
            raise FigureError(f"figure {self.name!r}: summary {unknown[0]!r}; allowed: {', '.join(STATS)}")
        if not isinstance(self.width, int) or self.width < 1:
            raise FigureError(f"figure {self.name!r}: width={self.width!r}; a positive integer")

    @classmethod
    def of(cls, spec: Figure | Mapping[str, Any]) -> Figure:
        """A Figure from itself or from plain data (a model declares its figures as dicts)."""
        if isinstance(spec, Figure):
            return spec
        try:
            figure = cls(**{k: tuple(v) if k == "summary" else v for k, v in dict(spec).items()})
        except TypeError as err:
            raise FigureError(f"figure {dict(spec).get('name')!r}: {err}") from None
        return figure  # checked where it is declared (Registry.declare)


@dataclass
class Registry:
    """The run's figures by name, in declaration order, and who declared each."""

    world: int = 1
    figures: dict[str, Figure] = field(default_factory=dict)
    owners: dict[str, str] = field(default_factory=dict)
    _reduced: list[Figure] = field(default_factory=list, repr=False)

    def declare(self, spec: Figure | Mapping[str, Any], owner: str, own: bool = False) -> Figure:
        """Register a figure of `owner` (`own`: the framework's, which may take the reserved names)."""
        figure = Figure.of(spec)
        figure.check()
        if not own and (figure.name in RESERVED or figure.name.startswith(RESERVED_PREFIXES)):
            raise FigureError(
                f"figure {figure.name!r}: a name of the framework's own ({', '.join(RESERVED)}, or starting "
                f"{', '.join(RESERVED_PREFIXES)}); name yours otherwise, e.g. 'user/...'"
            )
        if figure.name in self.figures:
            raise FigureError(
                f"figure {figure.name!r} declared twice: by {self.owners[figure.name]} and by {owner}; "
                "a figure is declared once"
            )
        self.figures[figure.name] = figure
        self.owners[figure.name] = owner
        if figure.reduce is not None:
            self._reduced.append(figure)
        return figure

    @property
    def reduced(self) -> list[Figure]:
        """The figures the all-reduce carries, in declaration order (kept: read on every step)."""
        return self._reduced

    def slots(self, figure: Figure) -> int:
        return figure.width * (self.world if figure.reduce in ("max", "min") else 1)

    def pack(self, values: Mapping[str, Any], rank: int, device: torch.device) -> torch.Tensor:
        """This rank's reduced figures as one vector for the step's all-reduce (sum). A figure
        with no value this step adds nothing (zeros; for max/min: its row holds -inf/+inf).
        Values given on the host (numbers, CPU tensors) go over in one pinned, non-blocking copy:
        a plain copy to the GPU would wait for it (a host sync every step)."""
        host: list[float] = []
        pieces: list[tuple[int, int] | torch.Tensor] = []  # (start, n) in `host`, or a device tensor
        for f in self.reduced:
            value = values.get(f.name)
            empty = {"max": -math.inf, "min": math.inf}.get(f.reduce, 0.0)
            if isinstance(value, torch.Tensor) and (value.device.type != "cpu" or device.type == "cpu"):
                chunk = _checked(value.detach().float().reshape(-1), f)
                if f.reduce in ("max", "min"):  # a row of its own, the others zero
                    rows = torch.zeros(self.world, f.width, device=chunk.device)
                    rows[rank] = chunk
                    chunk = rows
                pieces.append(chunk.reshape(-1))
                continue
            row = _floats(value, f, empty)
            if f.reduce in ("max", "min"):
                row = [0.0] * (rank * f.width) + row + [0.0] * ((self.world - rank - 1) * f.width)
            pieces.append((len(host), len(row)))
            host += row
        sent = host_values(host, device) if host else None
        out = [sent[p[0] : p[0] + p[1]] if isinstance(p, tuple) else p.to(device) for p in pieces]
        return torch.cat(out) if out else torch.zeros(0, device=device)

    def totals(self, reduced: torch.Tensor) -> dict[str, torch.Tensor]:
        """The reduced figures from the summed vector, still on the device (for post-step updates)."""
        out, at = {}, 0
        for f in self.reduced:
            n = self.slots(f)
            chunk = reduced[at : at + n]
            at += n
            if f.reduce == "mean":
                chunk = chunk / self.world
            elif f.reduce in ("max", "min"):
                rows = chunk.view(self.world, f.width)
                chunk = rows.amax(0) if f.reduce == "max" else rows.amin(0)
            out[f.name] = chunk
        return out

    def read(self, row: list[float]) -> dict[str, float | list[float]]:
        """The reduced figures from the summed vector the ledger's sync read (plain Python: the
        host has its values already)."""
        out, at = {}, 0
        for f in self.reduced:
            n = self.slots(f)
            chunk, at = row[at : at + n], at + n
            if f.reduce == "mean":
                chunk = [v / self.world for v in chunk]
            elif f.reduce in ("max", "min"):
                pick = max if f.reduce == "max" else min
                chunk = [pick(chunk[r * f.width + k] for r in range(self.world)) for k in range(f.width)]
            out[f.name] = chunk if f.width > 1 else chunk[0]
        return out

    @property
    def width(self) -> int:
        return sum(self.slots(f) for f in self.reduced)

    def logged(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The metrics.jsonl fields of a step's figures (declared order; a missing one left out)."""
        return {n: values[n] for n, f in self.figures.items() if f.log and values.get(n) is not None}

    def summarize(self, steps: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        """summary.json's blocks of the run's figures: {group or "figures": {key[_stat]: value}}."""
        steps = list(steps)
        out: dict[str, dict[str, Any]] = {}
        for name, f in self.figures.items():
            series = [s[name] for s in steps if s.get(name) is not None]
            if not series or not f.summary:
                continue
            block = out.setdefault(f.group or "figures", {})
            for k, stat in enumerate(f.summary):
                block[f.key or name if k == 0 else f"{f.key or name}_{stat}"] = combine(series, stat)
        return out

    def columns(self) -> list[tuple[str, str, str, str | None]]:
        """The sweep report's columns of declared figures: (title, group, key, better)."""
        return [(f.report, f.group or "figures", f.key or f.name, f.better) for f in self.figures.values() if f.report]


def combine(series: list[Any], stat: str) -> Any:
    """One statistic of a figure over the run's steps; a vector's elementwise."""
    if isinstance(series[0], list):
        return [combine(list(column), stat) for column in zip(*series, strict=True)]
    if stat == "first":
        return series[0]
    if stat == "last":
        return series[-1]
    if stat == "max":
        return max(series)
    if stat == "min":
        return min(series)
    total = sum(series)
    return total if stat == "sum" else total / len(series)


def _floats(value: Any, f: Figure, empty: float) -> list[float]:
    """A host value as the figure's floats (None: `empty` in every place)."""
    if value is None:
        return [empty] * f.width
    floats = value.detach().reshape(-1).tolist() if isinstance(value, torch.Tensor) else value
    floats = [float(v) for v in floats] if isinstance(floats, list | tuple) else [float(floats)]
    if len(floats) != f.width:
        raise FigureError(f"figure {f.name!r}: {len(floats)} values this step; it was declared width={f.width}")
    return floats


def _checked(t: torch.Tensor, f: Figure) -> torch.Tensor:
    if t.numel() != f.width:
        raise FigureError(f"figure {f.name!r}: {t.numel()} values this step; it was declared width={f.width}")
    return t
