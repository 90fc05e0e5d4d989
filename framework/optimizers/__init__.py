"""The optimizer, a component (framework/components.py): `conf/optim/<name>.yaml` names its class
by `_target_` (any `torch.optim` class, the framework's Muon, or a user's), `_partial_: true`, and
its keyword arguments; the framework passes the parameter groups. Beside the kwargs the group holds
the run's own settings (`OWN`), which the class never sees.

The package holds what the config checks read (OWN, `setting`: no torch); the optimizer is built
in framework/optimizers/build.py.

The parameter groups: weight decay on matrices only (the plain model's, by name: FSDP1 flattens
every parameter to 1-D, so a wrapped model's shapes cannot tell), never on biases, norms and
other 1-D parameters; and the blocks' matrices a group of their own, marked `"matrix": True`,
which Muon orthogonalises (torch's optimizers keep an unknown group key and ignore it).
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from framework.components import kwargs_of

# the run's own settings in the optim group, with their values where a user's file leaves them out:
# optim.grad_clip, the max global gradient norm (0: none); optim.in_backward (docs/memory.md)
OWN = {"grad_clip": 1.0, "in_backward": False}


def setting(cfg: DictConfig, key: str) -> Any:
    """The optim group's own setting `key` (OWN), its default where the file leaves it out."""
    return cfg.get(key, OWN[key])


def optimizer_kwargs(cfg: DictConfig) -> dict[str, Any]:
    """The keyword arguments the optimizer's class gets (the optim group less the run's own keys)."""
    return kwargs_of(cfg, OWN)
