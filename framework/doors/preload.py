"""What a local worker imports before its first step, imported once by the forkserver the
workers fork from (framework.machine.PRELOAD); nothing else imports this module.

The forkserver holds (blocks) SIGTERM and SIGINT: a signal to the whole process group (SLURM's
preemption, Ctrl-C while it still imports) must reach the launcher and the workers, which save and
exit, while the forkserver that reports their exit codes to the launcher stays until the launcher
is gone (and prints no KeyboardInterrupt from the middle of importing torch). A worker inherits
the block and lifts it first (framework.machine._as_launched): one sent to it before then, held
rather than ignored, still arrives."""

import gc
import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})

import torch  # noqa: E402, F401
import torch._dynamo  # noqa: E402, F401  (the optimizer's first step imports it)
import torch.distributed  # noqa: E402, F401

import framework.run.trainer  # noqa: E402, F401

# What is imported lives as long as the process: out of the collector's reach, so that the
# collection a worker makes as it leaves its process group (framework.dist.destroy_distributed)
# scans only what the run made, and forked workers share these pages instead of copying them
gc.freeze()
