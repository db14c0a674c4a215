"""The attempt lifecycle rule, a pure core shared by the supervisor (which settles attempts) and
the scheduler (which places them): `attempt_to_place` says which attempt of a waiting job may be
placed now. It lives here, not in either service, so that the services meet only on the bus."""

from __future__ import annotations

from datetime import datetime
from typing import Protocol

from muster.shared.messages import AttemptRecord, JobState


class Placeable(Protocol):
    """What `attempt_to_place` reads of a job: a `JobRecord`, or the scheduler's slim copy."""

    @property
    def state(self) -> JobState: ...
    @property
    def attempt(self) -> int: ...
    @property
    def settled(self) -> int: ...
    @property
    def not_before(self) -> datetime | None: ...


def attempt_to_place(job: Placeable, current: AttemptRecord | None, at: datetime) -> int | None:
    """Which attempt of a WAITING job may be placed now, or None: the first when never placed;
    the current one when the job was moved to it but its record was never written (a leader
    died mid-commit); the next once the current one has ended, the supervisor has settled it as
    a retry, every one of its tasks has ended (reported by its agent, or declared lost with its
    node), and the backoff has passed."""
    if job.state != JobState.WAITING:
        return None
    if job.attempt == 0:
        return 1
    if current is None:
        return job.attempt
    if (
        current.ended
        and job.settled >= job.attempt
        and all(t.state.ended for t in current.tasks)
        and (job.not_before is None or job.not_before <= at)
    ):
        return job.attempt + 1
    return None
