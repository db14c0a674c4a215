"""How the `muster` command shows things: job tables and descriptions, attempts, events, logs,
metrics, virtual clusters, datasets, streams. Pure: each function takes records (or the
gateway's answers as JSON) and returns text; the commands (jobs.py, admin.py, local.py) print it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from muster.shared.trainmetrics import MetricFormat, shown

# The models (pydantic) only for types: `muster submit` imports none (docs/BENCHMARKS.md).
if TYPE_CHECKING:
    from nats.js.api import StreamConfig

    from muster.shared.jobconfig import JobConfig
    from muster.shared.messages import (
        AttemptRecord,
        Dataset,
        GpuDevice,
        JobRecord,
        TaskStatus,
        VirtualCluster,
    )

LIVE, FINISHED = ["WAITING", "RUNNING"], ["SUCCEEDED", "FAILED", "STOPPED"]
STATES = LIVE + FINISHED
HEADER = ("JOB ID", "NAME", "STATE", "USER", "VC", "TASKS", "SUBMITTED", "REASON")


# ---------------------------------------------------------------- tables


def aligned(row: Sequence[str], widths: Sequence[int]) -> str:
    """A row padded to `widths` (the last column is not padded; a wider cell pushes the rest)."""
    return ("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]).rstrip()


def columns(rows: Sequence[Sequence[str]]) -> str:
    """Rows as aligned columns; the last column is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(aligned(row, widths) for row in rows)


def indented(rows: Sequence[Sequence[str]]) -> list[str]:
    """`columns`, each line indented by two spaces (a table inside a description)."""
    return ["  " + line for line in columns(rows).splitlines()]


# ---------------------------------------------------------------- config checks


def problem(e: Any) -> str:
    """A FieldError, or a verdict's error or warning as JSON ({"path", "reason"}), as one line."""
    if isinstance(e, dict):
        return str(f"{e['path']}: {e['reason']}" if e.get("path") else e.get("reason", ""))
    return f"{e}"


def rejection(errors: Sequence[Any], source: str) -> list[str]:
    """Why a config was rejected: a count, then each error indented."""
    head = f"{source}: rejected, {len(errors)} error{'s' if len(errors) != 1 else ''}:"
    return [head, *(f"  {problem(e)}" for e in errors)]


# ---------------------------------------------------------------- jobs


def job_row(j: Mapping[str, Any]) -> tuple[str, ...]:
    """A job of the gateway's list (JSON) as a row under HEADER; a final job shows no reason."""
    final = j["state"] in FINISHED
    return (
        j["job_id"],
        j["job_name"],
        j["state"],
        j["user"],
        j["vc"],
        str(j["tasks"]),
        j["submitted_at"][:19].replace("T", " "),
        "" if final else j["reason"],
    )


def listing_note(counts: Mapping[str, int], shown: int, wanted: int, chosen: bool) -> str | None:
    """What a job list left out, by state (`counts`: every job kept, per state), or None when it
    showed all there is; `chosen`: the list was asked for by --all or --state (`wanted` of them)."""
    every = sum(counts.values()) if not chosen else wanted
    if shown >= every:
        return None
    told = ", ".join(f"{n:,} {state.lower()}" for state, n in counts.items() if n)
    if chosen:
        return f"{told}; shown: the {shown:,} newest of {wanted:,} (--limit)"
    return f"{told}; shown: the live jobs and the newest finished (--all, --state, --limit)"


def describe(r: JobRecord, history: Sequence[AttemptRecord] | None = None) -> str:
    """One job: its record, its roles, each attempt (the earlier ones with how each task ended)
    and the current attempt's tasks as a table."""
    c = r.config
    lines = [
        f"job:        {r.job_id}",
        f"name:       {r.job_name}",
        f"state:      {r.state}" + ("" if r.state.final else f" — {r.reason}"),
        f"user:       {r.user}",
        f"image:      {c.image}",
        f"submitted:  {r.submitted_at.isoformat(timespec='seconds')}",
        f"updated:    {r.updated_at.isoformat(timespec='seconds')}",
        f"retries:    {retry_text(c.retryCount)}",
        f"attempt:    {r.attempt} (retries charged {r.retries}, platform retries {r.platform_retries})",
        f"tasks:      {c.total_tasks}",
    ]
    for i, role in enumerate(c.taskRoles):
        lines.append(
            f"  [{i}] {role.name} ×{role.taskNumber}: {role.cpuNumber} CPU, {role.memoryMB} MB, "
            f"{role.gpuNumber} GPU{(' ' + c.gpuType) if c.gpuType and role.gpuNumber else ''}"
            + (f", image {role.image}" if role.image else "")
        )
    history = history or []
    if history and history[0].attempt > 1:
        lines.append(f"  (the newest {len(history)} attempts of {r.attempt}: earlier ones are not shown)")
    for a in history:
        lines.append(attempt_line(a))
        if a is not history[-1]:
            exits = ", ".join(
                f"{t.key}@{t.node} {t.state}" + ("" if t.exit_code is None else f" ({t.exit_code})")
                for t in a.tasks
            )
            lines.append(f"    tasks: {exits}")
    if history:
        rows = [("TASK", "NODE", "GPUS", "STATE", "EXIT", "REASON")]
        for t in history[-1].tasks:
            exit_code = "" if t.exit_code is None else str(t.exit_code)
            rows.append((t.key, t.node, task_gpus(t, c), str(t.state), exit_code, t.reason))
        lines += indented(rows)
    return "\n".join(line.rstrip() for line in lines)


def task_gpus(t: TaskStatus, config: JobConfig) -> str:
    """A task's GPUs: its device indexes; for part of one GPU, its share and how it is shared
    ("0.5 of 3, shared, time-sliced, not isolated")."""
    gpus = ",".join(map(str, t.gpus)) or "-"
    role = next((r for r in config.taskRoles if r.name == t.role), None)
    milli = t.gpu_milli or (role.gpu_milli if role is not None and role.shares_gpu else None)
    if milli is None or not t.gpus:
        return gpus
    how = f", {t.gpu_sharing.text}" if t.gpu_sharing is not None else ""
    return f"{milli / 1000:g} of {gpus}{how}"


def attempt_line(a: AttemptRecord) -> str:
    """One attempt: when, where, how it ended and by which rule, and whether it was charged."""
    nodes = ",".join(sorted({t.node for t in a.tasks}))
    text = f"attempt {a.attempt}: {a.placed_at:%Y-%m-%d %H:%M:%S} on {nodes}"
    if a.ended_at:
        text += f", ended {a.ended_at:%H:%M:%S} {a.outcome}: {a.rule}"
    if a.borrowed:
        text += " [borrowed capacity]"
    if a.failure:
        text += f" [{a.failure.kind} failure]"
    if a.charged is not None:
        text += " (retry charged to retryCount)" if a.charged else " (retry not charged)"
    return text


def retry_text(n: int) -> str:
    """A config's retryCount in words (-1 and -2 are OpenPAI's special values)."""
    return {-1: "retry failures without limit", -2: "always restart until killed"}.get(n, str(n))


def event_line(e: Mapping[str, Any]) -> str:
    """One event of a job's history (the gateway's `events` answer): when, what, the state after."""
    when, kind, state = e["at"][:19].replace("T", " "), e["kind"], e["state"]
    return f"{when}  {kind:<9} {state:<9} attempt {e['attempt']}  {e['detail']}"


def log_text(lines: Iterable[Sequence[str]]) -> str:
    """Output lines of tasks ([task, text] pairs, as the gateway pages them), each named."""
    return "".join(f"[{name}] {text}\n" for name, text in lines)


# ---------------------------------------------------------------- training metrics


METRICS_HEADER = f"{'TIME':<23}  {'TASK':<12}  {'STEP':>8}  {'METRIC':<20}  VALUE"


def metric_line(task: str, p: Mapping[str, Any], fmt: MetricFormat) -> str:
    """One point of a task's metric series (as the gateway pages them) under METRICS_HEADER."""
    step = "-" if p.get("step") is None else str(p["step"])
    value = shown(p["value"], fmt)
    when = str(p["t"])[:23].replace("T", " ")
    return f"{when:<23}  {task:<12}  {step:>8}  {p['name']:<20}  {value}"


def metrics_table(r: JobRecord, latest: Mapping[str, Any], now: datetime | None = None) -> str:
    """The latest value of each declared metric per task of the current attempt, and how long
    ago (before `now`, default the present) it last printed anything."""
    specs = r.config.metric_specs
    rows = [("TASK", *(s.name for s in specs), "STEP", "LAST OUTPUT")]
    now = now or datetime.now(UTC)
    for task, seen in sorted(latest.items()):
        points = {p["name"]: p for p in seen.get("latest") or [] if isinstance(p, dict)}
        values = tuple(shown(points[s.name]["value"], s.format) if s.name in points else "-" for s in specs)
        steps = [p["step"] for p in points.values() if p.get("step") is not None]
        last = seen.get("last_output_at")
        ago = f"{(now - datetime.fromisoformat(last)).total_seconds():.0f}s ago" if last else "-"
        rows.append((task, *values, str(max(steps)) if steps else "-", ago))
    return f"metrics (attempt {r.attempt}):\n" + "\n".join(indented(rows))


# ---------------------------------------------------------------- cluster


def vc_usage_rows(vcs: Iterable[Mapping[str, Any]]) -> list[tuple[str, ...]]:
    """`muster vc`: the gateway's `vcs` answer as a table."""
    table: list[tuple[str, ...]] = [("VC", "QUOTA", "USED", "BORROWED", "RUNNING", "WAITING")]
    for r in vcs:
        table.append((r["name"], r["quota"], r["used"], r["borrowed"], str(r["running"]), str(r["waiting"])))
    return table


def vc_quota_text(vc: VirtualCluster) -> str:
    """A VC's quota: GPUs per model (or 0 GPUs), then CPUs and memory where it limits them."""
    q = vc.quota
    parts = [",".join(f"{n}x{m}" for m, n in q.gpus.items()) if q.gpus else "0 GPUs"]
    if q.cpus is not None:
        parts.append(f"{q.cpus} CPUs")
    if q.memory_mb is not None:
        parts.append(f"{q.memory_mb} MB")
    return ", ".join(parts)


def vc_row(vc: VirtualCluster) -> tuple[str, ...]:
    """A VC record as a row of `muster admin vc list`."""
    return (
        vc.name,
        vc_quota_text(vc),
        ",".join(vc.users),
        vc.max_priority,
        "yes" if vc.borrow else "no",
    )


def dataset_row(ds: Dataset) -> tuple[str, ...]:
    """A dataset record as a row of `muster admin dataset list`."""
    writable = "yes" if ds.writable else "no"
    return (ds.name, ds.source, writable, ",".join(ds.users), ds.description or "-")


def undecodable_row(key: str) -> tuple[str, ...]:
    """A row of an admin list for a key whose record does not decode (or names another key)."""
    return (key, "(does not decode: ignored)", "-", "-", "-")


def stream_rows(configs: Iterable[StreamConfig]) -> list[tuple[str, ...]]:
    """Muster's streams and buckets (of all the server's streams), by name, with their replicas
    and size limit (`-`: none)."""
    rows: list[tuple[str, ...]] = [("STREAM", "REPLICAS", "MAX BYTES")]
    for c in sorted(configs, key=lambda c: c.name or ""):
        if c.name and c.name.startswith(("MUSTER_", "KV_muster_")):
            rows.append((c.name, str(c.num_replicas), str(c.max_bytes) if (c.max_bytes or -1) > 0 else "-"))
    return rows


def gpu_text(gpus: Iterable[GpuDevice]) -> str:
    """GPUs as counts per model (2xA100,1xT4), or `none`."""
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g.model] = counts.get(g.model, 0) + 1
    return ",".join(f"{n}x{m}" for m, n in counts.items()) or "none"
