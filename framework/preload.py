"""What a local worker imports before its first step, imported once by the forkserver the
workers fork from (framework.machine.PRELOAD); nothing else imports this module.

The forkserver ignores SIGTERM: a signal to the whole process group (SLURM's preemption) must
reach the launcher and the workers, which save and exit, while the forkserver that reports their
exit codes to the launcher stays until the launcher is gone. A worker restores the default first
(framework.machine._as_launched)."""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)

import torch  # noqa: E402, F401
import torch._dynamo  # noqa: E402, F401  (the optimizer's first step imports it)
import torch.distributed  # noqa: E402, F401

import framework.run.trainer  # noqa: E402, F401
