"""Entry point: `python train.py [group=choice ...] [key=value ...]` (add -m to sweep).

Composes conf/ with Hydra, validates, then starts `launch.nproc_per_node` local workers through
torch's elastic launcher, or, when a launcher such as torchrun already started this process as a
worker (RANK/WORLD_SIZE set), trains directly. See framework/doors/launch.py.

A plain run composes its config once, before torch is imported (framework/config/hydra_job.py):
when it will start local workers, their forkserver starts then and imports torch beside this
process instead of after it.
"""

import signal
import sys

from framework.checkpoint.runlock import refuse_early
from framework.machine import interrupt_outside_imports, keyed_inductor_cache


def interrupted(kind, value, traceback) -> None:
    """Ctrl-C before any worker started (imports, composing, the checks): the one line the launcher
    prints for a stop before a checkpoint, not a traceback from wherever start-up was."""
    if issubclass(kind, KeyboardInterrupt):
        print("error: stopped by SIGINT before a checkpoint was saved", file=sys.stderr, flush=True)
    else:
        sys.__excepthook__(kind, value, traceback)


if __name__ == "__main__":
    sys.excepthook = interrupted
    signal.signal(signal.SIGINT, interrupt_outside_imports)  # not a traceback from the middle of an import
    refuse_early(sys.argv[1:])  # a live run's folder is refused before seconds of imports
    keyed_inductor_cache()  # before torch: forced ATen kernels compile into a cache of their own

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from framework.config import register_configs, register_resolvers  # noqa: E402
from framework.config.hydra_job import run_plain  # noqa: E402

register_configs()
register_resolvers()  # ${run_id:} in hydra.run.dir; ${data_vocab:}: a model's vocab_size follows its data


def launch(cfg: DictConfig) -> float | None:
    from framework.doors.launch import main as launch_main  # torch: imported once the config is composed

    return launch_main(cfg)


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return launch(cfg)


if __name__ == "__main__":
    if not run_plain(sys.argv[1:], launch, __file__):  # a plain run composes its config once
        from framework.config.overrides import check_overrides

        check_overrides(sys.argv[1:])  # a misspelt choice or key: one line and exit 2, not Hydra's dump
        main()  # -m, Hydra's flags, a config that sweeps: Hydra's own path
