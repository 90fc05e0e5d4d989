"""Entry point: `python train.py [group=choice ...] [key=value ...]` (add -m to sweep).

Composes conf/ with Hydra, validates, then starts `launch.nproc_per_node` local workers through
torch's elastic launcher, or, when a launcher such as torchrun already started this process as a
worker (RANK/WORLD_SIZE set), trains directly. See framework/launch.py.
"""

import hydra
from omegaconf import DictConfig

from framework.config import register_configs
from framework.launch import main as launch_main
from framework.launch import register_resolvers

register_configs()
register_resolvers()


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict | None:
    return launch_main(cfg)


if __name__ == "__main__":
    main()
