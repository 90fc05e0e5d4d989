"""This machine, as the layers above see it: its name, how many ranks it runs at once, and the
launcher that starts local workers. The bottom layer (no framework imports): launch, the planner's
probes, the sweeps and the tests all start workers through it."""

from __future__ import annotations

import atexit
import contextlib
import functools
import multiprocessing
import os
import platform
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any


def process_start_time() -> float:
    """When this process started (Linux: /proc), else now. The boot time is now less the uptime
    (to 10 ms), not /proc/stat's btime, which is whole seconds: up to a second off every start-up time."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, after the name
        with open("/proc/uptime") as f:
            boot = time.time() - float(f.read().split()[0])
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def cpu_name() -> str:
    """The CPU model (what a cache of measured figures is keyed by)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a SLURM or container cpuset),
    not the machine's count, which on a shared node oversubscribes the cores it was given."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def device_slots(device: str) -> int:
    """Ranks this machine can host at once: its GPUs on CUDA, else its cores."""
    if device == "cuda":
        import torch

        return max(1, torch.cuda.device_count())
    return os.cpu_count() or 1  # the machine's: a probe may share the cores this process was given


def local_ranks(world: int, nodes: int, nproc_per_node: int | None, device: str) -> int:
    """The ranks one node of a `world`-rank job on `nodes` nodes runs here: the most worker
    processes a probe on this machine may start. `launch.nproc_per_node`, where set, is what this
    machine will run (a laptop may oversubscribe its cores on purpose); else world / nodes, capped
    by this machine's cores or GPUs."""
    if nproc_per_node:
        return max(1, min(world, nproc_per_node))
    return max(1, min(world, -(-world // max(1, nodes)), device_slots(device)))


# Local workers fork from a forkserver that imported what a worker imports (torch, dynamo, the
# trainer) once: a worker starts in milliseconds instead of re-importing torch for seconds, as
# spawn does. framework.doors.preload is that import list; it is only ever imported by the forkserver.
PRELOAD = ["framework.doors.preload"]
LAUNCHER_PID = "HYDRADIST_LAUNCHER_PID"
# the environment this process was started with; in a forkserver, the server's (see _as_launched)
_STARTED_ENV = dict(os.environ)


def start_forkserver() -> None:
    """Start the forkserver now, so that its imports run beside the caller's own start-up (train.py
    calls it once the config says workers will start); later launches fork from it. It starts
    with SIGINT and SIGTERM held, as under launch_local, until framework.doors.preload holds them itself.
    Should no launch use it (the config is refused), it is ended at exit, mid-import or not."""
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(PRELOAD)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    atexit.register(_end_unused_forkserver, forkserver._forkserver._forkserver_pid)


_warmed: list[int] = []  # the forkserver known to have imported what a worker imports (its pid)


def warm_forkserver() -> float:
    """Start the forkserver where none runs and wait until it has imported what a worker imports
    (framework.doors.preload: torch, the trainer): the seconds that took, none once it is warm. A
    sweep's job waits here before its own clock starts (framework.doors.launch.job_start): the
    workers' start-up is the sweep's, paid once, not its first job's. It waits by starting one
    process that does nothing: the forkserver forks nothing before its imports are done."""
    from multiprocessing import forkserver

    begin, server = time.time(), forkserver._forkserver
    if server._forkserver_pid is not None and server._forkserver_pid in _warmed:
        return 0.0
    if server._forkserver_pid is None:
        start_forkserver()
    child = multiprocessing.get_context("forkserver").Process(target=_nothing, name="hydradist-warm")
    child.start()
    child.join()
    _warmed[:] = [server._forkserver_pid]
    return time.time() - begin


def _nothing() -> None:
    """warm_forkserver's process: started, it has shown that the forkserver is ready."""


def _end_unused_forkserver(pid: int | None) -> None:
    if pid is not None and not _stop_forkserver_at_exit.cache_info().currsize:  # no launch_local
        os.kill(pid, signal.SIGKILL)  # it holds SIGTERM (framework.doors.preload)
        os.waitpid(pid, 0)


def keyed_inductor_cache() -> None:
    """A process whose ATen kernels are forced (`ATEN_CPU_CAPABILITY`) compiles into a cache of its
    own. Inductor's cache keys leave the capability out: a kernel that a process on the CPU's own
    capability compiled and cached is loaded by one forced below it, and computes NaNs (torch
    2.14: cached under AVX-512, run under avx2). An explicit TORCHINDUCTOR_CACHE_DIR is kept. Called
    before torch._dynamo is imported (train.py's first lines), which sets the default one; the
    forkserver and the workers inherit it."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        import getpass
        import tempfile

        folder = f"torchinductor_{getpass.getuser()}_aten_{capability}"
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), folder)


def launched_as_worker() -> bool:
    """True when an outside launcher (torchrun, srun, ...) started this process as one rank."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def slurm_task() -> bool:
    """True under `srun` with several tasks and no torchrun in between: each task is one rank."""
    env = os.environ
    needed = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    return "RANK" not in env and all(k in env for k in needed) and bool(nodelist) and int(env["SLURM_NTASKS"]) > 1


def local_launch_config(
    nproc: int, max_restarts: int = 0, monitor_interval_s: float = 0.1, start_method: str = "forkserver"
):
    """torch's elastic launcher set up for `nproc` workers on this machine (as `torchrun
    --standalone` does), used by train.py, the planner's link probe, the config sweeps of
    benchmarks and the tests."""
    from torch.distributed.launcher.api import LaunchConfig

    if start_method == "forkserver":
        import multiprocessing

        multiprocessing.set_forkserver_preload(PRELOAD)
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=f"hydradist-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",  # port 0: a free port, so concurrent runs never collide
        max_restarts=max_restarts,
        monitor_interval=monitor_interval_s,
        start_method=start_method,
    )


def launch_local(nproc: int, fn: Callable[..., Any], *args: Any, **launch: Any) -> dict[int, Any]:
    """fn(*args) on `nproc` local workers, as `torchrun --standalone` would run it; {rank: result}.
    `launch`: local_launch_config's knobs. Each worker sees the caller's environment, sys.path and
    working directory as they are now, whichever start method made it (a forkserver keeps its own
    from when it started)."""
    from torch.distributed.launcher.api import elastic_launch

    if launch.get("start_method", "forkserver") == "forkserver":
        _stop_forkserver_at_exit()
    _start_workers_unsignalled()
    _name_rendezvous_records_cheaply()
    caller = (dict(os.environ) | {LAUNCHER_PID: str(os.getpid())}, list(sys.path), os.getcwd())
    with _held_until_started():
        return elastic_launch(local_launch_config(nproc, **launch), _as_launched)(caller, fn, args)


@functools.cache
def _stop_forkserver_at_exit() -> None:
    """At exit, stop the forkserver and wait for it: its workers' resource use (the peak resident
    set `/usr/bin/time -f %M` reports) then reaches this process, as a spawned worker's does."""
    from multiprocessing import forkserver

    stop = getattr(forkserver._forkserver, "_stop", None)  # CPython's own, for its tests
    if stop is not None:
        atexit.register(stop)


@functools.cache
def _name_rendezvous_records_cheaply() -> None:
    """torch's c10d rendezvous names the caller of each of its event records with two calls of
    `inspect.stack()`, which reads the source of every frame on the stack and searches
    sys.modules for each: a tenth of a second per record under pytest's deep stacks, a dozen
    records per launch, on the launcher's critical path. The same name, from the frame itself."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:  # a stack shallower than depth
            return "no_method_name"

    if hasattr(dynamic_rendezvous, "get_method_name"):
        dynamic_rendezvous.get_method_name = get_method_name


def interrupt_outside_imports(signum: int, frame: Any) -> None:
    """SIGINT's handler while a launcher or a worker starts up: Python's KeyboardInterrupt, except
    in the middle of an import, where it surfaces as another error (a class body's `__set_name__`
    wraps it in a RuntimeError) or inside C++ called back from Python (pybind11 ends the process:
    "terminate called ... KeyboardInterrupt"). There it is sent again once the import is done."""
    if not _importing(frame):
        raise KeyboardInterrupt
    if not _redelivering.locked():
        threading.Thread(target=_redeliver_after_import, args=(signum,), daemon=True).start()


_redelivering = threading.Lock()


def _importing(frame: Any) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _redeliver_after_import(signum: int) -> None:
    main = threading.main_thread().ident
    with _redelivering:
        while _importing(sys._current_frames().get(main)):
            time.sleep(0.01)
        signal.pthread_kill(main, signum)


# Held while the launcher starts the workers, and by the forkserver (framework.doors.preload); a worker lifts them
HELD_SIGNALS = {signal.SIGINT, signal.SIGTERM}


_held: list[int] = []  # signals that arrived while the workers were starting


def _hold(signum: int, frame: Any) -> None:
    _held.append(signum)


def _deliver_held() -> None:
    if _held:
        signum = _held[0]
        _held.clear()
        signal.raise_signal(signum)


@contextlib.contextmanager
def _held_until_started() -> Iterator[None]:
    """From the launch until the workers are started (the rendezvous too: a KeyboardInterrupt in
    the middle of it leaves torch's shutdown joining a thread it never started), a signal waits."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _hold) for sig in HELD_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _deliver_held()  # the launch ended before it started any worker


@functools.cache
def _start_workers_unsignalled() -> None:
    """SIGINT and SIGTERM wait while torch's elastic launcher starts the workers. Its handler raises
    wherever this process is; in the middle of starting them, torch has no process context yet to
    stop, so the workers already started are orphaned, and this process's exit unlinks the
    semaphores they are still unpickling (a FileNotFoundError traceback from multiprocessing's
    synchronize.py). Held until all are started, the signal arrives where torch stops them all.
    Held twice: by the signal mask, which the processes started meanwhile inherit (the forkserver,
    until framework.doors.preload holds it itself; a worker, until _as_launched), and by Python's
    handler, since the mask is this thread's only and another thread may take the signal."""
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    start = MultiprocessContext._start

    def start_unsignalled(self) -> None:
        torch_handlers = {sig: signal.signal(sig, _hold) for sig in HELD_SIGNALS}
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
        try:
            start(self)
        finally:
            for sig, handler in torch_handlers.items():
                signal.signal(sig, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # one sent to this thread arrives now, to torch's
        _deliver_held()  # to torch's handler: the context now stops every worker

    MultiprocessContext._start = start_unsignalled


def launcher_pid() -> int | None:
    """The process that started this worker (train.py, a test, a sweep), where one of this
    machine's launches did: a worker's parent may be the forkserver, not the launcher."""
    pid = os.environ.get(LAUNCHER_PID)
    return int(pid) if pid else None


def _as_launched(caller: tuple[dict, list, str], fn: Callable[..., Any], args: tuple) -> Any:
    env, path, cwd = caller
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, interrupt_outside_imports)  # start_method=fork: it had the launcher's
    # held by the forkserver (framework.doors.preload) or while the launcher started this worker: one sent
    # meanwhile (the launcher stopping a start it was interrupted in) arrives now
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)
    # what the launcher set for this worker (RANK, MASTER_PORT, ...): what differs from the
    # environment this process started with
    worker = {k: v for k, v in os.environ.items() if _STARTED_ENV.get(k) != v}
    os.environ.clear()
    os.environ.update(env | worker)
    sys.path[:] = path
    os.chdir(cwd)
    # the platform's start method for what the worker starts itself (DataLoader workers), as under
    # torchrun: multiprocessing set this process's to the one that started it
    multiprocessing.set_start_method(None, force=True)
    return fn(*args)
