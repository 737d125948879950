"""Calling the user's code: model and dataset factories, custom losses.

User code fails in ways our code does not (a typo in the import path, a factory that raises), and
under DDP the message must say which rank failed and in which factory, or the person reads a
cascade of "connection closed" errors from the other ranks. Every failure here becomes a
:class:`~orchestrate.train.failure.TrainFailure` whose text is that one line.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from orchestrate.train.failure import TrainFailure


def resolve(path: str, what: str) -> Callable[..., Any]:
    """Import ``package.module:function`` and return the callable; ``what`` names its role."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise TrainFailure(
                f"{what} {path}: module {exc.name!r} not found (the job's workdir and "
                "PYTHONPATH are searched)"
            ) from exc
        raise TrainFailure(f"{what} {path}: importing {module_name} failed: {_brief(exc)}") from exc
    except Exception as exc:
        raise TrainFailure(f"{what} {path}: importing {module_name} failed: {_brief(exc)}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise TrainFailure(f"{what} {path}: {module_name} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise TrainFailure(f"{what} {path}: {attr} is not callable")
    return target  # type: ignore[no-any-return]


def call(path: str, what: str, kwargs: dict[str, Any]) -> Any:
    """Resolve ``path`` and call it with ``kwargs``; any exception names the factory."""
    factory = resolve(path, what)
    try:
        return factory(**kwargs)
    except Exception as exc:
        raise TrainFailure(f"{what} {path} raised {_brief(exc)}") from exc


def _brief(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
