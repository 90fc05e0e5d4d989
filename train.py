"""Entry point: `python train.py [group=choice ...] [key=value ...]` (add -m to sweep).

Composes conf/ with Hydra, validates, then starts `launch.nproc_per_node` local workers through
torch's elastic launcher, or, when a launcher such as torchrun already started this process as a
worker (RANK/WORLD_SIZE set), trains directly. See framework/launch.py.
"""

import sys

from framework.checkpoint.runlock import refuse_early


def interrupted(kind, value, traceback) -> None:
    """Ctrl-C before any worker started (imports, composing, the checks): the one line the launcher
    prints for a stop before a checkpoint, not a traceback from wherever start-up was."""
    if issubclass(kind, KeyboardInterrupt):
        print("error: stopped by SIGINT before a checkpoint was saved", file=sys.stderr, flush=True)
    else:
        sys.__excepthook__(kind, value, traceback)


if __name__ == "__main__":
    sys.excepthook = interrupted
    refuse_early(sys.argv[1:])  # a live run's folder is refused before seconds of imports

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from framework.config import register_configs, register_resolvers  # noqa: E402
from framework.config.overrides import check_overrides  # noqa: E402
from framework.data import register_data_vocab  # noqa: E402
from framework.launch import main as launch_main  # noqa: E402

register_configs()
register_resolvers()  # ${run_id:} in hydra.run.dir
register_data_vocab()  # ${data_vocab:}: a model's vocab_size follows its data's tokenizer


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict | None:
    return launch_main(cfg)


if __name__ == "__main__":
    check_overrides(sys.argv[1:])  # a misspelt choice or key: one line and exit 2, not Hydra's dump
    main()
