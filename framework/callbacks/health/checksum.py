"""callbacks.checksum: silent data corruption, caught by comparing replicas that must be identical.

Ranks that hold the same weights (DDP's replicas; the replicate axis of HSDP, each shard against
the same shard on the other replica groups; under tensor or pipeline parallelism, the replicas of
each slice) compare a checksum of their parameters every `every` steps, after the update: their
sum read as integers of their width, exact in int64 (a flipped bit changes it; a float sum could
round a low bit away). One small all-gather over the replica group on that step. A rank whose checksum
differs from the majority's is named; with two replicas there is no majority, and both are named.
Then `on_mismatch`: `stop` (the run fails with the names) or `rollback` (every rank reloads the
newest checkpoint from no later than the last check that agreed, which restores identical
weights, and goes on).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from framework.callbacks.health import is_run_checkpoint
from framework.config.errors import ConfigError
from framework.hooks import Run

ON_MISMATCH = ("stop", "rollback")


class SilentCorruption(RuntimeError):
    """Replicas that must hold identical weights do not."""


class Checksum:
    def __init__(self, every: int = 0, on_mismatch: str = "stop"):
        self.every, self.on_mismatch = every, on_mismatch
        self.active = every > 0  # 0: off (framework/callbacks/build.py builds none)
        self.checks = 0
        self.agreed = 0  # the last step whose check agreed
        self.saved: set[int] = set()  # the checkpoints of this run (steps), as every rank saw them saved
        self.mismatches: list[dict[str, Any]] = []

    @classmethod
    def check_config(cls, cfg: DictConfig, key: str, args: dict[str, Any]) -> None:
        every, on_mismatch = args.get("every", 0), args.get("on_mismatch", "stop")
        if not isinstance(every, int) or every < 0:
            raise ConfigError(f"{key}.every", f"got {every!r}; compare every N steps: an integer >= 1 (0: off)")
        if on_mismatch not in ON_MISMATCH:
            raise ConfigError(f"{key}.on_mismatch", f"got {on_mismatch!r}; one of {', '.join(ON_MISMATCH)}")
        if on_mismatch == "rollback" and not cfg.checkpoint.every:
            raise ConfigError(f"{key}.on_mismatch", "rollback reloads a checkpoint, and checkpoint.every=0 saves none")
        if every and (why := no_replicas(cfg.parallel)):
            raise ConfigError(f"{key}.every", f"{why}: there is nothing to compare. Checksums compare replicas: "
                              "parallel=ddp, or parallel=hybrid with parallel.dp_replicate >= 2")  # fmt: skip

    def on_build(self, run: Run) -> None:
        self.run = run
        mesh = run.mesh
        if mesh is None:  # ddp, dp, none: every rank a replica
            self.group, self.ranks = None, list(range(run.info.world_size))
        else:
            replicate = mesh.device_mesh["dp_replicate"]
            self.group, self.ranks = replicate.get_group(), dist.get_process_group_ranks(replicate.get_group())
        if len(self.ranks) < 2 and run.info.is_main:  # parallel=auto chose a layout without replicas
            print("warning: callbacks.checksum: this layout has no replicas (every rank holds its own shard or "
                  "stage): nothing is compared", flush=True)  # fmt: skip

    def on_step_end(self, step: int) -> None:
        if (step + 1) % self.every == 0:
            self.run.control.sync()  # compared at this step's settle, on every rank alike

    def on_settled(self, step: int, figures: dict[str, Any]) -> None:
        if (step + 1) % self.every or len(self.ranks) < 2:
            return
        sums = gather_sums(checksum(self.run.parts.par.module), self.group, len(self.ranks))
        self.checks += 1
        if len(set(sums)) == 1:
            self.agreed = step + 1
            return
        common, votes = Counter(sums).most_common(1)[0]
        bad = [r for r, s in zip(self.ranks, sums, strict=True) if s != common] if votes > len(sums) / 2 else self.ranks
        record = {"step": step + 1, "ranks": bad, "replicas": self.ranks, "action": self.on_mismatch}
        self.mismatches.append(record)
        who = f"rank(s) {', '.join(map(str, bad))}" + (" (no majority among two replicas)" if votes <= len(sums) / 2
                                                        else " against the others")  # fmt: skip
        line = f"silent data corruption after step {step + 1}: the weights of {who} differ among replicas {self.ranks}"
        if self.on_mismatch == "stop":
            raise SilentCorruption(f"{line} (callbacks.checksum.on_mismatch=stop)")
        if not any(done <= self.agreed for done in self.saved):  # the saves every rank saw: all decide alike
            raise SilentCorruption(f"{line}, and no checkpoint from the last check that agreed (step {self.agreed}) "
                                   "or before to roll back to")  # fmt: skip
        if self.run.info.is_main:
            print(f"warning: {line}; rolling back to the newest checkpoint at or before the last check that agreed "
                  f"(step {self.agreed})", flush=True)  # fmt: skip
        self.run.control.rollback(at_most=self.agreed)

    def on_save(self, step: int, path: str | None) -> None:
        if is_run_checkpoint(self.run.checkpoint_root, path):  # not a failed save, nor the best one
            self.saved.add(step)

    def rollback_reach(self) -> int | None:
        """The checkpoint a mismatch now would go back to (or, with none yet, the oldest it could)."""
        if self.on_mismatch != "rollback":
            return None
        return max((done for done in self.saved if done <= self.agreed), default=min(self.saved, default=self.agreed))

    def state_dict(self) -> dict[str, Any]:
        return {
            "checks": self.checks,
            "mismatches": self.mismatches,
            "agreed": self.agreed,
            "saved": sorted(self.saved),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        known = {m["step"] for m in self.mismatches}  # a rollback keeps what it came back from
        self.mismatches += [m for m in state["mismatches"] if m["step"] not in known]
        self.checks = max(self.checks, state["checks"])
        self.agreed = state.get("agreed", 0)  # as of that checkpoint: the later checks are abandoned
        self.saved |= set(state.get("saved", []))

    def on_end(self, summary: dict[str, Any]) -> None:
        summary["checksum"] = {"every": self.every, "checks": self.checks, "replicas": self.ranks,
                               "mismatches": self.mismatches}  # fmt: skip


def no_replicas(parallel: DictConfig) -> str | None:
    """Why a layout has no replicas to compare (None: it has)."""
    name = parallel.name
    if name in ("ddp", "dp", "auto") or parallel.get("dp_replicate", 1) >= 2:
        return None
    if name == "none":
        return "parallel=none is one process"
    if parallel.get("tp", 1) != 1 and name in ("tp", "hybrid"):
        return f"parallel={name} without dp_replicate >= 2: tensor parallel ranks hold different slices by design"
    return f"parallel={name} without dp_replicate >= 2: every rank holds its own shard or stage"


INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an element's bits as an integer


@torch.no_grad()
def checksum(module: torch.nn.Module) -> torch.Tensor:
    """The sum of this rank's parameters (local shards) read as integers of their width, in int64:
    exact (no rounding can hide a low bit), and moved by any flipped bit. One int64, on the device."""
    total = None
    for param in module.parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        part = local.detach().contiguous().view(INTS[local.element_size()]).sum(dtype=torch.int64)
        total = part if total is None else total + part
    return total if total is not None else torch.zeros((), dtype=torch.int64)


def gather_sums(value: torch.Tensor, group: Any, n: int) -> list[int]:
    """Every replica's checksum, in the group's rank order."""
    out = [torch.zeros_like(value) for _ in range(n)]
    dist.all_gather(out, value, group=group)
    return [int(t) for t in out]
