"""What keeps a run safe on a cluster: preemption, hung or failed peers, non-finite losses.

- **Preemption.** SIGTERM (a scheduler's notice, or `kill`) or SIGINT (Ctrl-C) only sets a flag.
  The flag rides on the step's one small all-reduce, so every rank sees it after the same step;
  they save a checkpoint and exit with code 128 + the signal (143 for SIGTERM, 130 for SIGINT).
  If the step and save do not finish within `checkpoint.preempt_grace_s` (a peer is stuck), the
  process exits anyway, with that code.
- **Failed or hung peers.** A rank whose collective times out names the collective (from the
  process group's flight recorder) and the ranks that never joined it (those that did not report
  a timeout of their own through the store). Any rank that fails marks the run aborted in the
  store; a watchdog thread on every rank polls that mark, so a rank stuck outside a collective
  exits too, instead of waiting for its launcher to kill it.
- **Fault injection for tests.** `HYDRADIST_FAULT="RANK:STEP[:KIND]"`, on the first attempt only:
  kind `exit` (default; dies abruptly), `hang` (stops participating), `nan` (its loss becomes
  NaN), `spike` (its loss 100x), `slow` (50 ms more each step from STEP on), `bitflip` (one bit
  of one of its parameters), `damage` (its weights x16 in that step's update, after its loss: the
  checkpoint saved after it holds the damage; RANK `*` damages every replica alike),
  `sigterm`/`sigint` (sends the signal to the process that launched it, as a scheduler or Ctrl-C
  would; with no launcher, to itself).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from framework.dist import DistInfo, restart_count
from framework.machine import launcher_pid

SIGNALS = (signal.SIGTERM, signal.SIGINT)
ABORT_KEY = "hydradist/abort"
STUCK_KEY = "hydradist/stuck/"


def exit_code(signum: int) -> int:
    """The exit code of a preempted run: 128 + the signal (143: SIGTERM, 130: SIGINT)."""
    return 128 + signum


class Preempted(Exception):
    """The run stopped on a signal after `step`, with a checkpoint at `path`."""

    def __init__(self, signum: int, step: int, path: str):
        self.signum, self.step, self.path = signum, step, path
        super().__init__(f"preempted by {signal.Signals(signum).name} after step {step}; checkpoint: {path}")


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost a peer; the message names it and the ranks missing."""


class Aborted(RuntimeError):
    """Another rank failed (its error is the run's); this rank stops."""


class Guard:
    """One run's signal handlers and watchdog (a context manager around a rank's training)."""

    def __init__(self, info: DistInfo, grace_s: float, poll_s: float = 0.5):
        self.info, self.grace_s, self.poll_s = info, grace_s, poll_s
        self.signum: int | None = None
        self.abort_reason: str | None = None
        self._signalled_at = 0.0
        self._stop = threading.Event()
        self._previous: dict[int, object] = {}
        self._thread: threading.Thread | None = None
        self.store = dist.distributed_c10d._get_default_store() if info.distributed else None

    def __enter__(self) -> Guard:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        self._thread = threading.Thread(target=self._watch, name="hydradist-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame) -> None:
        if self.abort_reason is not None:  # sent by the watchdog: another rank failed
            raise Aborted(self.abort_reason)
        if self.signum is None:  # repeats (Ctrl-C reaches a worker from the terminal and the launcher) change nothing
            self.signum, self._signalled_at = signum, time.monotonic()

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.signum is not None and time.monotonic() - self._signalled_at > self.grace_s:
                self._exit(f"no step ended within checkpoint.preempt_grace_s={self.grace_s:g} s of the signal; exiting without a checkpoint", exit_code(self.signum))  # fmt: skip
            reason = self._aborted()
            if reason is not None and self.abort_reason is None:
                # stop the main thread where it is (a Python loop, a sleep, a data wait): it unwinds
                # and exits cleanly; stuck inside a native call, it is ended below instead
                print(f"rank {self.info.rank}: stopping: {reason}", file=sys.stderr, flush=True)
                self.abort_reason, aborted_at = reason, time.monotonic()
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
            if self.abort_reason is not None and time.monotonic() - aborted_at > 5:
                self._exit("did not stop within 5 s; exiting", 1)

    def _aborted(self) -> str | None:
        if self.store is None:
            return None
        try:
            if self.store.check([ABORT_KEY]):
                return self.store.get(ABORT_KEY).decode()
        except Exception:
            # the store is gone: its host (the launcher, or rank 0 under srun) has exited, which
            # a finished rank 0 may do first; stop watching rather than call it a failure
            self.store = None
        return None

    def _exit(self, message: str, code: int) -> None:
        print(f"rank {self.info.rank}: {message}", file=sys.stderr, flush=True)
        os._exit(code)

    def abort(self, reason: str) -> None:
        """Mark the run failed for every rank's watchdog (called by a rank that fails)."""
        if self.store is not None:
            try:
                if not self.store.check([ABORT_KEY]):
                    self.store.set(ABORT_KEY, f"rank {self.info.rank} failed: {reason}")
            except Exception:
                pass

    def shorten_timeout(self, seconds: float | None) -> None:
        """backend.step_timeout_s: after the first step (set-up, compilation and the first
        collectives done), every process group's collectives time out sooner."""
        if seconds and self.info.distributed:
            for group in list(dist.distributed_c10d._world.pg_map):
                dist.set_timeout(timedelta(seconds=seconds), group)


# ----------------------------------------------------------------------------- collective failures

COLLECTIVE_ERRORS = ("Timed out", "timed out", "Connection closed", "Connection reset", "Broken pipe")


def is_collective_failure(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and any(s in str(err) for s in COLLECTIVE_ERRORS)


def last_collective(backend: str | None = None) -> dict | None:
    """The newest entry of this process's flight recorder (backend.trace_buffer > 0): NCCL's own
    dump under NCCL, the generic (gloo/CPU) one otherwise."""
    c10d = torch._C._distributed_c10d
    try:
        dump = c10d._dump_nccl_trace_json if "nccl" in (backend or "") else c10d._dump_fr_trace_json
        trace = json.loads(dump(True, True))
    except Exception:
        return None
    entries = trace.get("entries") or []
    if not entries:
        return None
    entry = max(entries, key=lambda e: e["time_created_ns"])
    pg_name = entry["process_group"][0]
    entry["ranks"] = json.loads(trace.get("pg_config", {}).get(pg_name, {}).get("ranks", "[]"))
    return entry


def diagnose(err: BaseException, guard: Guard, step: int, wait_s: float = 3.0) -> CollectiveFailure:
    """Name the collective that failed and the ranks that never joined it: every rank whose own
    wait failed reports through the store; the group's ranks that do not report within `wait_s`
    are the missing ones."""
    info = guard.info
    entry = last_collective(info.backend)
    what = "a collective"
    ranks = list(range(info.world_size))
    if entry is not None:
        sizes = entry.get("input_sizes") or []
        what = f"{entry['profiling_name']} #{entry['collective_seq_id']} (sizes {sizes})"
        ranks = entry["ranks"] or ranks
    missing = None
    if guard.store is not None:
        try:
            guard.store.set(f"{STUCK_KEY}{info.rank}", str(step))
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                reported = [r for r in ranks if guard.store.check([f"{STUCK_KEY}{r}"])]
                if len(reported) == len(ranks):
                    break
                time.sleep(0.2)
            missing = [r for r in ranks if r not in reported]
        except Exception:
            missing = None
    who = f"; ranks that never joined it: {missing}" if missing else ""
    first = str(err).strip().splitlines()[0][:200]
    return CollectiveFailure(f"step {step}: {what} failed on rank {info.rank}{who} ({first})")


# ----------------------------------------------------------------------------- NCCL: the watchdog's dumps

DUMP_FOLDER = "flight_recorder"  # in the run directory: one dump per rank when a collective times out


def flight_recorder_env(backend: str, trace_buffer: int, run_dir: str) -> dict[str, str]:
    """The TORCH_NCCL_* settings that make an NCCL timeout diagnosable. NCCL's watchdog aborts
    the process on a timeout, so no error reaches `diagnose`; instead, with these set, every
    rank's watchdog writes its flight recorder to RUN_DIR/flight_recorder/rank_<r> first, and the
    launcher reads them (`read_dumps`); the folder is created here (the watchdog does not).
    Other backends: nothing (the error reaches `diagnose`)."""
    if "nccl" not in backend or trace_buffer <= 0:
        return {}
    os.makedirs(os.path.join(run_dir, DUMP_FOLDER), exist_ok=True)
    return {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": str(trace_buffer),
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": os.path.join(run_dir, DUMP_FOLDER, "rank_"),
    }


class _PlainUnpickler(pickle.Unpickler):
    """A flight-recorder dump is dicts, lists, strings and numbers: any class is refused."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"flight-recorder dump: refusing {module}.{name}")


def _load_dump(path: str) -> dict | None:
    raw = open(path, "rb").read()
    try:
        return json.loads(raw) if raw[:1] == b"{" else _PlainUnpickler(io.BytesIO(raw)).load()
    except Exception:
        return None  # a dump cut short by the process's end: that rank says nothing


def _ranks(pg: dict | None) -> list[int]:
    ranks = (pg or {}).get("ranks", [])
    return json.loads(ranks) if isinstance(ranks, str) else list(ranks)


def group_ranks(pg_config: dict, name: str, desc: str) -> list[int]:
    """The ranks of process group (name, desc) in a dump's `pg_config`. The default group may be
    listed under another name (gloo's dump keys it ''): then the widest group is the world."""
    pg = pg_config.get(name) or next((c for c in pg_config.values() if c.get("desc") == desc), None)
    if pg is None and desc == "default_pg" and pg_config:
        pg = max(pg_config.values(), key=lambda c: len(_ranks(c)))
    return _ranks(pg)


def read_dumps(folder: str) -> str | None:
    """One line from every rank's flight-recorder dump in `folder` (NCCL's pickles or gloo's
    JSON): the newest collective any rank entered, and the ranks of its group that never did
    (their dump stops earlier, or they wrote none). None: no dumps."""
    if not os.path.isdir(folder):
        return None
    last: dict[int, dict] = {}  # rank -> its newest entry
    for name in sorted(os.listdir(folder)):
        rank = name.rpartition("_")[2].split(".")[0]  # rank_<r> (NCCL's file prefix), rank_<r>.json
        trace = _load_dump(os.path.join(folder, name)) if rank.isdigit() else None
        if not trace or not trace.get("entries"):
            continue
        entry = max(trace["entries"], key=lambda e: e["collective_seq_id"])
        entry["ranks"] = group_ranks(trace.get("pg_config", {}), *entry["process_group"])
        last[int(rank)] = entry
    if not last:
        return None
    newest = max(last.values(), key=lambda e: e["collective_seq_id"])
    seq = newest["collective_seq_id"]
    group = newest["ranks"] or sorted(last)
    missing = [r for r in group if r not in last or last[r]["collective_seq_id"] < seq]
    who = f"ranks that never joined it: {missing}" if missing else "every rank of its group entered it"
    return (f"flight recorder: {newest['profiling_name']} #{seq} (sizes {newest.get('input_sizes')}, "
            f"process group {newest['process_group'][0]}, {newest.get('state')} on the ranks that entered it): {who}")  # fmt: skip


# ----------------------------------------------------------------------------- fault injection


def inject_fault(step: int, info: DistInfo, module: Any = None, fired: set[str] | None = None) -> str | None:
    """Apply HYDRADIST_FAULT (see the module doc) before `step`. Returns the fault the step itself
    carries on this rank (`faulty`): nan or spike (that step's loss), slow (every step from STEP
    on); a bitflip flips one bit of this rank's first parameter here. A fault is transient: it
    fires once in the run (`fired`), so a rolled-back run that comes to STEP again runs it clean."""
    fired = set() if fired is None else fired
    fault = os.environ.get("HYDRADIST_FAULT")
    if not fault or restart_count() > 0:
        return None
    rank, at, *kind = fault.split(":")
    kind = kind[0] if kind else "exit"
    if kind not in FAULTS:
        raise ValueError(f"HYDRADIST_FAULT: unknown kind {kind!r} ({' | '.join(FAULTS)})")
    mine = rank == "*" or info.rank == int(rank)
    if not mine or step < int(at) or (step != int(at) and kind != "slow") or fault in fired:
        return None
    if kind != "slow":
        fired.add(fault)
    if kind == "exit":
        os._exit(17)
    if kind == "hang":
        while True:  # stops participating (only a signal or the watchdog ends it)
            time.sleep(1)
    if kind in ("sigterm", "sigint"):  # as a scheduler (or Ctrl-C) does: to the launching process, or this one
        sig = signal.SIGTERM if kind == "sigterm" else signal.SIGINT
        os.kill(launcher_pid() or os.getpid(), sig)
        return None
    if kind == "bitflip":
        flip_bit(next(module.parameters()))
        return None
    return kind  # nan | spike | slow | damage


@torch.no_grad()
def damage(module: Any, fault: str | None) -> None:
    """The `damage` fault, after a step's update: every weight of this rank's part x16."""
    for param in module.parameters() if fault == "damage" else ():
        param.mul_(16.0)


def faulty(loss: torch.Tensor, fault: str) -> torch.Tensor:
    """A fault in this rank's forward (its first micro-batch): a NaN loss, a loss spike (100x), or
    a slow device (50 ms more, between the forward and the backward)."""
    if fault in ("slow", "damage"):  # damage: in the update (framework.run.trainer), not the forward
        time.sleep(0.05 if fault == "slow" else 0)
        return loss
    return loss * (float("nan") if fault == "nan" else 100.0)


FAULTS = ("exit", "hang", "sigterm", "sigint", "nan", "spike", "slow", "bitflip", "damage")


@torch.no_grad()
def flip_bit(param: torch.Tensor) -> None:
    """Flip one bit (the lowest of the exponent) of the first element of this rank's local part of
    `param`: a silent corruption that changes the value by a factor of 2 (or 1/2)."""
    local = param.to_local() if hasattr(param, "to_local") else param
    flat = local.data.view(-1)
    bits = {torch.float32: (torch.int32, 23), torch.bfloat16: (torch.int16, 7), torch.float16: (torch.int16, 10)}
    dtype, exponent = bits[flat.dtype]
    word = flat[:1].view(dtype)
    word.bitwise_xor_(1 << exponent)
