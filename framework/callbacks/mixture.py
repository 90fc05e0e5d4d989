"""A weighted mixture's sources (data.sources, framework/data/mixture.py): the samples and tokens
each source gave a step, over every rank (riding the step's all-reduce), in metrics.jsonl as
`sources: {label: {samples, tokens}}`, and over the run in summary.json's `sources` block with
each source's share of the samples beside its weight's."""

from __future__ import annotations

from typing import Any

import torch

from framework.hooks import Run

COUNTS = "sources/counts"


class MixtureSources:
    def __init__(self) -> None:
        self.run: Run | None = None
        self.labels: list[str] = []
        self.weights: list[float] = []
        self.totals: list[float] = []

    def on_build(self, run: Run) -> None:
        self.run, dataset = run, run.parts.data.dataset
        self.labels, self.weights = list(dataset.labels), list(dataset.weights)
        self.totals = [0.0] * 2 * len(self.labels)
        run.figures.declare(
            {"name": COUNTS, "width": 2 * len(self.labels), "log": False, "summary": ()}, "mixture", own=True
        )
        run.figures.declare({"name": "sources", "reduce": None, "summary": ()}, "mixture", own=True)

    def on_step_end(self, step: int) -> dict[str, torch.Tensor]:
        """Samples of each source, then tokens of each, in this rank's batches of the step (one
        rank per data-parallel group counts: its tp, pp and cp peers read the same batches)."""
        parts = self.run.parts
        counts = parts.data.take_source_counts(self.run.cfg.accumulation_steps)
        if counts is None:
            counts = torch.zeros(2 * len(self.labels))
        return {COUNTS: counts.float() * float(parts.par.counts_data)}

    def on_settled(self, step: int, figures: dict[str, Any]) -> dict[str, Any]:
        counts, n = figures[COUNTS], len(self.labels)
        self.totals = [t + c for t, c in zip(self.totals, counts, strict=True)]
        return {"sources": {label: {"samples": round(counts[k]), "tokens": round(counts[n + k])}
                            for k, label in enumerate(self.labels)}}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"totals": self.totals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.totals = list(state.get("totals", self.totals))

    def on_end(self, summary: dict[str, Any]) -> None:
        """summary.json `sources`: each source's samples and tokens over the run, its share of the
        samples and its weight's share."""
        n, samples = len(self.labels), sum(self.totals[: len(self.labels)]) or 1
        summary["sources"] = {
            label: {"samples": round(self.totals[k]), "tokens": round(self.totals[n + k]),
                    "share": self.totals[k] / samples, "weight": self.weights[k] / sum(self.weights)}
            for k, label in enumerate(self.labels)
        }  # fmt: skip
