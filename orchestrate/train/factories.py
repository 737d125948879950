"""Calling the user's code: model and dataset factories, custom losses.

User code fails in ways our code does not (a typo in the import path, a factory that raises), and
under DDP the message must say which rank failed and in which factory, or the person reads a
cascade of "connection closed" errors from the other ranks. A path that does not import, or
arguments the factory does not take, are configuration mistakes: a
:class:`~orchestrate.core.errors.UserError` naming the field (``train.model: ...``, with a
did-you-mean), so the rank exits 2 (``validate`` and ``plan`` catch most of them before launch:
:mod:`orchestrate.train.importcheck`; these are what only the node's Python sees). Anything the
factory itself raises becomes a :class:`~orchestrate.train.failure.TrainFailure` whose text is
that one line.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from typing import Any

from orchestrate.core.errors import Problem, UserError
from orchestrate.train.failure import TrainFailure
from orchestrate.train.importcheck import FIELDS, suggest

#: Which field each kind of user code comes from.
_FIELD_OF = {what: f"train.{field}" for field, what in FIELDS.items()}


def _mistake(what: str, path: str, message: str, hint: str, field: str = "") -> UserError:
    return UserError(Problem(f"{what} {message}", field=field or _FIELD_OF.get(what, ""),
                             got=path, hint=hint))


def _workdir_modules() -> list[str]:
    try:
        return [n.partition(".")[0] for n in os.listdir(".") if n.endswith(".py")]
    except OSError:
        return []


def resolve(path: str, what: str) -> Callable[..., Any]:
    """Import ``package.module:function`` and return the callable; ``what`` names its role."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise _mistake(what, path, f"module {exc.name!r} not found",
                           "the job's workdir and PYTHONPATH are searched, on this node."
                           + suggest(exc.name, _workdir_modules())) from exc
        raise TrainFailure(f"{what} {path}: importing {module_name} failed: {_brief(exc)}") from exc
    except Exception as exc:
        raise TrainFailure(f"{what} {path}: importing {module_name} failed: {_brief(exc)}") from exc
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise _mistake(what, path, f"{module_name} has no attribute {attr!r}",
                           "name a function the module defines."
                           + suggest(part, [n for n in dir(target) if not n.startswith("_")]))
        target = getattr(target, part)
    if not callable(target):
        raise _mistake(what, path, f"{attr} is not callable", "name a function or a class")
    return target  # type: ignore[no-any-return]


def call(path: str, what: str, kwargs: dict[str, Any]) -> Any:
    """Resolve ``path`` and call it with ``kwargs``; arguments it does not take are the job's
    mistake (``train.model_args``); any exception it raises names the factory."""
    factory = resolve(path, what)
    _check_arguments(factory, path, what, kwargs)
    try:
        return factory(**kwargs)
    except Exception as exc:
        raise TrainFailure(f"{what} {path} raised {_brief(exc)}") from exc


def _check_arguments(factory: Callable[..., Any], path: str, what: str,
                     kwargs: dict[str, Any]) -> None:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # a builtin without a signature: its own error says it
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        names = [n for n, p in signature.parameters.items()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        unknown = [k for k in kwargs if k not in names]
        hint = f"it takes: {', '.join(names) or 'no arguments'}."
        if unknown:
            hint += suggest(unknown[0], names)
        raise _mistake(what, path, f"cannot be called with these arguments: {exc}", hint,
                       field=_FIELD_OF.get(what, "train.model") + "_args") from None


def _brief(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
