"""Numeric settings from the environment (MUSTER_*), read one way everywhere: unset or empty
means the default, and anything else must be a number in range, or `SettingError` names the
variable and what it must be, in one line (a service prints that line and exits 2, see
shared/service.py; raised while a module is imported, it is printed the same way, see `_hook`)."""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import TypeVar

N = TypeVar("N", int, float)


class SettingError(ValueError):
    """A setting in the environment that is not what it must be (the message names it)."""


def number(
    name: str,
    default: N,
    kind: Callable[[str], N],
    low: float | None = None,
    high: float | None = None,
) -> N:
    """The value of environment variable `name` as `kind` (int or float) within [low, high]
    (either bound may be None); `default` when it is unset or empty."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    what = "a whole number" if kind is int else "a number"
    if low is not None and high is not None:
        what += f" from {low:g} to {high:g}"
    elif low is not None:
        what += f" ≥ {low:g}"
    elif high is not None:
        what += f" ≤ {high:g}"
    try:
        value = kind(text)
    except ValueError:
        raise SettingError(f"{name} must be {what}, got {text[:40]!r}") from None
    if (
        (isinstance(value, float) and not math.isfinite(value))
        or (low is not None and value < low)
        or (high is not None and value > high)
    ):
        raise SettingError(f"{name} must be {what}, got {text[:40]!r}")
    return value


def seconds(name: str, default: float, low: float = 0.0) -> float:
    """A duration in seconds (≥ `low`, finite)."""
    return number(name, default, float, low=low)


_previous = sys.excepthook


def _program() -> str:
    """This process's name as its user knows it (`python -m muster.services.validator`: validator)."""
    path = sys.argv[0] if sys.argv and sys.argv[0] else "muster"
    base = os.path.basename(path)
    return os.path.basename(os.path.dirname(path)) if base == "__main__.py" else base


def _hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """A SettingError nobody caught (raised while a service's modules were imported): its one
    line, not a traceback."""
    if isinstance(exc, SettingError):
        print(f"{_program()}: {exc}", file=sys.stderr)
        return
    _previous(kind, exc, tb)


sys.excepthook = _hook
