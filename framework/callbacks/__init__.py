"""Callbacks: what watches or changes a step, each in its own room (framework/callbacks/*.py),
configured by `_target_` (docs/callbacks.md). The contract is framework.hooks; the
framework's own callbacks and the user's are built in one place (framework.callbacks.build)."""

from framework.figures import Figure
from framework.hooks import HOOKS, Callback, Callbacks, Control, Run

__all__ = ["HOOKS", "Callback", "Callbacks", "Control", "Figure", "Run"]
