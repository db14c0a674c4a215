"""The job contract: OpenPAI's job config (seed 000 plus the v1 extensions) as pydantic models.

`check_job(data)` is the single entry point: it never raises on user input and returns either
a `JobConfig` or every error found, each as a field path plus a reason
(`taskRoles[1].memoryMB: must be ≥ 100, got 64`). Name uniqueness needs the job store and is
checked by the validator service, not here.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Annotated, Any, Literal, TypeGuard

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import ErrorDetails

from muster.shared import mpi, trainmetrics
from muster.shared.fielderror import FieldError as FieldError  # re-exported: its home breaks the mpi circle

# Names end up in container names, NATS subjects, KV keys and paths: letters, digits, '_' and '-'.
NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9_-]*$"
# Role names and port labels end up inside environment variable names
# (PAI_TASK_ROLE_<name>_HOST_LIST, PAI_CONTAINER_HOST_<label>_PORT_LIST), which a shell must expand.
IDENT_RE = r"^[A-Za-z_][A-Za-z0-9_]*$"
ENV_NAME_RE = IDENT_RE
# A Docker image reference: [registry[:port]/]path[:tag][@digest].
IMAGE_RE = (
    r"^(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?(?::[0-9]+)?/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?$"
)

MAX_TASKS_PER_ROLE = 10_000
MAX_ROLES = 64
MAX_COMMAND_CHARS = 64 * 1024
RESERVED_ENV_PREFIXES = ("PAI_", "MUSTER_")
# OpenPAI let jobEnvs set PAI_ names (its job-editor example sets PAI_USER_NAME and PAI_URL): they
# are accepted with a warning, the platform's value winning where it sets the same name. MUSTER_
# names are Muster's own and stay refused.
REFUSED_ENV_PREFIXES = ("MUSTER_",)
WARNED_ENV_PREFIXES = ("PAI_",)

Name = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=NAME_RE)]
Image = Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=IMAGE_RE)]
Ident = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=IDENT_RE)]
PathStr = Annotated[str, StringConstraints(max_length=4096)]
# NaN and infinities would not survive a JSON round trip (they serialize as null).
EnvValue = str | int | Annotated[float, Field(allow_inf_nan=False)] | bool
EnvName = Annotated[str, StringConstraints(pattern=ENV_NAME_RE, max_length=128)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _check_path(value: str | None) -> str | None:
    """Empty means unset (OpenPAI's own examples write ""); `..` segments and NULs never pass."""
    if value is None or value == "":
        return None
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    if ".." in re.split(r"[/\\]", value):
        raise ValueError("must not contain a '..' path segment")
    return value


def _integer_or_digits(schema: dict[str, Any]) -> None:
    """An integer field's JSON schema made to admit a string of digits too (the model converts it)."""
    integer = {k: schema.pop(k) for k in ("type", "minimum", "maximum") if k in schema}
    schema["anyOf"] = [integer, {"type": "string", "pattern": "^[0-9]{1,5}$"}]


class PortType(_Model):
    """OpenPAI v1 portList entry: `portNumber` ports labelled `label`; beginAt 0 = any free port."""

    label: Ident
    # The schema also admits a string of digits, as OpenPAI's server did (accepted with a warning).
    beginAt: int = Field(
        ge=0,
        le=65535,
        json_schema_extra=_integer_or_digits,
    )
    portNumber: int = Field(ge=1, le=100)

    @field_validator("beginAt", mode="before")
    @classmethod
    def _number_as_string(cls, v: Any) -> Any:
        """OpenPAI's server converted `"beginAt": "0"` (its documentation writes it so): a string
        of digits is taken as its number (with a warning, see `job_warnings`); any other string
        is refused naming the field."""
        if isinstance(v, str):
            if not re.fullmatch(r"[0-9]{1,5}", v.strip()):
                raise ValueError(
                    f"must be an integer (or a string of digits, as OpenPAI took), got {_show(v)}"
                )
            return int(v.strip())
        return v


WHOLE_GPU = 1000  # a GPU in thousandths: a shared task's share of its GPU (TaskSpec.gpu_milli)
MAX_GPUS = 64


def _gpu_number(v: Any) -> Any:
    """Whole GPUs (0 to 64), or part of one GPU in hundredths (0.01 to 0.99). A float that is a
    whole number (2.0) is that whole number: JSON writers and YAML may write it so."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(
            f"must be a number of GPUs (0 to {MAX_GPUS}, or 0.01 to 0.99 of one GPU), got {_show(v)}"
        )
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"must be a finite number of GPUs, got {v}")
        if v.is_integer():
            v = int(v)
        elif not 0 < v < 1:
            raise ValueError(
                f"a task asks for whole GPUs, or for part of one GPU (0.01 to 0.99), got {v}: "
                "a task cannot hold part of a GPU beside whole ones"
            )
        elif abs(v * 100 - round(v * 100)) > 1e-6:
            raise ValueError(f"part of a GPU is given in hundredths (0.01 to 0.99), got {v}")
        else:
            return round(v, 2)
    if v < 0:
        raise ValueError(f"must be ≥ 0, got {v}")
    if v > MAX_GPUS:
        raise ValueError(f"must be ≤ {MAX_GPUS}, got {v}")
    return v


# Whole GPUs, or part of one GPU shared with other tasks (docs/gpus.md): OpenPAI's field, an
# integer there, takes a fraction here so that a config asks for a share the way it asks for a
# GPU. Hundredths: the Alibaba GPU 2023 trace's shares are all multiples of 0.01 (0.05 to 0.81).
GpuNumber = Annotated[int | float, BeforeValidator(_gpu_number)]


class TaskRole(_Model):
    name: Ident
    taskNumber: int = Field(ge=1, le=MAX_TASKS_PER_ROLE)
    cpuNumber: int = Field(ge=1, le=1024)
    memoryMB: int = Field(ge=100, le=16 * 1024 * 1024)
    gpuNumber: GpuNumber
    command: str = Field(min_length=1, max_length=MAX_COMMAND_CHARS)
    shmMB: int | None = Field(default=None, ge=1)
    minFailedTaskCount: int | None = Field(default=None, ge=1)
    minSucceededTaskCount: int | None = Field(default=None, ge=1)
    portList: list[PortType] = Field(default_factory=list, max_length=32)
    # Muster's extension (PaddlePaddle EDL): an elastic role starts with minTaskNumber tasks and
    # the scheduler keeps it between the two; taskNumber must lie between them.
    minTaskNumber: int | None = Field(default=None, ge=1, le=MAX_TASKS_PER_ROLE)
    maxTaskNumber: int | None = Field(default=None, ge=1, le=MAX_TASKS_PER_ROLE)
    # Muster's extension (seed 004: master, workers and parameter servers each with their own
    # image): this role's tasks run this image instead of the job's `image`.
    image: Image | None = None

    @property
    def elastic(self) -> bool:
        return self.minTaskNumber is not None and self.maxTaskNumber is not None

    @property
    def shares_gpu(self) -> bool:
        """Each task asks for part of one GPU, which it shares with other such tasks."""
        return isinstance(self.gpuNumber, float)

    @property
    def gpu_devices(self) -> int:
        """The GPU devices each task is given: its whole GPUs, or the one it has a part of."""
        return 1 if self.shares_gpu else int(self.gpuNumber)

    @property
    def gpu_milli(self) -> int:
        """What each task holds of each of its GPU devices, in thousandths: its share of the one
        it shares, else WHOLE_GPU (whole GPUs, or none)."""
        return round(self.gpuNumber * WHOLE_GPU) if self.shares_gpu else WHOLE_GPU

    @field_validator("command")
    @classmethod
    def _command_not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        if "\x00" in v:
            raise ValueError("must not contain a NUL character")
        return v


MAX_DATA = 32
DATA_RE = r"^(?P<name>[A-Za-z0-9][A-Za-z0-9_-]{0,63}):(?P<path>/[^:]*)(?::(?P<mode>rw|ro))?$"


class DataMount(BaseModel):
    """One `data` entry, parsed: dataset `name` mounted at `path` in the task, writable only
    when asked (`:rw`) and the dataset allows it (decided by the operator's record)."""

    model_config = ConfigDict(frozen=True)

    name: str
    path: str
    rw: bool = False


def parse_data(entry: str) -> DataMount:
    """`<dataset>:/path` or `<dataset>:/path:rw` (`:ro`, the default, may be written); raises
    ValueError saying what is wrong."""
    m = re.fullmatch(DATA_RE, entry)
    if m is None:
        raise ValueError(
            f"must be '<dataset>:/path' or '<dataset>:/path:rw' (a dataset name of letters, digits, "
            f"'_' and '-', an absolute path without ':'), got {_show(entry)}"
        )
    path = m["path"]
    if "\x00" in path or any(c.isspace() for c in path):
        raise ValueError(f"the path must not contain spaces or NULs, got {_show(entry)}")
    if ".." in path.split("/"):
        raise ValueError(f"the path must not contain a '..' segment, got {_show(entry)}")
    normal = "/" + "/".join(p for p in path.split("/") if p and p != ".")
    if normal == "/":
        raise ValueError("cannot mount a dataset over '/'")
    return DataMount(name=m["name"], path=normal, rw=m["mode"] == "rw")


def _data_entry(entry: str) -> str:
    parse_data(entry)
    return entry


DataEntry = Annotated[str, StringConstraints(max_length=4096), AfterValidator(_data_entry)]

GIT_REF_RE = r"^[A-Za-z0-9_][A-Za-z0-9._/+-]{0,254}$"
GIT_COMMIT_RE = r"^[0-9a-f]{7,40}$"


def shown_url(url: str) -> str:
    """A git URL fit for logs, events and errors: user info (`https://user:token@host`) cut out."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "***@" + authority.rsplit("@", 1)[1]
    return f"{scheme}{sep}{authority}{slash}{path}"


class CodeSync(_Model):
    """Muster's extension (seed 001's git source): the code is fetched from `git` once per
    attempt on each node, into codeDir (or a directory of the attempt's), before its tasks start;
    a failure is a configuration error. `branch` or `commit` (neither: the default branch)."""

    git: str = Field(min_length=1, max_length=2048)
    branch: Annotated[str, StringConstraints(pattern=GIT_REF_RE)] | None = None
    commit: Annotated[str, StringConstraints(pattern=GIT_COMMIT_RE)] | None = None

    @field_validator("git")
    @classmethod
    def _git_source(cls, v: str) -> str:
        if v.startswith("-") or any(c.isspace() or ord(c) < 32 for c in v):
            raise ValueError("must be a git URL or an absolute path, without spaces or a leading '-'")
        if "::" in v.split("/", 1)[0] or v.lower().startswith(("ext:", "fd:")):
            raise ValueError("remote helpers (<transport>::<address>) are not allowed")
        scheme = v.split("://", 1)[0].lower() if "://" in v else None
        if scheme is not None and scheme not in ("https", "http", "ssh", "git", "file"):
            raise ValueError(f"must be an https, http, ssh, git or file URL (or a path), got {scheme}://")
        if scheme is None and not v.startswith("/") and not re.match(r"^[A-Za-z0-9._-]+@[^/:]+:", v):
            raise ValueError(
                "must be a URL (https://, ssh://, git://, file://), user@host:path or an absolute path"
            )
        return v

    @field_validator("branch")
    @classmethod
    def _ref(cls, v: str | None) -> str | None:
        if v is not None and (".." in v or v.endswith((".lock", "/", "."))):
            raise ValueError(f"is not a git branch name, got {_show(v)}")
        return v


Priority = Literal["low", "normal", "high"]
PRIORITIES: tuple[str, ...] = ("low", "normal", "high")  # lowest first: the index is the rank


def rank(priority: str) -> int:
    """A priority's rank (low 0, normal 1, high 2)."""
    return PRIORITIES.index(priority)


def _metric_decl(value: str) -> str:
    trainmetrics.parse_spec(value)
    return value


# `NAME` or `NAME:FORMAT` (RAW or PERCENTAGE): a metric the job prints (shared/trainmetrics.py).
MetricDecl = Annotated[str, StringConstraints(min_length=1, max_length=80), AfterValidator(_metric_decl)]
MIN_NO_PROGRESS = 5
MAX_NO_PROGRESS = 7 * 24 * 3600
MAX_RUN_TIME = 365 * 24 * 3600


class JobConfig(_Model):
    jobName: Name
    image: Image
    authFile: PathStr | None = None
    dataDir: PathStr | None = None
    outputDir: PathStr | None = None
    codeDir: PathStr | None = None
    taskRoles: list[TaskRole] = Field(min_length=1, max_length=MAX_ROLES)
    gpuType: Annotated[str, StringConstraints(max_length=64, pattern=r"^[A-Za-z0-9_.-]*$")] | None = None
    killAllOnCompletedTaskNumber: int | None = Field(default=None, ge=0)
    retryCount: int = Field(default=0, ge=-2, le=1000)
    virtualCluster: Name = "default"
    priority: Priority = "normal"  # Muster's extension: a waiting job may preempt lower ones
    jobEnvs: dict[EnvName, EnvValue] = Field(default_factory=dict)
    extras: dict[str, Any] = Field(default_factory=dict)
    # Muster's extensions (seed 001): operator-defined datasets mounted in every task
    # (`<dataset>:/path[:rw]`, see docs/data.md), and code fetched from git for each attempt.
    data: list[DataEntry] = Field(default_factory=list, max_length=MAX_DATA)
    codeSync: CodeSync | None = None

    @property
    def mounts(self) -> list[DataMount]:
        """The `data` entries, parsed."""
        return [parse_data(e) for e in self.data]

    # Muster's extensions for training metrics and hang detection (docs/metrics.md): the metrics
    # the tasks print (`accuracy=0.93`), and how long a running task may print nothing before
    # the agent stops it as hung (a platform failure: the gang runs again as a new attempt).
    metrics: list[MetricDecl] = Field(default_factory=list, max_length=trainmetrics.MAX_METRICS)
    noProgressTimeoutSec: int | None = Field(default=None, ge=MIN_NO_PROGRESS, le=MAX_NO_PROGRESS)
    # Muster's extension (Slurm's --time): each attempt runs at most this long from its first
    # task's start; one that runs past it is stopped and fails as the user's (retryCount says
    # whether it runs again). Unset: no limit.
    maxRunTimeSec: int | None = Field(default=None, ge=1, le=MAX_RUN_TIME)
    # Muster's extension: the job resumes from its own checkpoints when it is stopped and started
    # again (a preemption gives it SIGTERM and MUSTER_PREEMPT_GRACE to save one). The queue then
    # counts the time it ran as run, not lost (services/scheduler/attained.py).
    resumable: bool = False

    @field_validator("metrics")
    @classmethod
    def _metrics_once(cls, v: list[str]) -> list[str]:
        seen: dict[str, int] = {}
        for i, entry in enumerate(v):  # each entry is already checked: this finds repeats
            name = trainmetrics.parse_spec(entry).name
            if name in seen:
                raise ValueError(f"{name!r} is declared twice (metrics[{seen[name]}] and metrics[{i}])")
            seen[name] = i
        return v

    @property
    def metric_specs(self) -> list[trainmetrics.MetricSpec]:
        return trainmetrics.parse_specs(self.metrics)

    @field_validator("authFile", "dataDir", "outputDir", "codeDir")
    @classmethod
    def _safe_paths(cls, v: str | None) -> str | None:
        return _check_path(v)

    @field_validator("gpuType", "virtualCluster", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, str) and v == "":
            return "default" if info.field_name == "virtualCluster" else None
        return v

    @property
    def total_tasks(self) -> int:
        return sum(r.taskNumber for r in self.taskRoles)

    @property
    def most_tasks(self) -> int:
        """The most tasks it may ever have at once (an elastic role at its maximum)."""
        return sum(r.maxTaskNumber if r.elastic and r.maxTaskNumber else r.taskNumber for r in self.taskRoles)

    @property
    def elastic(self) -> bool:
        return any(r.elastic for r in self.taskRoles)

    def sized(self, counts: dict[str, int]) -> JobConfig:
        """This config with each elastic role's taskNumber set to its count in `counts` (its
        tasks now: what the agents build each task's environment from)."""
        roles = [
            r.model_copy(update={"taskNumber": counts[r.name]}) if r.elastic and r.name in counts else r
            for r in self.taskRoles
        ]
        return self.model_copy(update={"taskRoles": roles})

    def smallest(self) -> JobConfig:
        """This config with each elastic role at its minimum: what the scheduler places first."""
        if not self.elastic:
            return self
        return self.sized({r.name: r.minTaskNumber for r in self.taskRoles if r.minTaskNumber})

    def role(self, name: str) -> TaskRole:
        return next(r for r in self.taskRoles if r.name == name)

    def image_for(self, role: str) -> str:
        """The image the tasks of `role` run: the role's own `image`, else the job's."""
        return self.role(role).image or self.image

    @property
    def images(self) -> list[str]:
        """Every image the job's tasks run, the job's first, each once."""
        return list(dict.fromkeys([self.image, *(r.image for r in self.taskRoles if r.image)]))


def format_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _show(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else _json_type_value(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _json_type_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    return str(value)


_TYPE_NAMES = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "an object",
    "model_type": "an object",
    "model_attributes_type": "an object",
    "bool_type": "true or false",
    "float_type": "a number",
}


def _reason(err: ErrorDetails) -> str:
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "missing":
        return "required"
    if kind == "extra_forbidden":
        return "unknown field"
    if kind in _TYPE_NAMES:
        return f"must be {_TYPE_NAMES[kind]}, got {_show(value)}"
    if kind == "greater_than_equal":
        return f"must be ≥ {ctx['ge']}, got {_show(value)}"
    if kind == "less_than_equal":
        return f"must be ≤ {ctx['le']}, got {_show(value)}"
    if kind == "string_too_short":
        return "must not be empty"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters, got {len(value)}"
    if kind == "too_short":
        return f"must have at least {ctx['min_length']} item(s), got {ctx.get('actual_length', 0)}"
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} item(s)"
    if kind == "string_pattern_mismatch":
        return f"{_PATTERN_HINTS.get(ctx['pattern'], 'has an invalid format')}, got {_show(value)}"
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind == "literal_error":
        return f"must be one of {ctx['expected']}, got {_show(value)}"
    return err["msg"]


_PATTERN_HINTS = {
    NAME_RE: "must start with a letter or digit and use only letters, digits, '_' and '-'",
    IDENT_RE: "must start with a letter or '_' and use only letters, digits and '_'",
    IMAGE_RE: "must be a Docker image reference like registry:5000/team/image:tag",
    r"^[A-Za-z0-9_.-]*$": "must use only letters, digits, '.', '_' and '-'",
}


def _elastic_errors(role: dict[str, Any], i: int) -> list[FieldError]:
    """An elastic role gives both bounds, minTaskNumber ≤ taskNumber ≤ maxTaskNumber, and no
    minFailedTaskCount (it fails when fewer than minTaskNumber of its tasks are left)."""
    lo, hi, n = role.get("minTaskNumber"), role.get("maxTaskNumber"), role.get("taskNumber")
    if lo is None and hi is None:
        return []
    at = f"taskRoles[{i}]"
    if lo is None or hi is None:
        missing = "minTaskNumber" if lo is None else "maxTaskNumber"
        other = "maxTaskNumber" if lo is None else "minTaskNumber"
        return [
            FieldError(path=f"{at}.{missing}", reason=f"required with {other} (an elastic role gives both)")
        ]
    errors = []
    if _is_int(n) and _is_int(lo) and lo > n:
        errors.append(FieldError(path=f"{at}.minTaskNumber", reason=f"must be ≤ taskNumber ({n}), got {lo}"))
    if _is_int(n) and _is_int(hi) and hi < n:
        errors.append(FieldError(path=f"{at}.maxTaskNumber", reason=f"must be ≥ taskNumber ({n}), got {hi}"))
    if role.get("minFailedTaskCount") is not None:
        errors.append(
            FieldError(
                path=f"{at}.minFailedTaskCount",
                reason="does not apply to an elastic role: it fails when fewer than minTaskNumber "
                "tasks are left",
            )
        )
    return errors


RESIZE_SIGNALS = ("SIGHUP", "SIGUSR1", "SIGUSR2")  # what an elastic job may be sent on a new gang


def _extras_errors(data: dict[str, Any]) -> list[FieldError]:
    """`extras.elastic`: `{"signal": one of RESIZE_SIGNALS}`, sent to an elastic job's running
    tasks when its gang changes (after their env file is rewritten)."""
    extras = data.get("extras")
    if not isinstance(extras, dict) or "elastic" not in extras:
        return []
    asked = extras["elastic"]
    if not isinstance(asked, dict) or set(asked) - {"signal"}:
        return [FieldError(path="extras.elastic", reason='must be {"signal": NAME}')]
    if asked.get("signal") not in RESIZE_SIGNALS:
        allowed = ", ".join(RESIZE_SIGNALS)
        return [
            FieldError(
                path="extras.elastic.signal",
                reason=f"must be one of {allowed}, got {_show(asked.get('signal'))}",
            )
        ]
    return []


# Cross-field rules: each a small named function yielding the errors of one rule. The checker runs
# them in the order listed (the order errors are reported in). A role rule runs on each role in
# turn (all role rules on role 0, then on role 1, ...), a port rule on each port of a role.
JobRule = Callable[[dict[str, Any]], Iterable[FieldError]]
RoleRule = Callable[[list[Any], int, dict[str, Any]], Iterable[FieldError]]
PortRule = Callable[[list[Any], str, int, dict[str, Any]], Iterable[FieldError]]


def _extras_elastic_is_a_known_signal(data: dict[str, Any]) -> Iterable[FieldError]:
    return _extras_errors(data)


def _extras_mpi_names_its_roles(data: dict[str, Any]) -> Iterable[FieldError]:
    return mpi.errors(data)


def _role_name_is_unique(roles: list[Any], i: int, role: dict[str, Any]) -> Iterator[FieldError]:
    name = role.get("name")
    if not isinstance(name, str):
        return
    first = next(
        (j for j, other in enumerate(roles[:i]) if isinstance(other, dict) and other.get("name") == name),
        None,
    )
    if first is not None:
        yield FieldError(
            path=f"taskRoles[{i}].name", reason=f"duplicate role name {name!r} (also taskRoles[{first}])"
        )


def _elastic_role_bounds_hold(roles: list[Any], i: int, role: dict[str, Any]) -> Iterable[FieldError]:
    return _elastic_errors(role, i)


def _completion_counts_fit_task_number(
    roles: list[Any], i: int, role: dict[str, Any]
) -> Iterator[FieldError]:
    """minFailedTaskCount and minSucceededTaskCount ≤ taskNumber."""
    n = role.get("taskNumber")
    if not (_is_int(n) and n >= 1):
        return
    for key in ("minFailedTaskCount", "minSucceededTaskCount"):
        v = role.get(key)
        if _is_int(v) and v > n:
            yield FieldError(path=f"taskRoles[{i}].{key}", reason=f"must be ≤ taskNumber ({n}), got {v}")


def _shm_fits_memory(roles: list[Any], i: int, role: dict[str, Any]) -> Iterator[FieldError]:
    shm, mem = role.get("shmMB"), role.get("memoryMB")
    if _is_int(shm) and _is_int(mem) and shm > mem >= 100:
        yield FieldError(path=f"taskRoles[{i}].shmMB", reason=f"must be ≤ memoryMB ({mem}), got {shm}")


def _port_label_is_unique(ports: list[Any], at: str, j: int, port: dict[str, Any]) -> Iterator[FieldError]:
    label = port.get("label")
    if isinstance(label, str) and any(
        isinstance(other, dict) and other.get("label") == label for other in ports[:j]
    ):
        yield FieldError(path=f"{at}.portList[{j}].label", reason=f"duplicate port label {label!r}")


def _port_range_ends_by_65535(
    ports: list[Any], at: str, j: int, port: dict[str, Any]
) -> Iterator[FieldError]:
    begin, count = port.get("beginAt"), port.get("portNumber")
    if isinstance(begin, str) and begin.strip().isdigit():
        begin = int(begin.strip())  # OpenPAI's number as a string
    if _is_int(begin) and _is_int(count) and 0 < begin <= 65535 and count >= 1 and begin + count - 1 > 65535:
        yield FieldError(
            path=f"{at}.portList[{j}].portNumber", reason=f"ports {begin}..{begin + count - 1} run past 65535"
        )


PORT_RULES: tuple[PortRule, ...] = (_port_label_is_unique, _port_range_ends_by_65535)


def _ports_follow_port_rules(roles: list[Any], i: int, role: dict[str, Any]) -> Iterator[FieldError]:
    ports = role.get("portList")
    if not isinstance(ports, list):
        return
    for j, port in enumerate(ports):
        if isinstance(port, dict):
            for rule in PORT_RULES:
                yield from rule(ports, f"taskRoles[{i}]", j, port)


ROLE_RULES: tuple[RoleRule, ...] = (
    _role_name_is_unique,
    _elastic_role_bounds_hold,
    _completion_counts_fit_task_number,
    _shm_fits_memory,
    _ports_follow_port_rules,
)


def _roles_follow_role_rules(data: dict[str, Any]) -> Iterator[FieldError]:
    roles = data["taskRoles"]
    for i, role in enumerate(roles):
        if isinstance(role, dict):
            for rule in ROLE_RULES:
                yield from rule(roles, i, role)


def _data_targets_are_unique(data: dict[str, Any]) -> Iterator[FieldError]:
    mounts = data.get("data")
    targets: dict[str, int] = {}
    for i, entry in enumerate(mounts if isinstance(mounts, list) else []):
        try:
            target = parse_data(entry).path if isinstance(entry, str) else None
        except ValueError:
            continue
        if target in targets:
            yield FieldError(
                path=f"data[{i}]", reason=f"{target} is already mounted by data[{targets[target]}]"
            )
        elif target is not None:
            targets[target] = i


def _code_sync_gives_branch_or_commit(data: dict[str, Any]) -> Iterator[FieldError]:
    sync = data.get("codeSync")
    if isinstance(sync, dict) and sync.get("branch") is not None and sync.get("commit") is not None:
        yield FieldError(path="codeSync.commit", reason="give a branch or a commit, not both")


def _total_tasks(roles: list[Any]) -> int | None:
    """The most tasks the job can have (an elastic role counts its maxTaskNumber), or None where
    a role's count is unknown (no roles: taskRoles already reports it; a role not an object, or
    without a taskNumber ≥ 1)."""
    total = 0
    for role in roles:
        n = role.get("taskNumber") if isinstance(role, dict) else None
        if not (_is_int(n) and n >= 1):
            return None
        top = role.get("maxTaskNumber")
        total += top if _is_int(top) and top > n else n
    return total if roles else None


def _kill_all_fits_total_tasks(data: dict[str, Any]) -> Iterator[FieldError]:
    kill_all = data.get("killAllOnCompletedTaskNumber")
    total = _total_tasks(data["taskRoles"])
    if total is not None and _is_int(kill_all) and kill_all > total:
        yield FieldError(
            path="killAllOnCompletedTaskNumber",
            reason=f"must be ≤ the job's total tasks ({total}), got {kill_all}",
        )


def _job_envs_leave_muster_names(data: dict[str, Any]) -> Iterator[FieldError]:
    envs = data.get("jobEnvs")
    for key in envs if isinstance(envs, dict) else []:
        if isinstance(key, str) and key.startswith(REFUSED_ENV_PREFIXES):
            yield FieldError(
                path=f"jobEnvs.{key}", reason="names starting with MUSTER_ are set by the platform"
            )


# Checked on any config.
JOB_RULES: tuple[JobRule, ...] = (_extras_elastic_is_a_known_signal, _extras_mpi_names_its_roles)
# Checked only where taskRoles is a list (otherwise its field error is reported alone, as before).
JOB_RULES_WITH_ROLES: tuple[JobRule, ...] = (
    _roles_follow_role_rules,
    _data_targets_are_unique,
    _code_sync_gives_branch_or_commit,
    _kill_all_fits_total_tasks,
    _job_envs_leave_muster_names,
)


def _cross_field_errors(data: dict[str, Any]) -> list[FieldError]:
    """Rules that span fields, checked on the raw data so they are reported alongside field errors."""
    rules = JOB_RULES + (JOB_RULES_WITH_ROLES if isinstance(data.get("taskRoles"), list) else ())
    return [error for rule in rules for error in rule(data)]


def job_warnings(data: Any) -> list[FieldError]:
    """What an accepted config says that OpenPAI accepted but is not the contract's own form:
    each a FieldError naming the field and why (the verdict carries them; the CLI prints them).
    Never raises."""
    if not isinstance(data, dict):
        return []
    warnings: list[FieldError] = []
    roles = data.get("taskRoles")
    for i, role in enumerate(roles if isinstance(roles, list) else []):
        ports = role.get("portList") if isinstance(role, dict) else None
        for j, port in enumerate(ports if isinstance(ports, list) else []):
            begin = port.get("beginAt") if isinstance(port, dict) else None
            if isinstance(begin, str):
                warnings.append(
                    FieldError(
                        path=f"taskRoles[{i}].portList[{j}].beginAt",
                        reason=f"a number written as a string ({begin!r}): taken as {begin.strip()}, "
                        "as OpenPAI did; write it as a number",
                    )
                )
    sync = data.get("codeSync")
    url = sync.get("git") if isinstance(sync, dict) else None
    if isinstance(url, str) and shown_url(url) != url:
        warnings.append(
            FieldError(
                path="codeSync.git",
                reason="credentials in the URL are kept apart, as secret jobEnvs are, and shown "
                "as ***; a credential helper or deploy key on the nodes is safer",
            )
        )
    envs = data.get("jobEnvs")
    for key in envs if isinstance(envs, dict) else []:
        if isinstance(key, str) and key.startswith(WARNED_ENV_PREFIXES):
            warnings.append(
                FieldError(
                    path=f"jobEnvs.{key}",
                    reason="PAI_ names are the platform's: where Muster sets this name its value "
                    "wins over this one (OpenPAI's rule too)",
                )
            )
    return warnings


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


MAX_NESTING = 64  # objects and lists inside one another; real configs use under ten


def value_errors(data: Any) -> list[FieldError]:
    """What in `data` no field's own rule would catch, anywhere (`extras` takes any value):
    keys or strings that are not valid Unicode text (JSON's `\\ud800` escape decodes to a lone
    surrogate, which no UTF-8 encoder takes), NaN or infinite numbers (Python's JSON reader takes
    them, JSON has no such value, and they are written back as null), and nesting deeper than
    `MAX_NESTING` (past ~200 levels a stored record can no longer be read back, so an accepted
    job would be lost). Each is named by its path. Iterative, so any depth json.loads accepts is
    fine."""
    errors: list[FieldError] = []
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack and len(errors) < 20:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if not _encodes(value):
                errors.append(FieldError(path=path, reason="must be valid Unicode text (a lone surrogate?)"))
        elif isinstance(value, float):
            if not math.isfinite(value):
                errors.append(FieldError(path=path, reason=f"must be a finite number, got {value}"))
        elif isinstance(value, dict | list):
            if depth >= MAX_NESTING:
                errors.append(FieldError(path=path, reason=f"nested more than {MAX_NESTING} levels deep"))
                continue
            if isinstance(value, list):
                stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
                continue
            for k, v in value.items():
                key = str(k)
                if not _encodes(key):
                    key = key.encode("utf-8", "backslashreplace").decode()
                    errors.append(FieldError(path=f"{path}.{key}" if path else key, reason=_BAD_KEY))
                stack.append((v, f"{path}.{key}" if path else key, depth + 1))
    return sorted(errors, key=lambda e: e.path)


_BAD_KEY = "the field name must be valid Unicode text (a lone surrogate?)"


def _encodes(text: str) -> bool:
    try:
        text.encode()
        return True
    except UnicodeEncodeError:
        return False


def check_job(data: Any) -> tuple[JobConfig | None, list[FieldError]]:
    """Validate a decoded job config. Never raises on user input."""
    if not isinstance(data, dict):
        return None, [FieldError(path="", reason=f"a job config must be a JSON object, got {_kind(data)}")]
    # Values that could be neither stored nor read back are named at once: nothing else is
    # checked (nothing quotes text that cannot be encoded).
    bad_values = value_errors(data)
    if bad_values:
        return None, bad_values
    errors: list[FieldError] = []
    config: JobConfig | None = None
    try:
        config = JobConfig.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors(include_url=False):
            loc = tuple(err["loc"])
            # A bad key inside jobEnvs is reported by pydantic with a "[key]" suffix in loc.
            if len(loc) >= 2 and loc[-1] == "[key]":
                loc = loc[:-1]
            # A bad jobEnvs value fails every member of the scalar union, each tagged in loc.
            elif len(loc) == 3 and loc[0] == "jobEnvs" and loc[2] in _ENV_VALUE_TAGS:
                reason = f"must be a string, number or true/false, got {_show(err.get('input'))}"
                errors.append(FieldError(path=format_path(loc[:2]), reason=reason))
                continue
            errors.append(FieldError(path=format_path(loc), reason=_reason(err)))
    errors.extend(_cross_field_errors(data))
    if errors:
        return None, _dedupe(errors)
    return config, []


_ENV_VALUE_TAGS = {"str", "int", "float", "bool"}


def _dedupe(errors: list[FieldError]) -> list[FieldError]:
    seen: set[tuple[str, str]] = set()
    out = []
    for e in errors:
        if (e.path, e.reason) not in seen:
            seen.add((e.path, e.reason))
            out.append(e)
    return out


def _kind(value: Any) -> str:
    return {
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


REDACTED = "***"


GIT_SECRET = "codeSync.git"  # the secrets record's key for a git URL with credentials (no env name)


def split_secrets(config: JobConfig) -> tuple[JobConfig, dict[str, EnvValue]]:
    """The config with every secret-looking jobEnvs value (see shared/secrets.py) replaced by
    REDACTED, and a codeSync URL's credentials (`https://user:token@host/...`) cut out as in
    logs, and those values apart (the URL under GIT_SECRET): records, events and views get the
    first, only the task's node the second."""
    from muster.shared.secrets import is_secret

    hidden: dict[str, EnvValue] = {k: v for k, v in config.jobEnvs.items() if is_secret(k)}
    update: dict[str, Any] = {}
    if hidden:
        update["jobEnvs"] = {k: (REDACTED if k in hidden else v) for k, v in config.jobEnvs.items()}
    sync = config.codeSync
    if sync is not None and shown_url(sync.git) != sync.git:
        hidden[GIT_SECRET] = sync.git
        update["codeSync"] = sync.model_copy(update={"git": shown_url(sync.git)})
    return (config.model_copy(update=update) if update else config), hidden


def has_secrets(config: JobConfig) -> bool:
    """Whether `split_secrets` kept something of this (shown) config apart."""
    sync = config.codeSync
    return REDACTED in config.jobEnvs.values() or (sync is not None and f"://{REDACTED}@" in sync.git)


def with_secrets(config: JobConfig, hidden: dict[str, EnvValue]) -> JobConfig:
    """The config a task gets: REDACTED values and the codeSync URL put back."""
    if not hidden:
        return config
    envs = {k: v for k, v in hidden.items() if k != GIT_SECRET}
    update: dict[str, Any] = {"jobEnvs": {**config.jobEnvs, **envs}} if envs else {}
    url = hidden.get(GIT_SECRET)
    if isinstance(url, str) and config.codeSync is not None:
        update["codeSync"] = config.codeSync.model_copy(update={"git": url})
    return config.model_copy(update=update) if update else config
