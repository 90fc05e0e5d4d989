"""A rank's pipeline schedule: torch.distributed.pipelining's stages over this rank's stage modules
(framework/parallel/pipeline.py splits them) and the schedule that runs them, built once and built
again over the same modules when a step's batch or sequence length changes (Pipeline.fit): torch
sizes a stage's buffers for the micro-batch shape of its first step.

The number of micro-batches stays the configured one; a larger batch makes larger micro-batches.
The loss stays exact: each micro-batch's summed loss is weighted by n_microbatches x dp x cp over
the step's own loss terms, counted every step (framework/run/step.py, framework/loss.py).
"""

from __future__ import annotations

import functools

from omegaconf import DictConfig
from torch import nn

from framework.contract import forget_counts
from framework.loss import ScaledLoss
from framework.parallel.pipeline import MULTI_STAGE, SINGLE_STAGE, Pipeline


def build_pipeline(
    stage_modules: list[nn.Module], ids: list[int], n_stages: int, cfg: DictConfig, pp_group, device
) -> Pipeline:
    """The schedule of this rank's stages (`ids` of `n_stages`; `cfg`: the parallel group), and how
    to build it again."""
    loss = ScaledLoss()
    build = functools.partial(build_schedule, stage_modules, ids, n_stages, cfg, (pp_group, device), loss)
    modules = dict(zip(ids, stage_modules, strict=True))
    n_microbatches = cfg.get("n_microbatches", 4)
    return Pipeline(build(), 0 in ids, n_stages - 1 in ids, n_microbatches, modules, loss, rebuild=build)


def build_schedule(stage_modules: list[nn.Module], ids: list[int], n_stages: int, cfg: DictConfig, where: tuple,
                   loss: ScaledLoss) -> object:  # fmt: skip
    """torch's stages over `stage_modules` (`where`: the pipeline's process group and this rank's
    device) and the schedule `cfg` names over them, whose loss is `loss`."""
    import torch.distributed.pipelining as pipelining

    pp_group, device = where
    stages = [
        pipelining.PipelineStage(m, s, n_stages, device, group=pp_group)
        for m, s in zip(stage_modules, ids, strict=True)
    ]
    for stage in stages:
        forget_inference_counts(stage)
    name, n_microbatches = cfg.get("schedule", "1F1B"), cfg.get("n_microbatches", 4)
    if name in SINGLE_STAGE:
        return getattr(pipelining, SINGLE_STAGE[name])(stages[0], n_microbatches, loss_fn=loss)
    return getattr(pipelining, MULTI_STAGE[name])(stages, n_microbatches, loss_fn=loss)


def forget_inference_counts(stage) -> None:
    """torch's pipelining infers a stage's shapes from a real forward and backward in its first
    step, and restores the stage's buffers after it; a module that counts its steps (the
    contract's step protocol) would count that forward as the step's own: its counts are dropped
    once the inference is done."""
    cleanup = getattr(stage, "_post_metadata_inference_cleanup", None)
    if cleanup is None:  # a torch whose inference runs no forward
        return

    def cleared() -> None:
        cleanup()
        forget_counts(stage.submod)

    stage._post_metadata_inference_cleanup = cleared
