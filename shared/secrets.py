"""Which jobEnvs are secrets, and keeping their values out of everything but the task.

A jobEnvs name matching one of MUSTER_SECRET_ENV's patterns (comma-separated, fnmatch,
case-insensitive; default below) is a secret: its value is kept apart from the job record
(shared/jobconfig.py `split_secrets`), shown as `***` everywhere, and masked in the task's
output lines, as CI systems mask secrets in logs.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterable, Mapping

DEFAULT_PATTERNS = "*TOKEN*,*PASSWORD*,*PASSWD*,*SECRET*,*KEY*,*CREDENTIAL*"
MASK = "***"
MIN_MASKED = 4  # shorter values would mask ordinary words


def patterns() -> list[str]:
    text = os.environ.get("MUSTER_SECRET_ENV") or DEFAULT_PATTERNS
    return [p.strip().upper() for p in text.split(",") if p.strip()]


def is_secret(name: str) -> bool:
    upper = name.upper()
    return any(fnmatch.fnmatchcase(upper, p) for p in patterns())


def redact_env(env: Mapping[str, object]) -> dict[str, object]:
    """`env` with every secret's value replaced by MASK."""
    return {k: (MASK if is_secret(k) else v) for k, v in env.items()}


def secret_values(env: Mapping[str, object], also: Iterable[str] = ()) -> list[str]:
    """The values of `env`'s secrets worth masking, longest first (so a value that contains
    another is masked whole): those this process's patterns name, and those named in `also`
    (what the validator kept apart, by its own patterns). A value of several lines (a key file)
    is masked line by line too, as output comes a line at a time."""
    values: set[str] = set()
    named = set(also)
    for name, value in env.items():
        if value is None or not (name in named or is_secret(name)):
            continue
        # A task sees a non-string value as JSON (services/agent/environment.py).
        text = value if isinstance(value, str) else json.dumps(value)
        values.update(v for v in (text, *text.splitlines()) if len(v.strip()) >= MIN_MASKED)
    return sorted(values, key=len, reverse=True)


def mask(text: str, values: Iterable[str]) -> str:
    """`text` with every occurrence of any of `values` replaced by MASK."""
    for value in values:
        if value in text:
            text = text.replace(value, MASK)
    return text


class Masker:
    """`mask` with a fixed set of values, for the lines of one task."""

    def __init__(self, values: Iterable[str]) -> None:
        self.values = sorted({v for v in values if len(v) >= MIN_MASKED}, key=len, reverse=True)

    @classmethod
    def for_env(cls, env: Mapping[str, object], also: Iterable[str] = ()) -> Masker:
        return cls(secret_values(env, also))

    def __call__(self, text: str) -> str:
        return mask(text, self.values) if self.values else text
