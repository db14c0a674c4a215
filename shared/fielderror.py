"""One reason a config was rejected (`FieldError`): its own module so that the modules that check
parts of a config (shared/mpi.py for `extras.mpi`) and shared/jobconfig.py, which runs their
checks, can both name it without importing each other (shared/jobconfig.py re-exports it)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict


def _cut(limit: int) -> Any:
    """A validator cutting a string to `limit` characters (a path naming a user's 10,000-character
    key, a reason quoting a value): errors stay small enough to send."""

    def cut(value: Any) -> Any:
        return value[: limit - 1] + "…" if isinstance(value, str) and len(value) > limit else value

    return BeforeValidator(cut)


class FieldError(BaseModel):
    """One reason a config was rejected: `path` as users write it (`taskRoles[1].memoryMB`)."""

    model_config = ConfigDict(frozen=True)

    path: Annotated[str, _cut(300)]
    reason: Annotated[str, _cut(2000)]

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}" if self.path else self.reason
