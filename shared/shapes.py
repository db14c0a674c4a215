"""The shape of every value Muster's messages carry, defined once: ids, names, numbers and free
text, each with a pattern or bounds that `muster.shared.messages` enforces when a message is decoded.

Whatever a service receives may be garbage or forged, and much of it becomes a NATS subject
token or a KV key (a direct get names the key in its subject): a value that is too long, holds a
dot, a space or a control character would make the server close the connection ("maximum
control line exceeded") or address something else. So ids and names are short tokens of a
known alphabet, numbers are bounded, and free text (reasons, output lines) is cut to a length
real output fits, wherever a model is built or decoded, and refused beyond a hard cap.

The patterns are the ones the rest of Muster already uses: user, node and job names are
`muster.shared.auth.NAME_RE` (the job config's `jobName` is the same set), submission ids
`muster.shared.subjects.SUBMISSION_ID_RE`, task role names the config's `IDENT_RE`, metric names
`muster.shared.trainmetrics.NAME_RE`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StringConstraints, WithJsonSchema

from muster.shared import auth, trainmetrics
from muster.shared.jobconfig import IDENT_RE, MAX_ROLES, MAX_TASKS_PER_ROLE
from muster.shared.subjects import SUBMISSION_ID_RE

# ------------------------------------------------------------------ tokens

NAME_PATTERN = auth.NAME_RE.pattern  # ^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$
# A job id is derived ('j' + 12 hex digits, `messages.job_id_for`); any name-shaped token is
# taken (it is a subject token and a KV key either way: no dot, no wildcard, at most 64).
JOB_ID_PATTERN = NAME_PATTERN
ROLE_PATTERN = IDENT_RE  # ^[A-Za-z_][A-Za-z0-9_]*$, at most 64
TASK_KEY_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,63}\.(0|[1-9][0-9]{0,8})$"  # <role>.<index>
# A host name, IPv4 or IPv6 address (an IPv6 zone after '%').
ADDRESS_PATTERN = r"^[A-Za-z0-9._:%\[\]-]{1,255}$"
GPU_MODEL_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"  # as gpuType writes it (inventory.short_model)
SHORT_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"  # an agent's run id, a runtime's name
METRIC_PATTERN = trainmetrics.NAME_RE

Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN)]  # a user, node, VC or job name
JobId = Annotated[str, StringConstraints(pattern=JOB_ID_PATTERN)]
SubmissionId = Annotated[str, StringConstraints(pattern=SUBMISSION_ID_RE)]
Role = Annotated[str, StringConstraints(max_length=64, pattern=ROLE_PATTERN)]
TaskKey = Annotated[str, StringConstraints(max_length=80, pattern=TASK_KEY_PATTERN)]
Address = Annotated[str, StringConstraints(pattern=ADDRESS_PATTERN)]
GpuModel = Annotated[str, StringConstraints(pattern=GPU_MODEL_PATTERN)]
ShortId = Annotated[str, StringConstraints(pattern=SHORT_ID_PATTERN)]
MetricName = Annotated[str, StringConstraints(max_length=trainmetrics.MAX_NAME, pattern=METRIC_PATTERN)]


def is_name(value: str) -> bool:
    """Whether `value` is a user, node, VC or job name (a whole match: no trailing newline)."""
    return auth.NAME_RE.fullmatch(value) is not None


def is_job_id(value: str) -> bool:
    return re.fullmatch(JOB_ID_PATTERN, value) is not None


# ------------------------------------------------------------------ numbers

MAX_ATTEMPT = 1_000_000_000  # retries are bounded (retryCount ≤ 1000, platform retries), preemptions not
MAX_GANG = MAX_ROLES * MAX_TASKS_PER_ROLE  # tasks of one attempt, at most
MAX_GRACE = 24 * 3600.0  # seconds between SIGTERM and SIGKILL
MAX_COUNT = 2**53  # CPUs, MB, sequence numbers, steps: what a JSON number holds exactly
MAX_NODE_GPU_ENTRIES = 1024  # a node record listing more does not decode (beyond 64 it is not believed)

Attempt = Annotated[int, Field(ge=1, le=MAX_ATTEMPT)]
AttemptOrNone = Annotated[int, Field(ge=0, le=MAX_ATTEMPT)]  # a job record's: 0 until first placed
Index = Annotated[int, Field(ge=0, lt=MAX_TASKS_PER_ROLE)]  # a task's index in its role
RoleNo = Annotated[int, Field(ge=0, lt=MAX_ROLES)]  # a role's position in the config
GpuIndex = Annotated[int, Field(ge=0, lt=MAX_NODE_GPU_ENTRIES)]
Port = Annotated[int, Field(ge=0, le=65535)]  # 0: none
ExitCode = Annotated[int, Field(ge=-(2**31), lt=2**31)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
Step = Annotated[int, Field(ge=-MAX_COUNT, le=MAX_COUNT)]
Grace = Annotated[float, Field(ge=0, le=MAX_GRACE, allow_inf_nan=False)]

# ------------------------------------------------------------------ free text

REASON = 2000  # characters of a reason, a detail, an error (they name a task, a node, a cause)
LINE = 1000  # characters of one output line kept as evidence (a traceback's lines fit)
LINES = 30  # output lines kept as evidence (the agent keeps the last 30)
HARD_TEXT = 64 * 1024  # beyond this, free text in a message is refused, not cut
HARD_LINES = 1000
CUT = "…"


def clip(text: str, limit: int = REASON) -> str:
    """`text` cut to at most `limit` characters, its end marked with '…'."""
    return text if len(text) <= limit else text[: limit - 1] + CUT


def _cut(limit: int, hard: int) -> Callable[[Any], Any]:
    def cut(value: Any) -> Any:
        if not isinstance(value, str) or len(value) <= limit:
            return value  # (what is not a str, the str check names)
        if len(value) > hard:
            raise ValueError(f"at most {hard} characters, got {len(value)}")
        return value[: limit - 1] + CUT

    return cut


def _tail(count: int, each: int, hard: int) -> Callable[[Any], Any]:
    def keep(value: Any) -> Any:
        if not isinstance(value, list):
            return value
        if len(value) > hard:
            raise ValueError(f"at most {hard} lines, got {len(value)}")
        kept = value[-count:] if len(value) > count else value
        if any(isinstance(line, str) and len(line) > each for line in kept):
            cut = _cut(each, HARD_TEXT)
            kept = [cut(line) for line in kept]
        return kept

    return keep


# Free text on the bus (from agents, users, any service): cut, and refused beyond the hard cap.
# One Python call per field (a line's length checked in the list's): a task event decodes in
# microseconds. The hard caps are in the JSON schema too.
Reason = Annotated[
    str, BeforeValidator(_cut(REASON, HARD_TEXT)), WithJsonSchema({"type": "string", "maxLength": HARD_TEXT})
]
Lines = Annotated[
    list[str],
    BeforeValidator(_tail(LINES, LINE, HARD_LINES)),
    WithJsonSchema(
        {"type": "array", "items": {"type": "string", "maxLength": HARD_TEXT}, "maxItems": HARD_LINES}
    ),
]
# Free text in records that only services write (KV records, the job history) is plain `str`:
# what they quote came in a message cut as above, and a record an older version wrote longer
# must still decode.


def refusal(exc: Exception, limit: int = 300) -> str:
    """Why a message did not decode, in one line: each field and what is wrong with it."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        try:
            found = errors(include_url=False, include_input=False)
            text = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'payload'}: {e['msg']}" for e in found)
        except Exception:
            text = str(exc)
    else:
        text = str(exc)
    return clip(" ".join(text.split()), limit)
