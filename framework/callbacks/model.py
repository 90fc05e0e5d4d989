"""What the model adds to a step, through the contract's step protocol (framework/contract.py
`step_modules`): its counters ride the step's one all-reduce, each module gets its block's totals
back on the device (`after_step`), the figures it derives are logged, and its auxiliary loss's
gradient is scaled as the training loss is. The loop never asks which model it is."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from framework.contract import step_modules
from framework.dist import all_gather_object
from framework.hooks import Run
from framework.precision import loss_scale


class ModelSteps:
    """The step protocol's modules of this rank, grouped by kind (their class): each kind's
    counters are a table of a row per block (or per module, outside blocks) x its width."""

    def __init__(self) -> None:
        self.run: Run | None = None
        self.kinds: dict[str, list[tuple[int, Any]]] = {}  # kind -> (row, module)
        self.shapes: dict[str, dict[str, Any]] = {}  # kind -> rows and each counter's width
        self.counted = 1.0  # tensor-parallel peers compute the same counts: one of them adds them
        self.token_share = 1.0  # of the sequence's tokens, this rank's (sequence parallel: 1 / tp)

    def on_build(self, run: Run) -> None:
        self.run, parts = run, run.parts
        found: dict[str, list[tuple[int, Any]]] = defaultdict(list)
        for index, module in step_modules(parts.par.module, parts.spec):
            rows = found[type(module).__name__]
            rows.append((index if index is not None else len(rows), module))
        self.kinds = dict(found)
        local = {k: {"rows": parts.n_blocks or len(m), "widths": m[0][1].step_counts()} for k, m in found.items()}
        # every rank's table is the same shape, modules or not (a pipeline stage holds some blocks)
        for shapes in all_gather_object(local, run.info):
            self.shapes |= shapes
        for kind, shape in sorted(self.shapes.items()):
            for counter, width in shape["widths"].items():
                run.figures.declare({"name": f"{kind}/{counter}", "width": shape["rows"] * width, "log": False,
                                     "summary": ()}, "model", own=True)  # fmt: skip
        for spec in {f["name"]: f for m in found.values() for f in getattr(m[0][1], "figures", ())}.values():
            run.figures.declare(spec, "model", own=True)
        mesh = parts.par.mesh
        # under sequence parallel each tp rank routes its own part of the sequence
        # (framework/parallel/routed.py): every tp rank adds its counts, its aux loss weighs 1 / tp
        split = mesh is not None and mesh.dims.tp > 1 and bool(run.cfg.parallel.get("sequence_parallel", None))
        self.counted = float(mesh is None or mesh.tp_rank == 0 or split)
        self.token_share = 1.0 / mesh.dims.tp if split else 1.0

    def on_step_start(self, step: int) -> None:
        """The auxiliary losses' gradient factor: a micro-batch's share of the step (a pipeline
        averages its micro-batches itself) and amp's loss scale, as the training loss gets."""
        cfg, parts = self.run.cfg, self.run.parts
        share = 1.0 if parts.par.pipeline is not None else 1.0 / cfg.accumulation_steps
        scale = None
        for modules in self.kinds.values():
            for _, module in modules:
                if hasattr(module, "set_aux_scale"):
                    scale = scale if scale is not None else loss_scale(parts.precision.scaler, self.run.info.device)
                    module.set_aux_scale(scale * share * self.token_share)

    def on_step_end(self, step: int) -> dict[str, torch.Tensor]:
        """Every module's counts of the step, in its kind's tables (zeros where this rank holds
        no module of a block)."""
        out, device = {}, self.run.info.device
        for kind, shape in self.shapes.items():
            tables = {c: torch.zeros(shape["rows"], w, device=device) for c, w in shape["widths"].items()}
            for row, module in self.kinds.get(kind, []):
                for counter, value in module.read_counts().items():
                    tables[counter][row] += value.to(device).reshape(-1)
            out |= {f"{kind}/{c}": t.flatten() * self.counted for c, t in tables.items()}
        return out

    def on_step_reduced(self, step: int, totals: dict[str, torch.Tensor]) -> None:
        for kind, shape in self.shapes.items():
            tables = {c: totals[f"{kind}/{c}"].view(shape["rows"], w) for c, w in shape["widths"].items()}
            for row, module in self.kinds.get(kind, []):
                module.after_step({c: t[row] for c, t in tables.items()})

    def on_settled(self, step: int, figures: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for kind, modules in self.kinds.items():
            shape = self.shapes[kind]
            blocks = {c: _rows(figures[f"{kind}/{c}"], w) for c, w in shape["widths"].items()}
            out |= modules[0][1].derive(blocks)
        return out


def _rows(values: list[float] | float, width: int) -> list[list[float]]:
    values = values if isinstance(values, list) else [values]
    return [values[k : k + width] for k in range(0, len(values), width)]
