"""The gateway's job list: what it keeps of every retained job (a `Summary`, a few hundred bytes,
not the record) and an index that answers "newest first, filtered, after this cursor" a page at
a time without sorting anything per question. Pure: no bus (the gateway feeds it from the jobs
bucket's watcher, which treats it as the dict it mirrors into).

The index is one list per (scope, state), scope being a user or everyone (`subjects.ALL`), each
sorted by (submitted, job id): a job is in two of them. A page merges the lists of the states
asked for from the cursor down, newest first; a time window is two bisections; the other
filters (VC, part of the name) are checked on the way. Counts per state are the lists' lengths
when only the scope narrows the list, else counted once, on the first page.

What changed since a time (`changed`, the portal's live list): per scope, a dict of job id ->
when the gateway saw its record written (its own clock, never going back), kept in that order
by moving a job to the end on every write (pop and insert; a dict keeps insertion order and
iterates from its end). A question walks it from the end and stops at the first job seen
before the time asked: it costs what changed since then (the holes that moves leave behind
are of jobs that moved since, too), never a pass over the jobs retained."""

from __future__ import annotations

import bisect
import heapq
import json
import re
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

from muster.shared import subjects
from muster.shared.messages import JobRecord, JobState

REASON_CHARS = 160  # of a job's reason, kept and shown in lists
CURSOR_RE = re.compile(r"^(\d{1,19})\.([-/_=.a-zA-Z0-9]{1,128})$")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
ROLES_KEPT = 4096  # distinct role shapes shared between summaries (most jobs have one of a few)
_ROLES: dict[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...]] = {}


def micros(at: datetime) -> int:
    """Microseconds since the epoch (a naive time is taken as UTC)."""
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    delta = at - EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def shown_time(us: int) -> str:
    return datetime.fromtimestamp(us / 1_000_000, UTC).isoformat()


class Summary(NamedTuple):
    """What a list shows of one job."""

    job_id: str
    job_name: str
    user: str
    vc: str
    priority: str
    state: JobState
    submitted: int  # microseconds since the epoch: with job_id, the list's order
    updated: int
    tasks: int
    gpus: float
    attempt: int
    reason: str
    roles: tuple[tuple[int, int], ...] = ()  # per role: CPUs and memory (MB) a task holds

    @classmethod
    def of(cls, r: JobRecord) -> Summary:
        c = r.config
        roles = tuple((role.cpuNumber, role.memoryMB) for role in c.taskRoles)
        return cls(
            r.job_id,
            r.job_name,
            r.user,
            c.virtualCluster,
            c.priority,
            r.state,
            micros(r.submitted_at),
            micros(r.updated_at),
            c.total_tasks,
            round(sum(role.gpuNumber * role.taskNumber for role in c.taskRoles), 3),
            r.attempt,
            r.reason[:REASON_CHARS],
            _ROLES.setdefault(roles, roles) if len(_ROLES) < ROLES_KEPT or roles in _ROLES else roles,
        )

    def shown(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "job_name": self.job_name,
            "user": self.user,
            "vc": self.vc,
            "priority": self.priority,
            "state": self.state.value,
            "tasks": self.tasks,
            "gpus": self.gpus,
            "attempt": self.attempt,
            "submitted_at": shown_time(self.submitted),
            "updated_at": shown_time(self.updated),
            "reason": self.reason,
        }

    @property
    def cursor(self) -> str:
        return f"{self.submitted}.{self.job_id}"


Key = tuple[int, str]


def order(s: Summary) -> Key:
    return (s.submitted, s.job_id)


def cursor_key(cursor: str) -> Key:
    """The position a page's `next` names; ValueError for anything else."""
    m = CURSOR_RE.match(cursor)
    if not m:
        raise ValueError(f"bad cursor {cursor[:64]!r}: pass back a page's `next` as it came")
    return int(m[1]), m[2]


@dataclass(frozen=True)
class Query:
    """Which jobs, newest first: of `scope` (a user, or subjects.ALL), in `states`, of VC `vc`,
    whose name holds `name` (any case), submitted in [since, until), older than `after`."""

    scope: str
    states: tuple[JobState, ...] = tuple(JobState)
    vc: str | None = None
    name: str | None = None
    since: int | None = None
    until: int | None = None
    after: Key | None = None

    @property
    def narrowed(self) -> bool:
        """Whether anything but the scope and the states narrows it."""
        return any(v is not None for v in (self.vc, self.name, self.since, self.until))

    def admits(self, s: Summary) -> bool:
        return (self.vc is None or s.vc == self.vc) and (
            self.name is None or self.name.casefold() in s.job_name.casefold()
        )

    def admits_all(self, s: Summary) -> bool:
        """Every filter but the cursor (the scope aside: the caller's lists are the scope's)."""
        return (
            s.state in self.states
            and self.admits(s)
            and (self.since is None or s.submitted >= self.since)
            and (self.until is None or s.submitted < self.until)
        )


Decorate = Callable[[Summary, dict[str, Any]], None]  # adds to a job's item what the list lacks


def wall_clock() -> int:
    return micros(datetime.now(UTC))


class Listing(MutableMapping[str, Summary]):
    """Every retained job's summary by key, and the index. `Store.mirror` writes into it.
    `clock`: microseconds since the epoch, for when a record was seen written."""

    def __init__(self, clock: Callable[[], int] = wall_clock) -> None:
        self.jobs: dict[str, Summary] = {}
        self.lists: dict[tuple[str, JobState], list[Summary]] = {}
        self.clock = clock
        self.seen: dict[str, dict[str, int]] = {}  # scope -> job id -> when seen written, in that order
        self._now = 0  # the latest time read from the clock (it never goes back)

    def now(self) -> int:
        """The clock, never going back: what a write after this call is seen at, at least."""
        self._now = max(self._now, self.clock())
        return self._now

    # ------------------------------------------------------------ the mapping

    def __getitem__(self, key: str) -> Summary:
        return self.jobs[key]

    def __setitem__(self, key: str, s: Summary) -> None:
        old = self.jobs.get(key)
        if old is not None:
            self._drop(old)
            if old.user != s.user:  # (a record never changes its user, but a forged one may)
                self._unsee(old)
        self.jobs[key] = s
        at = self.now()
        for scope in (subjects.ALL, s.user):
            bisect.insort(self.lists.setdefault((scope, s.state), []), s, key=order)
            seen = self.seen.setdefault(scope, {})
            seen.pop(key, None)  # to the end: the most recently written
            seen[key] = at

    def __delitem__(self, key: str) -> None:
        s = self.jobs.pop(key)
        self._drop(s)
        self._unsee(s)

    def _unsee(self, s: Summary) -> None:
        for scope in (subjects.ALL, s.user):
            seen = self.seen.get(scope)
            if seen is not None:
                seen.pop(s.job_id, None)
                if not seen:
                    del self.seen[scope]

    def __iter__(self) -> Iterator[str]:
        return iter(self.jobs)

    def __len__(self) -> int:
        return len(self.jobs)

    def _drop(self, s: Summary) -> None:
        for scope in (subjects.ALL, s.user):
            held = self.lists.get((scope, s.state))
            if not held:
                continue
            i = bisect.bisect_left(held, order(s), key=order)
            while i < len(held) and held[i] is not s and order(held[i]) == order(s):
                i += 1
            if i < len(held) and held[i] is s:
                del held[i]
            if not held:
                del self.lists[(scope, s.state)]

    # ------------------------------------------------------------ pages

    def of_state(self, scope: str, state: JobState) -> list[Summary]:
        """The scope's jobs in `state`, oldest first (do not change it)."""
        return self.lists.get((scope, state), [])

    def _span(self, held: list[Summary], q: Query) -> tuple[int, int]:
        lo = bisect.bisect_left(held, (q.since, ""), key=order) if q.since is not None else 0
        hi = len(held)
        if q.until is not None:
            hi = bisect.bisect_left(held, (q.until, ""), key=order)
        if q.after is not None:
            hi = min(hi, bisect.bisect_left(held, q.after, key=order))
        return lo, hi

    def _newest_first(self, q: Query) -> Iterator[Summary]:
        def down(held: list[Summary]) -> Iterator[Summary]:
            lo, hi = self._span(held, q)
            for i in range(hi - 1, lo - 1, -1):
                yield held[i]

        runs = [down(self.of_state(q.scope, state)) for state in q.states]
        merged = runs[0] if len(runs) == 1 else heapq.merge(*runs, key=order, reverse=True)
        return (s for s in merged if q.admits(s))

    def counts(self, q: Query) -> dict[str, int]:
        """Per state, the scope's jobs that every filter but the states and the cursor admits."""
        out = {}
        whole = Query(q.scope, q.states, q.vc, q.name, q.since, q.until)
        for state in JobState:
            held = self.of_state(q.scope, state)
            if not whole.narrowed:
                out[state.value] = len(held)
                continue
            lo, hi = self._span(held, whole)
            if whole.vc is None and whole.name is None:
                out[state.value] = hi - lo
            else:
                out[state.value] = sum(1 for i in range(lo, hi) if whole.admits(held[i]))
        return out

    def page(self, q: Query, limit: int, budget: int, decorate: Decorate | None = None) -> dict[str, Any]:
        """Up to `limit` jobs (and `budget` bytes of their JSON), newest first, with `next` (the
        cursor of the page after, None at the end); the first page (no cursor) also has
        `counts` per state and `total` (every page's jobs together)."""
        jobs, last, more = self._fill(self._newest_first(q), limit, budget, decorate)
        answer: dict[str, Any] = {"jobs": jobs, "next": last.cursor if more and last else None}
        if q.after is None:
            self._count(q, answer)
        return answer

    def changed(
        self, q: Query, since: int, limit: int, budget: int, decorate: Decorate | None = None
    ) -> dict[str, Any]:
        """The scope's jobs that every filter of `q` admits and whose record was seen written at
        or after `since` (microseconds), the most recently written first: up to `limit` (and
        `budget` bytes), `more` when others changed too (ask the list again). With `now`, the
        time to pass as `since` next (no write after this answer is seen before it), and
        `counts` and `total` as a first page has them. Costs the writes since `since`."""
        seen = self.seen.get(q.scope, {})
        at = self.now()

        def recent() -> Iterator[Summary]:
            for key in reversed(seen):
                if seen[key] < since:
                    return
                s = self.jobs[key]
                if q.admits_all(s):
                    yield s

        jobs, _, more = self._fill(recent(), limit, budget, decorate)
        answer: dict[str, Any] = {"jobs": jobs, "more": more, "now": shown_time(at)}
        self._count(q, answer)
        return answer

    @staticmethod
    def _fill(
        found: Iterator[Summary], limit: int, budget: int, decorate: Decorate | None
    ) -> tuple[list[dict[str, Any]], Summary | None, bool]:
        """Items of `found` up to `limit` and `budget` bytes: them, the last one's summary, and
        whether more were left."""
        jobs: list[dict[str, Any]] = []
        size, last = 0, None
        for s in found:
            if len(jobs) >= limit:
                return jobs, last, True
            item = s.shown()
            if decorate is not None:
                decorate(s, item)
            cost = len(json.dumps(item, separators=(",", ":"))) + 1
            if jobs and size + cost > budget:
                return jobs, last, True
            jobs.append(item)
            size += cost
            last = s
        return jobs, last, False

    def _count(self, q: Query, answer: dict[str, Any]) -> None:
        counts = self.counts(q)
        answer["counts"] = counts
        answer["total"] = sum(counts[state.value] for state in q.states)
