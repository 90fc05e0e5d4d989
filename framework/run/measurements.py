"""What measures a run beyond each step's own figures, held together: the bytes saved for backward
(activation meter), the forward time (forward timer), what is live at the peak (peak probe), the
collectives (a counter, on sampled steps). The torch profiler is a callback (framework/callbacks/profiler.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from framework.measure.comm import CommCounter
from framework.measure.memory import SavedActivationMeter
from framework.measure.metrics import ForwardTimer
from framework.measure.peak import PeakProbe


@dataclass
class Measurements:
    meter: SavedActivationMeter  # peak bytes saved for backward (sampled steps)
    probe: PeakProbe  # what is live at the highest memory reading (sampled steps)
    # this rank's forward time per step: compute with no gradient communication in it (DDP and
    # FSDP backward passes end waiting for the slowest rank, so they cannot show imbalance)
    forward_timer: ForwardTimer
    peak_flops: float | None  # the devices' peak FLOP/s, for MFU (None: unknown)

    @contextmanager
    def sampled_step(self, sampled: bool) -> Iterator[CommCounter | None]:
        """On a sampled step, count every collective (forward, backward, clipping, update) and
        watch the memory peak: both slow the step, so other steps run bare (None)."""
        if not sampled:
            yield None
            return
        counter = CommCounter()
        with counter, self.probe.watch(counter.in_flight):
            yield counter
