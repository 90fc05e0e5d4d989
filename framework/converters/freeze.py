"""`converters=[freeze]`: parameters that do not train (no gradient, no optimizer state), by
module kind and by name: the embeddings' tables by default, or any parameter whose name a
pattern matches (`converters.freeze.patterns=['layers.0.*']`; fnmatch, the plain model's names).
The smallest converter there is, and the form of one: a class, its kwargs, `convert(model)`."""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn


class Freeze:
    def __init__(self, embeddings: bool = True, patterns: list[str] | None = None):
        self.embeddings, self.patterns = embeddings, list(patterns or [])

    def convert(self, model: nn.Module) -> None:
        tables = {f"{m}.weight" if m else "weight" for m, mod in model.named_modules() if isinstance(mod, nn.Embedding)}
        for name, param in model.named_parameters():
            if (self.embeddings and name in tables) or any(fnmatchcase(name, p) for p in self.patterns):
                param.requires_grad_(False)
