"""The registry of drafting algorithms: name -> the DraftModel subclass that implements the drafter protocol.

Every module in `paradraft.models` is imported on first use, and each drafter class it defines registers itself
with `@register`; so a new algorithm is one new file in this package (see the README, "Adding an algorithm").
The engine, the trainer, the checkpoint code and the exporter look algorithms up here and call the protocol
(`DraftModel` in common.py); none of them branches on an algorithm's name.
"""

from __future__ import annotations

import importlib
import pkgutil

from ..errors import UserError

_DRAFTERS: dict[str, type] = {}
_loaded = False


class UnknownAlgorithmError(UserError, ValueError):
    """An algorithm name no drafter module registers."""


def register(cls: type) -> type:
    """Class decorator: make a DraftModel subclass available under `cls.algorithm`."""
    name = getattr(cls, "algorithm", None)
    if not name:
        raise TypeError(f"{cls.__name__} needs an `algorithm` name to be registered")
    if _DRAFTERS.get(name, cls) is not cls:
        raise TypeError(f"algorithm {name!r} is registered twice ({_DRAFTERS[name].__name__}, {cls.__name__})")
    _DRAFTERS[name] = cls
    return cls


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        package = importlib.import_module(__package__)
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"{__package__}.{info.name}")


def algorithms() -> list[str]:
    """Names of every registered algorithm."""
    _load()
    return sorted(_DRAFTERS)


def drafter_class(name: str) -> type:
    """The DraftModel subclass of algorithm `name` (UnknownAlgorithmError listing the known ones)."""
    _load()
    if name not in _DRAFTERS:
        raise UnknownAlgorithmError(f"unknown drafter algorithm {name!r}; registered: {', '.join(algorithms())}")
    return _DRAFTERS[name]
