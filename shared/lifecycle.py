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


def attempt_to_place(
    job: Placeable, current: AttemptRecord | None, at: datetime, latest: int = 0
) -> int | None:
    """Which attempt of a WAITING job may be placed now, or None. The job's current attempt is
    the later of the one its record names and `latest`, the newest one with an attempt record:
    the scheduler leader creates the attempt record and nothing more, and the supervisor then
    moves the job record to it (`Supervisor.adopt`), so for a moment only the attempt says so.
    `current` is that attempt's record. The first attempt when there is none; the current one
    when the job was moved to it but its record was never written (a leader of an earlier
    version died mid-commit); the next once the current one has ended, the supervisor has
    settled it as a retry, every one of its tasks has ended (reported by its agent, or declared
    lost with its node), and the backoff has passed."""
    if job.state != JobState.WAITING:
        return None
    n = max(job.attempt, latest)
    if n == 0:
        return 1
    if current is None:
        return n
    if (
        current.ended
        and job.settled >= n
        and all(t.state.ended for t in current.tasks)
        and (job.not_before is None or job.not_before <= at)
    ):
        return n + 1
    return None
