"""Entry point: `python train.py [group=choice ...] [key=value ...]` (add -m to sweep).

Composes conf/ with Hydra, validates, then starts `launch.nproc_per_node` local workers through
torch's elastic launcher, or, when a launcher such as torchrun already started this process as a
worker (RANK/WORLD_SIZE set), trains directly. See framework/launch.py.
"""

import sys

import hydra
from omegaconf import DictConfig

from framework.config import register_configs, register_resolvers
from framework.config.overrides import check_overrides
from framework.launch import main as launch_main

register_configs()
register_resolvers()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict | None:
    return launch_main(cfg)


if __name__ == "__main__":
    check_overrides(sys.argv[1:])  # a misspelt choice or key: one line and exit 2, not Hydra's dump
    main()
