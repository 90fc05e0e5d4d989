"""One writer per run folder: a run takes an advisory lock in its folder before any worker starts.

The lock is `flock` on `<run dir>/run.lock`, which holds the holder's host, pid, job and start
time, and whose modification time is a lease renewed every LEASE_S / 4 seconds (flock may not
reach across hosts on a network file system; the lease does). The lease's age is read on the file
system's own clock (the mtime of a probe file touched beside it), not this host's: a file server's
clock and ours may disagree by more than a lease. A file system without locks (flock fails with
ENOSYS/EOPNOTSUPP, as on some NFS mounts) gets one warning line and the lease file alone: a live
holder is then one on this host whose process runs, or anywhere with a fresh lease.

- The process that writes the run folder takes it: the local launcher (`python train.py`, held
  through every elastic restart of its workers), or rank 0 of a job an outside launcher started
  (torchrun, srun). Released on exit by emptying the file.
- The other ranks of such a job share it: they check that the holder is their own job (the same
  SLURM job and step, or torchrun run id), waiting briefly for their rank 0 to take it.
- A second run into a folder a live run holds gets `FolderInUse` naming the holder (exit 2).
- A lock whose holder is gone (the same host and the flock is free: its process died; or another
  host whose lease is older than LEASE_S) is taken over, with a line saying so.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time
from datetime import datetime
from typing import Any

LOCK_FILE = "run.lock"
LEASE_S = 60.0
NO_LOCKS = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK)  # flock on a file system without locks


class FolderInUse(RuntimeError):
    """Another live run holds the run folder's lock; the message names it."""

    def __init__(self, path: str, holder: dict[str, Any]):
        who = ", ".join(f"{k} {holder[k]}" for k in ("host", "pid", "job", "since") if k in holder) or "unknown"
        super().__init__(
            f"{os.path.dirname(path)} is in use by another run ({who}; lock file {path}). A run folder has one "
            "writer: wait for that run to end, or choose another hydra.run.dir"
        )


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            text = f.read().strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _flock(fd: int, operation: int) -> bool | None:
    """flock(fd, operation | LOCK_NB): True when taken, False when another holds it, None when the
    file system has no locks."""
    try:
        fcntl.flock(fd, operation | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as err:
        if err.errno in NO_LOCKS:
            return None
        raise


def _flock_free(path: str) -> bool | None:
    """Nobody holds the flock now (probed with a shared lock, released at once); None: no locks here."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return True
    try:
        return _flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)  # closing releases a probe's lock


def _fs_now(folder: str) -> float:
    """The time now on the clock of the file system holding `folder`: the mtime of a probe file
    written there (a file server stamps it), falling back to this host's clock."""
    probe = os.path.join(folder, f".{LOCK_FILE}.clock-{socket.gethostname()}-{os.getpid()}")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"t")
            os.utime(probe)  # no times given: the file system's own now (NFS: the server's)
            return os.stat(probe).st_mtime
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError:
        return time.time()


def _lease_fresh(path: str) -> bool:
    """The lease was renewed within LEASE_S, on the file system's clock."""
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        return False
    return _fs_now(os.path.dirname(path) or ".") - mtime < LEASE_S


def _live_elsewhere(path: str, holder: dict[str, Any]) -> bool:
    """Held from another host with a lease renewed within LEASE_S."""
    return holder.get("host") != socket.gethostname() and _lease_fresh(path)


def _live_without_locks(path: str, holder: dict[str, Any]) -> bool:
    """No flock to ask: the holder lives when it is on this host and its process runs, or on
    another host with a fresh lease."""
    if holder.get("host") == socket.gethostname():
        return _alive(holder.get("pid", 0))
    return _lease_fresh(path)


def no_locks_line(path: str) -> str:
    return (f"warning: run folder lock: {os.path.dirname(path)} is on a file system without locks (flock "
            f"unsupported); one writer per folder is kept by the lease in {path} alone")  # fmt: skip


def refuse_early(argv: list[str]) -> None:
    """Before the heavy imports (torch, Hydra: seconds on a busy machine): a `python train.py`
    given `hydra.run.dir=D` whose D a live run on this host holds exits 2 at once, with the
    holder's line. Only the plain local case; RunLock.acquire stays the authority for the rest
    (outside launchers' ranks, multirun, a folder chosen by the config)."""
    if any(k in os.environ for k in ("RANK", "SLURM_PROCID")) or {"-m", "--multirun"} & set(argv):
        return
    dirs = [a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")]
    if not dirs:
        return
    path = os.path.join(os.path.expanduser(dirs[-1]), LOCK_FILE)
    holder = _read(path)
    if not holder or holder.get("host") != socket.gethostname():
        return
    free = _flock_free(path)
    if free is False or (free is None and _alive(holder.get("pid", 0))):
        print(f"error: {FolderInUse(path, holder)}", file=sys.stderr, flush=True)
        raise SystemExit(2)


class RunLock:
    """The run folder's lock, as held (or shared) by this process."""

    def __init__(self, run_dir: str, job: str):
        self.path, self.job = os.path.join(run_dir, LOCK_FILE), job
        self.fd: int | None = None
        self._stop = threading.Event()

    def acquire(self, wait_s: float = 1.0) -> str | None:
        """Take the lock. Returns the lines to print: a warning when the file system has no locks
        (the lease alone then keeps one writer), and a line when a gone holder's lock was taken
        over; raises FolderInUse when a live run holds it."""
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + wait_s  # another rank of this job may be probing it
        while (taken := _flock(fd, fcntl.LOCK_EX)) is False:
            if time.monotonic() > deadline:
                os.close(fd)
                raise FolderInUse(self.path, _read(self.path))
            time.sleep(0.05)
        holder = _read(self.path)
        lines = [] if taken else [no_locks_line(self.path)]  # taken None: no locks, the lease alone
        if holder and holder.get("job") != self.job:
            if (_live_elsewhere if taken else _live_without_locks)(self.path, holder):
                os.close(fd)
                raise FolderInUse(self.path, holder)
            gone = "not running" if holder.get("host") != socket.gethostname() or not _alive(holder.get("pid", 0)) \
                else "no longer holding it"  # fmt: skip
            lines.append(f"run folder lock: taking over {self.path} from host {holder.get('host')} pid "
                         f"{holder.get('pid')} (job {holder.get('job')}, {gone}: its run ended without releasing it)")  # fmt: skip
        me = {"host": socket.gethostname(), "pid": os.getpid(), "job": self.job,
              "since": datetime.now().isoformat(timespec="seconds")}  # fmt: skip
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        os.fsync(fd)
        self.fd = fd
        threading.Thread(target=self._renew, name="hydradist-run-lock", daemon=True).start()
        atexit.register(self.release)  # also when the process exits early (sys.exit)
        return "\n".join(lines) or None

    def share(self, wait_s: float = 10.0) -> None:
        """Ranks > 0 of a job an outside launcher started: go on when this job (its rank 0)
        holds the folder or no live run does; raise FolderInUse when another job holds it."""
        deadline = time.monotonic() + wait_s
        while True:
            holder = _read(self.path)
            if not holder or holder.get("job") == self.job:
                return  # ours, or free (rank 0 takes it); no file at all: a folder this node does not share
            free = _flock_free(self.path)
            gone = (
                not _live_without_locks(self.path, holder)
                if free is None
                else free and not _live_elsewhere(self.path, holder)
            )
            if gone:
                return  # a gone holder's: rank 0 takes it over
            if time.monotonic() > deadline:  # held, and not (yet) by our rank 0
                raise FolderInUse(self.path, holder)
            time.sleep(0.2)

    def _renew(self) -> None:
        while not self._stop.wait(LEASE_S / 4):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self) -> None:
        if self.fd is None:
            return
        self._stop.set()
        os.ftruncate(self.fd, 0)  # empty: free, and no one will take it for a dead run's
        _flock(self.fd, fcntl.LOCK_UN)  # None on a file system without locks: nothing to release
        os.close(self.fd)
        self.fd = None
