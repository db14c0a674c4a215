"""The `muster` command: up, submit, status, kill, drain, logs, metrics, validate, admin (init,
user, keys, vc, dataset).

Exit codes: 0 success; 1 the job did not succeed (`submit --wait`) or an operational failure
(bus unreachable, Muster not set up on it); 2 the config was rejected, the job can never run
(`submit --wait`), or the command line is wrong (a bad argument, no such job or task);
141 the reader of the output went away (`muster status | head`).

Only services (and `muster admin init`) declare streams and buckets; every other command only
looks them up, so one user's environment can never reshape the cluster's settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import nats.errors
from nats.aio.client import Client as NATS
from nats.js.errors import NotFoundError

from services.agent.args import add_agent_arguments
from shared import auth, bus, client, logs, subjects
from shared.loader import MAX_CONFIG_BYTES, ConfigSyntaxError, loads
from shared.subjects import Headers

# The models (pydantic) are imported where a command needs them, not here: `muster submit`
# needs none, and importing them is most of a start-up otherwise (docs/BENCHMARKS.md).
if TYPE_CHECKING:
    from nats.js.kv import KeyValue

    from services.agent.sim import SimSetup
    from services.cli.mesh import Found
    from shared.messages import AttemptRecord, JobRecord, VirtualCluster

EXIT_OK, EXIT_FAIL, EXIT_INVALID = 0, 1, 2


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_FAIL):
        super().__init__(message)
        self.code = code


def out(line: str = "") -> None:
    print(line, flush=True)


def err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- validate


def read_config(path: str) -> tuple[bytes, Any]:
    """Read and decode a config file; raises CliError(2) on unreadable or undecodable input."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as exc:
        raise CliError(f"{path}: {exc.strerror or exc}", EXIT_INVALID) from None
    try:
        return data, loads(data, path)
    except ConfigSyntaxError as exc:
        raise CliError(f"{path}: {exc}", EXIT_INVALID) from None


def print_errors(errors: list[Any], source: str) -> None:
    """`errors`: FieldErrors, or a verdict's as JSON ({"path", "reason"}), printed alike."""
    err(f"{source}: rejected, {len(errors)} error{'s' if len(errors) != 1 else ''}:")
    for e in errors:
        if isinstance(e, dict):
            e = f"{e['path']}: {e['reason']}" if e.get("path") else e.get("reason", "")
        err(f"  {e}")


def print_warnings(warnings: list[Any], source: str) -> None:
    """An accepted config's warnings (FieldErrors or a verdict's JSON), on stderr."""
    for w in warnings:
        if isinstance(w, dict):
            w = f"{w['path']}: {w['reason']}" if w.get("path") else w.get("reason", "")
        err(f"{source}: warning: {w}")


def cmd_validate(args: argparse.Namespace) -> int:
    from shared.jobconfig import check_job, job_warnings

    _, raw = read_config(args.file)
    config, errors = check_job(raw)
    if errors:
        print_errors(errors, args.file)
        return EXIT_INVALID
    assert config is not None
    print_warnings(job_warnings(raw), args.file)
    out(
        f"{args.file}: valid — job {config.jobName!r}, "
        f"{config.total_tasks} tasks in {len(config.taskRoles)} roles"
    )
    return EXIT_OK


# ---------------------------------------------------------------- bus helpers


def locate() -> Found:
    """The mesh this command goes to (services/cli/mesh.py `find_mesh`): MUSTER_NATS_URL, else
    the `muster up` started in this directory or above it, one starting there, or the only one
    running. Once found, MUSTER_NATS_URL names it for the rest of the command."""
    from services.cli.mesh import MeshError, find_mesh

    try:
        found = find_mesh()
    except MeshError as exc:
        raise CliError(str(exc)) from None
    if found.note is not None and not os.environ.get("MUSTER_NATS_URL"):
        os.environ["MUSTER_NATS_URL"] = str(found.note["url"])
    return found


class Patience:
    """A command's wait for the bus: `timeout` seconds from its start, or from the last moment
    the mesh it goes to was seen starting (a `muster up` beside it), up to mesh.START_WAIT in all
    (or `timeout`, if longer)."""

    def __init__(self, timeout: float):
        from services.cli.mesh import START_WAIT

        self.loop = asyncio.get_running_loop()
        self.timeout = timeout
        self.started = self.loop.time()
        self.deadline = self.started + timeout
        self.cap = self.started + max(timeout, START_WAIT)
        self.starting: str | None = None  # the last mesh seen starting, for messages
        self.told = False

    def left(self, found: Found) -> float:
        now = self.loop.time()
        if found.starting:
            self.starting = found.starting
            self.deadline = max(self.deadline, min(self.cap, now + self.timeout))
            if not self.told and now - self.started > 2.0:
                err(f"muster: waiting for {found.starting} (up to {self.cap - self.started:.0f}s)")
                self.told = True
        return self.deadline - now

    def waited(self) -> str:
        return f"{self.loop.time() - self.started:.1f}s"


def _real_wait(text: str, waited: str) -> str:
    """bus.connect's words with the whole wait instead of its last try's bound."""
    return re.sub(r" within [0-9.e+-]+s", f" within {waited}", text, count=1)


async def connect_bus(timeout: float) -> tuple[NATS, Patience]:
    """Connect to the mesh this command goes to (`locate`) as MUSTER_CREDENTIALS or that mesh's
    local admin identity, within `timeout` seconds (more while that mesh is starting)."""
    wait = Patience(timeout)
    while True:
        found = locate()
        left = wait.left(found)
        url = found.url
        if url is None:  # a `muster up` here that has not said where it listens yet
            if left <= 0:
                raise CliError(f"{found.starting} has not said where it listens within {wait.waited()}")
            await asyncio.sleep(0.1)
            continue
        creds = found.credentials()
        try_for = max(0.1, left)
        if found.starting or (creds is None and not os.environ.get(auth.CREDENTIALS_ENV)):
            try_for = min(try_for, 1.0)  # look at the notes again soon
        try:
            nc = await bus.connect("muster-cli", url, connect_timeout=try_for, quiet=True, credentials=creds)
            return nc, wait
        except ConnectionError as exc:
            if wait.left(found) > 0.1:
                await asyncio.sleep(0.1)
                continue
            why = _real_wait(str(exc), wait.waited())
            if wait.starting and not found.starting:
                why += f"; {wait.starting} stopped (see its output)"
            raise CliError(f"{why} (is `muster up` running? set MUSTER_NATS_URL to join another)") from None


async def connect(timeout: float) -> NATS:
    """`connect_bus`, then check that Muster answers there, within the same wait in all (a
    `muster up` started a moment ago gets until it is ready, up to mesh.START_WAIT)."""
    nc, wait = await connect_bus(timeout)
    while True:
        try:
            await client.ask(nc, "ping", timeout=max(0.5, min(2.0, wait.left(locate()))))
            return nc
        except client.Refused as exc:
            await nc.close()
            raise CliError(str(exc)) from None
        except TimeoutError as exc:
            if wait.left(locate()) <= 0:
                why = f"Muster does not answer on {bus.shown(bus.nats_url())} within {wait.waited()}"
                if "no gateway answers" in str(exc):
                    why += f": {exc}"
                if client.asker(nc) == subjects.ALL:  # may look: say what is missing, if anything
                    try:
                        await bus.open_jetstream(nc)
                    except bus.NotSetUp as missing:
                        why = str(missing)
                    except Exception:
                        pass
                await nc.close()
                raise CliError(why) from None
            await asyncio.sleep(0.25)


async def ask(nc: NATS, verb: str, **request: Any) -> dict[str, Any]:
    try:
        return await client.ask(nc, verb, request)
    except client.Refused as exc:
        raise CliError(str(exc), exc.code) from None


async def resolve(nc: NATS, ref: str) -> JobRecord:
    """A job by id, else by name (the most recent job holding that name), that we may see."""
    from shared.messages import JobRecord

    return JobRecord.model_validate((await ask(nc, "job", ref=ref))["job"])


async def job_and_attempts(nc: NATS, ref: str) -> tuple[JobRecord, list[AttemptRecord]]:
    return job_of(await ask(nc, "job", ref=ref))


def job_of(answer: dict[str, Any]) -> tuple[JobRecord, list[AttemptRecord]]:
    from shared.messages import AttemptRecord, JobRecord

    return JobRecord.model_validate(answer["job"]), [
        AttemptRecord.model_validate(a) for a in answer["attempts"]
    ]


def _safe_key(key: str) -> bool:
    return bool(re.fullmatch(r"[-/_=.a-zA-Z0-9]+", key))


# ---------------------------------------------------------------- submit


LOCAL_DIR_FIELDS = ("dataDir", "codeDir", "outputDir", "authFile")


def absolutize(raw: Any, base: Path) -> bool:
    """Dir fields written relative to the config file (`./code`) become absolute paths on this
    machine, so a config next to its code works from any directory. Returns whether any did."""
    if not isinstance(raw, dict):
        return False
    changed = False
    for key in LOCAL_DIR_FIELDS:
        value = raw.get(key)
        if isinstance(value, str) and (value == "." or value.startswith("./")):
            raw[key] = str((base / value).resolve())
            changed = True
    return changed


async def submit(args: argparse.Namespace) -> int:
    data, raw = read_config(args.file)
    if args.file != "-" and absolutize(raw, Path(os.path.abspath(args.file)).parent):  # noqa: ASYNC240
        data = json.dumps(raw).encode()
    if len(data) > MAX_CONFIG_BYTES:
        raise CliError(f"{args.file}: {len(data)} bytes; the limit is 1 MiB", EXIT_INVALID)
    loop = asyncio.get_running_loop()
    give_up = math.inf if args.timeout is None else loop.time() + args.timeout
    nc = await connect(args.connect_timeout)
    try:
        verdict_wait = min(args.verdict_timeout, max(0.0, give_up - loop.time()))
        sid, verdict = await client.submit_json(nc, data, timeout=verdict_wait)
        if verdict is None:
            err(
                f"submitted (submission {sid}) but no validator answered within {verdict_wait:g}s; "
                "it stays queued until one runs"
            )
            return EXIT_FAIL
        if args.json:
            out(json.dumps(verdict, indent=2, ensure_ascii=False))
        if not verdict["accepted"]:
            if not args.json:
                print_errors(verdict.get("errors") or [], args.file)
            return EXIT_INVALID
        if not args.json:
            print_warnings(verdict.get("warnings") or [], args.file)
            out(f"{verdict['job_id']}  {verdict['job_name']}  accepted")
        if not args.wait:
            return EXIT_OK
        return await follow(nc, str(verdict["job_id"]), quiet=args.json, give_up=give_up)
    finally:
        await nc.close()


async def follow(nc: NATS, job_id: str, quiet: bool = False, give_up: float = math.inf) -> int:
    """Print each change of the job's state until it is final: exit 0 only if it SUCCEEDED.
    Exit 2 once the scheduler has said for MUSTER_NODE_TIMEOUT that no node can ever fit it
    (an agent that is just starting gets that long to join); give up at loop time `give_up`."""
    from shared.messages import JobState

    loop = asyncio.get_running_loop()
    record, last, never = None, None, math.inf  # never: when "unschedulable" becomes the answer
    while (now := loop.time()) < min(give_up, never):
        try:
            record = await resolve(nc, job_id)
        except TimeoutError:  # the gateway is away for a moment: ask again
            await asyncio.sleep(0.5)
            continue
        shown = (record.state, record.reason)
        if shown != last and not quiet:
            out(f"{record.job_id}  {record.state:<9}  {record.reason}")
        last = shown
        if record.state.final:
            if quiet:
                out(record.model_dump_json(indent=2))
            return EXIT_OK if record.state == JobState.SUCCEEDED else EXIT_FAIL
        never = min(never, loop.time() + bus.node_timeout()) if record.unschedulable else math.inf
        await asyncio.sleep(max(0.0, min(0.25, min(give_up, never) - now)))
    if quiet and record:
        out(record.model_dump_json(indent=2))
    if record and loop.time() >= never:
        raise CliError(
            f"{job_id} is unschedulable: {record.reason} (it stays WAITING for a node that fits; "
            f"`muster kill {job_id}` drops it)",
            EXIT_INVALID,
        )
    state = record.state if record else "unknown"
    raise CliError(f"{job_id}: still {state} when --timeout ran out; it goes on (`muster status {job_id}`)")


# ---------------------------------------------------------------- status


async def status(args: argparse.Namespace) -> int:
    nc = await connect(args.connect_timeout)
    try:
        if args.job:
            answer = await ask(nc, "job", ref=args.job)
            record, history = job_of(answer)
            latest = answer.get("metrics") or {}
            if args.json:
                doc = record.model_dump(mode="json")
                doc["attempts"] = [a.model_dump(mode="json") for a in history]
                if latest:
                    doc["metrics"] = latest
                out(json.dumps(doc, indent=2))
            else:
                out(describe(record, history))
                if latest:
                    out(metrics_table(record, latest))
            if args.events:
                after = 0
                while True:
                    page = await ask(nc, "events", job_id=record.job_id, after=after)
                    for e in page["events"]:
                        when, kind, state = e["at"][:19].replace("T", " "), e["kind"], e["state"]
                        out(f"{when}  {kind:<9} {state:<9} attempt {e['attempt']}  {e['detail']}")
                    after = page["last"]
                    if not page["more"]:
                        break
            return EXIT_OK
        return await list_jobs(nc, args)
    finally:
        await nc.close()


LIVE, FINISHED = ["WAITING", "RUNNING"], ["SUCCEEDED", "FAILED", "STOPPED"]
STATES = LIVE + FINISHED
RECENT = 20  # finished jobs `muster status` shows by default
HEADER = ("JOB ID", "NAME", "STATE", "USER", "VC", "TASKS", "SUBMITTED", "REASON")


async def list_jobs(nc: NATS, args: argparse.Namespace) -> int:
    """Jobs newest first, as the gateway pages them: by default every live job, then the most
    recent finished ones; `--all` or `--state` instead. Filtered, at most `--limit`; each page
    printed as it comes (`--json`: as the gateway answered it, one line each)."""
    filters = {"user": args.user, "vc": args.vc, "name": args.name, "since": args.since}
    chosen = bool(args.all or args.state)
    parts = [(args.state or STATES, args.limit)] if chosen else [(LIVE, None), (FINISHED, RECENT)]
    widths: list[int] | None = None
    counts: dict[str, int] = {}
    shown = wanted = 0
    for states, most in parts:
        if args.limit is not None:
            left = args.limit - shown
            most = left if most is None else min(most, left)
            if most <= 0:
                break
        async for page in client.job_pages(nc, most, state=states, **filters):
            if "total" in page:  # the first page of a part
                counts = counts or page["counts"]
                wanted += page["total"]
            shown += len(page["jobs"])
            if args.json:
                out(json.dumps(page))
                continue
            rows = [job_row(j) for j in page["jobs"]]
            if rows and widths is None:
                widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER) - 1)]
                out(aligned(HEADER, widths))
            for row in rows:
                out(aligned(row, widths or []))
    if args.json:
        return EXIT_OK
    if widths is None:
        out("no jobs")
    every = sum(counts.values()) if not chosen else wanted
    if shown < every:
        told = ", ".join(f"{n:,} {state.lower()}" for state, n in counts.items() if n)
        if chosen:
            err(f"muster: {told}; shown: the {shown:,} newest of {wanted:,} (--limit)")
        else:
            err(f"muster: {told}; shown: the live jobs and the newest finished (--all, --state, --limit)")
    return EXIT_OK


def job_row(j: dict[str, Any]) -> tuple[str, ...]:
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


def aligned(row: tuple[str, ...], widths: list[int]) -> str:
    """A row padded to `widths` (the last column is not padded; a wider cell pushes the rest)."""
    return ("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]).rstrip()


def columns(rows: list[tuple[str, ...]]) -> str:
    """Rows as aligned columns; the last column is not padded."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        ("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]).rstrip()
        for row in rows
    )


def describe(r: JobRecord, history: list[AttemptRecord] | None = None) -> str:
    c = r.config
    lines = [
        f"job:        {r.job_id}",
        f"name:       {r.job_name}",
        f"state:      {r.state}" + ("" if r.state.final else f" — {r.reason}"),
        f"user:       {r.user}",
        f"image:      {c.image}",
        f"submitted:  {r.submitted_at.isoformat(timespec='seconds')}",
        f"updated:    {r.updated_at.isoformat(timespec='seconds')}",
        f"retries:    {_retry_text(c.retryCount)}",
        f"attempt:    {r.attempt} (retries charged {r.retries}, platform retries {r.platform_retries})",
        f"tasks:      {c.total_tasks}",
    ]
    for i, role in enumerate(c.taskRoles):
        lines.append(
            f"  [{i}] {role.name} ×{role.taskNumber}: {role.cpuNumber} CPU, {role.memoryMB} MB, "
            f"{role.gpuNumber} GPU{(' ' + c.gpuType) if c.gpuType and role.gpuNumber else ''}"
            + (f", image {role.image}" if role.image else "")
        )
    for a in history or []:
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
            rows.append((t.key, t.node, ",".join(map(str, t.gpus)) or "-", str(t.state), exit_code, t.reason))
        lines += ["  " + line for line in columns(rows).splitlines()]
    return "\n".join(line.rstrip() for line in lines)


def metrics_table(r: JobRecord, latest: dict[str, Any]) -> str:
    """The latest value of each declared metric per task of the current attempt, and how long
    ago it last printed anything."""
    from datetime import UTC, datetime

    from shared.trainmetrics import shown

    specs = r.config.metric_specs
    rows = [("TASK", *(s.name for s in specs), "STEP", "LAST OUTPUT")]
    now = datetime.now(UTC)
    for task, seen in sorted(latest.items()):
        points = {p["name"]: p for p in seen.get("latest") or [] if isinstance(p, dict)}
        values = tuple(shown(points[s.name]["value"], s.format) if s.name in points else "-" for s in specs)
        steps = [p["step"] for p in points.values() if p.get("step") is not None]
        last = seen.get("last_output_at")
        ago = f"{(now - datetime.fromisoformat(last)).total_seconds():.0f}s ago" if last else "-"
        rows.append((task, *values, str(max(steps)) if steps else "-", ago))
    return f"metrics (attempt {r.attempt}):\n" + "\n".join("  " + line for line in columns(rows).splitlines())


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


def _retry_text(n: int) -> str:
    return {-1: "retry failures without limit", -2: "always restart until killed"}.get(n, str(n))


# ---------------------------------------------------------------- vc


async def vc_status(args: argparse.Namespace) -> int:
    """Every virtual cluster, from the gateway: quota, used (and borrowed beyond the quota),
    jobs running and waiting (docs/sharing.md)."""
    nc = await connect(args.connect_timeout)
    try:
        rows = (await ask(nc, "vcs"))["vcs"]
    finally:
        await nc.close()
    if args.json:
        out(json.dumps(rows, indent=2))
        return EXIT_OK
    table = [("VC", "QUOTA", "USED", "BORROWED", "RUNNING", "WAITING")]
    for r in rows:
        table.append((r["name"], r["quota"], r["used"], r["borrowed"], str(r["running"]), str(r["waiting"])))
    out(columns(table))
    return EXIT_OK


# ---------------------------------------------------------------- kill


async def kill(args: argparse.Namespace) -> int:
    from shared.messages import JobState, KillRequest

    nc = await connect(args.connect_timeout)
    try:
        record = await resolve(nc, args.job)
        if record.state.final:
            out(f"{record.job_id}  {record.state}: already ended ({record.reason})")
            return EXIT_OK
        # Sent as the job's owner: a user can only send as itself, an admin as anyone.
        request = KillRequest(job_id=record.job_id, user=client.submitter(nc), grace=args.grace)
        await nc.jetstream(timeout=10).publish(
            subjects.kill_request(record.user),
            request.to_bytes(),
            headers={Headers.MSG_ID: f"kill:{record.job_id}"},
        )
        if args.no_wait:
            out(f"{record.job_id}  kill requested")
            return EXIT_OK
        loop = asyncio.get_running_loop()
        started, deadline = loop.time(), loop.time() + args.grace + 30
        alive: list[str] = []
        while loop.time() < deadline:
            record, history = await job_and_attempts(nc, record.job_id)
            attempt = history[-1] if history and history[-1].attempt == record.attempt else None
            alive = [t.key for t in attempt.tasks if not t.state.ended] if attempt else []
            if record.state.final and not alive:
                took = loop.time() - started
                out(f"{record.job_id}  {record.state}: {record.reason} ({took:.1f}s)")
                return EXIT_OK if record.state == JobState.STOPPED else EXIT_FAIL
            await asyncio.sleep(0.2)
        raise CliError(f"{record.job_id}: still {record.state}; tasks not stopped yet: {', '.join(alive)}")
    finally:
        await nc.close()


# ---------------------------------------------------------------- drain


async def drain(args: argparse.Namespace) -> int:
    """Stop every task on a node on purpose (they are retried elsewhere) and keep new work off
    it, or with --undo let it take work again; waits until the node's agent has done it."""
    from shared.messages import DrainOrder, NodeInfo

    nc = await connect(args.connect_timeout)
    try:
        if client.asker(nc) != subjects.ALL:
            raise CliError("draining a node takes an admin identity")
        js = nc.jetstream(timeout=10)
        try:
            from shared.store import Store  # only here: it brings the metrics library

            nodes = Store(await js.key_value(subjects.NODES_BUCKET), NodeInfo)
        except NotFoundError:
            raise CliError("no nodes yet") from None
        if not _safe_key(args.node) or await nodes.get(args.node) is None:
            raise CliError(f"no node {args.node!r}", EXIT_INVALID)
        order = DrainOrder(node=args.node, undo=args.undo, grace=args.grace, by=client.submitter(nc))
        await js.publish(subjects.drain(args.node), order.to_bytes())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.grace + 30
        while loop.time() < deadline:
            info = await nodes.get(args.node)
            if info is not None and info.drained == (not args.undo):
                out(f"{args.node}  {'drained' if info.drained else 'takes work again'}")
                return EXIT_OK
            await asyncio.sleep(0.2)
        raise CliError(f"{args.node}: its agent did not answer (is it running?); the order waits for it")
    finally:
        await nc.close()


# ---------------------------------------------------------------- logs


async def show_logs(args: argparse.Namespace) -> int:
    """A job's output, page by page as the gateway reads it from the stream (no model is
    imported: its first lines come as soon as the first page does)."""
    nc = await connect(args.connect_timeout)
    try:
        job = (await ask(nc, "job", ref=args.job))["job"]
        attempt = _attempt_and_task(job, args)

        def show(lines: list[Any]) -> None:
            if lines:
                sys.stdout.write("".join(f"[{name}] {text}\n" for name, text in lines))
                sys.stdout.flush()

        await _pages(nc, "logs", "lines", job["job_id"], attempt, args, show)
        return EXIT_OK
    finally:
        await nc.close()


async def show_metrics(args: argparse.Namespace) -> int:
    """The series of a job's training metrics (its `metrics`), as `logs` prints its output."""
    from shared.trainmetrics import MetricFormat, shown

    nc = await connect(args.connect_timeout)
    try:
        from shared.messages import JobRecord

        job = (await ask(nc, "job", ref=args.job))["job"]
        record = JobRecord.model_validate(job)
        if not record.config.metrics:
            raise CliError(f"job {record.job_id} declares no metrics (its config's `metrics`)", EXIT_INVALID)
        attempt = _attempt_and_task(job, args)
        formats = {s.name: s.format for s in record.config.metric_specs}
        if not args.json:
            out(f"{'TIME':<23}  {'TASK':<12}  {'STEP':>8}  {'METRIC':<20}  VALUE")

        def show(batches: list[Any]) -> None:
            for batch in batches:
                for p in batch["points"]:
                    if args.json:
                        out(json.dumps({"task": batch["task"], "attempt": attempt, **p}))
                        continue
                    step = "-" if p.get("step") is None else str(p["step"])
                    value = shown(p["value"], formats.get(p["name"], MetricFormat.RAW))
                    when = str(p["t"])[:23].replace("T", " ")
                    out(f"{when:<23}  {batch['task']:<12}  {step:>8}  {p['name']:<20}  {value}")
                if batch.get("dropped") and not args.json:
                    err(f"muster: {batch['dropped']} points of {batch['task']} thinned out (too fast)")

        await _pages(nc, "metrics", "batches", record.job_id, attempt, args, show)
        return EXIT_OK
    finally:
        await nc.close()


async def _pages(
    nc: Any, verb: str, items: str, job_id: str, attempt: int, args: argparse.Namespace, show: Any
) -> None:
    """Page through the gateway's answers to `verb` (logs, metrics) for one attempt, handing each
    page's `items` to `show`; with `--follow`, until the job has ended and nothing more comes."""
    after = 0
    while True:
        page = await ask(nc, verb, job_id=job_id, attempt=attempt, task=args.task or "", after=after)
        show(page[items])
        after = page["last"]
        if page["more"]:
            continue
        if not args.follow or (page["final"] and not page[items]):
            return
        await asyncio.sleep(0.5)


def _attempt_and_task(job: dict[str, Any], args: argparse.Namespace) -> int:
    """The attempt `--attempt` names (default: the current one) of a job (as the gateway
    answers it), with `--task` checked."""
    role, _, index = (args.task or "*.*").partition(".")
    sizes = {r["name"]: r["taskNumber"] for r in job["config"]["taskRoles"]}
    job_id, current = job["job_id"], job["attempt"]
    if args.task and (role not in sizes or (index and int(index) >= sizes[role])):
        tasks = ", ".join(f"{r}.0-{n - 1}" if n > 1 else f"{r}.0" for r, n in sizes.items())
        raise CliError(f"job {job_id} has no task {args.task}; its tasks: {tasks}", EXIT_INVALID)
    if args.attempt and args.attempt > current:
        has = f"its attempts: 1-{current}" if current else "it has not started yet"
        raise CliError(f"job {job_id} has no attempt {args.attempt}; {has}", EXIT_INVALID)
    attempt: int = args.attempt or current
    if attempt == 0:
        raise CliError(f"job {job_id} has not started yet: {job['reason']}")
    return attempt


# ---------------------------------------------------------------- admin


async def admin_init(args: argparse.Namespace) -> int:
    """Declare or update every stream and bucket from this shell's settings (MUSTER_JS_REPLICAS,
    MUSTER_LOGS_MAX_BYTES): the one client path that shapes them; services do it at start."""
    nc, _ = await connect_bus(args.connect_timeout)
    try:
        js, _ = await bus.ensure_jetstream(nc)
        rows = [("STREAM", "REPLICAS", "MAX BYTES")]
        for info in sorted(await js.streams_info(), key=lambda i: i.config.name):
            c = info.config
            if c.name.startswith(("MUSTER_", "KV_muster_")):
                rows.append(
                    (c.name, str(c.num_replicas), str(c.max_bytes) if (c.max_bytes or -1) > 0 else "-")
                )
        out(columns(rows))
        return EXIT_OK
    finally:
        await nc.close()


def auth_dir_of(args: argparse.Namespace) -> auth.AuthDir:
    """--auth-dir, MUSTER_AUTH_DIR, the auth dir of the mesh this command goes to, or the default
    data dir's."""
    from services.cli.mesh import default_data_dir

    path = args.auth_dir or os.environ.get("MUSTER_AUTH_DIR") or (locate().note or {}).get("auth_dir")
    return auth.AuthDir(path or default_data_dir() / "auth")


def admin_user(args: argparse.Namespace) -> int:
    """Identities in an auth dir; the server of the local `muster up` using it reloads."""
    keys = auth_dir_of(args)
    if args.action == "list":
        rows = [("NAME", "ROLE", "NODE", "PUBLIC KEY")]
        rows += [(i.name, i.role, i.node or "-", i.nkey) for i in keys.identities()]
        out(columns(rows))
        return EXIT_OK
    if not args.name:
        raise CliError(f"admin user {args.action}: name the identity", EXIT_INVALID)
    try:
        if args.action == "remove":
            keys.remove(args.name)
            done = f"removed {args.name}"
        else:
            known = keys.get(args.name)
            if args.action == "rotate":
                if known is None:
                    raise auth.AuthError(f"no identity {args.name!r}")
                creds = keys.add(args.name, known.role, known.node, replace=True)
            else:
                creds = keys.add(args.name, "admin" if args.admin else "user")
            path = keys.creds(args.name)
            done = f"{args.name} ({creds.role}): credentials in {path} (use with MUSTER_CREDENTIALS={path})"
    except auth.AuthError as exc:
        raise CliError(str(exc), EXIT_INVALID) from None
    out(done)
    from services.cli.mesh import running

    here = keys.path.resolve()
    # The local `muster up` whose server uses this auth dir, if any.
    note = next((n for n in running() if n.get("auth_dir") and Path(n["auth_dir"]).resolve() == here), {})
    if note.get("pid"):
        try:
            os.kill(int(note["pid"]), signal.SIGHUP)
            out("the local NATS server reloaded its identities")
        except OSError as exc:
            err(f"could not signal the local NATS server ({exc.strerror}); reload it to apply")
    else:
        out(f"reload every NATS server using {keys.server_config} (nats-server --signal reload) to apply")
    return EXIT_OK


def admin_keys(args: argparse.Namespace) -> int:
    keys = auth.AuthDir(args.auth_dir)
    try:
        keys.ensure_services()
        for node in args.node:
            keys.ensure(auth.agent_name(node), "agent", node)
        if args.sim:
            keys.ensure(auth.SIM_IDENTITY, "sim")
        keys.ensure(args.admin_name, "admin")
    except auth.AuthError as exc:
        raise CliError(str(exc), EXIT_INVALID) from None
    out(str(keys.server_config))
    return EXIT_OK


# ---------------------------------------------------------------- admin vc

VC_FLAGS = {  # a VirtualCluster field -> the flag that sets it
    "name": "NAME",
    "quota.gpus": "--gpus",
    "quota.cpus": "--cpus",
    "quota.memory_mb": "--memory-mb",
    "users": "--users",
    "max_priority": "--max-priority",
    "borrow": "--no-borrow",
}


def vc_record(args: argparse.Namespace) -> VirtualCluster:
    """The record `muster admin vc set` writes (the whole record: a flag left out takes its
    default); a bad value is a CliError(2) naming its flag."""
    from pydantic import ValidationError

    from services.agent.inventory import parse_gpus
    from shared.jobconfig import _reason, format_path
    from shared.messages import VirtualCluster

    gpus: dict[str, int] = {}
    if args.gpus is not None:
        try:
            devices = parse_gpus(args.gpus)
        except ValueError as exc:
            raise CliError(f"--gpus {args.gpus!r}: {exc}", EXIT_INVALID) from None
        for d in devices:
            gpus[d.model] = gpus.get(d.model, 0) + 1
    users = [u.strip() for u in args.users.split(",") if u.strip()]
    if not users:
        raise CliError(f"--users {args.users!r}: name at least one user, or '*' for everyone", EXIT_INVALID)
    for u in users:
        if u != "*" and not auth.NAME_RE.match(u):
            raise CliError(
                f"--users {args.users!r}: {u!r} is not a user name (letters, digits, '_', '-'; "
                "or '*' for everyone)",
                EXIT_INVALID,
            )
    quota = {"gpus": gpus, "cpus": args.cpus, "memory_mb": args.memory_mb}
    try:
        return VirtualCluster.model_validate(
            {
                "name": args.name,
                "quota": quota,
                "users": users,
                "max_priority": args.max_priority,
                "borrow": not args.no_borrow,
            }
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = tuple(first["loc"])
        field = format_path(loc[:2] if loc[0] == "quota" else loc[:1])
        raise CliError(f"{VC_FLAGS.get(field, field)}: {_reason(first)}", EXIT_INVALID) from None


def vc_quota_text(vc: VirtualCluster) -> str:
    q = vc.quota
    parts = [",".join(f"{n}x{m}" for m, n in q.gpus.items()) if q.gpus else "0 GPUs"]
    if q.cpus is not None:
        parts.append(f"{q.cpus} CPUs")
    if q.memory_mb is not None:
        parts.append(f"{q.memory_mb} MB")
    return ", ".join(parts)


async def named_records(kv: Any, model: Any) -> tuple[list[str], dict[str, Any]]:
    """The keys of an admin bucket of named records (virtual clusters, datasets) and each one's
    record, None where it does not decode or names another key; keys removed meanwhile are left out."""
    from nats.js.errors import KeyNotFoundError, NoKeysError

    try:
        keys = await kv.keys()
    except NoKeysError:
        keys = []
    found: dict[str, Any] = {}
    for key in keys:
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            continue  # removed in between
        try:
            record = model.model_validate_json(entry.value or b"")
        except ValueError:  # pydantic's ValidationError is one
            record = None
        found[key] = record if record is not None and getattr(record, "name", None) == key else None
    return list(found), found


def vc_row(vc: VirtualCluster) -> tuple[str, ...]:
    return (
        vc.name,
        vc_quota_text(vc),
        ",".join(vc.users),
        vc.max_priority,
        "yes" if vc.borrow else "no",
    )


async def vc_bucket(nc: NATS) -> KeyValue:
    """The VCs bucket, as an admin (the server lets no one else write it)."""
    if client.asker(nc) != subjects.ALL:
        raise CliError("managing virtual clusters takes an admin identity")
    try:
        return await nc.jetstream(timeout=10).key_value(subjects.VCS_BUCKET)
    except NotFoundError:
        raise CliError(
            f"bucket {subjects.VCS_BUCKET} is missing on this NATS: run `muster admin init`"
        ) from None


async def admin_vc(args: argparse.Namespace) -> int:
    """`muster admin vc set|remove|list`: the virtual clusters in bucket muster_vcs. The
    validators watch it: a change applies to the next submission, no restart."""
    from nats.js.errors import KeyNotFoundError

    from shared.messages import VirtualCluster

    if args.action != "list" and not auth.NAME_RE.match(args.name):  # the same as a VC name's
        raise CliError(
            f"NAME {args.name!r}: a virtual cluster's name starts with a letter or digit and has "
            "only letters, digits, '_' and '-' (64 at most)",
            EXIT_INVALID,
        )
    record = vc_record(args) if args.action == "set" else None  # refused before connecting
    nc = await connect(args.connect_timeout)
    try:
        kv = await vc_bucket(nc)
        if record is not None:
            await kv.put(record.name, record.to_bytes())
            out(
                f"{record.name}: set — quota {vc_quota_text(record)}; users {','.join(record.users)}; "
                f"max priority {record.max_priority}; {'may' if record.borrow else 'may not'} borrow"
            )
            return EXIT_OK
        if args.action == "remove":
            try:
                await kv.get(args.name)
            except KeyNotFoundError:
                raise CliError(f"no virtual cluster {args.name!r}", EXIT_INVALID) from None
            await kv.purge(args.name)
            after = "open to everyone again" if args.name == "default" else "new jobs naming it are refused"
            out(f"{args.name}: removed (its jobs go on; {after})")
            return EXIT_OK
        keys, found = await named_records(kv, VirtualCluster)
        keys.sort(key=lambda k: (k != "default", k))
        records = [found[k] for k in keys if found.get(k)]
        rows: list[tuple[str, ...]] = [("NAME", "QUOTA", "USERS", "MAX PRIORITY", "BORROW")]
        for key in keys:
            vc = found.get(key)
            rows.append(vc_row(vc) if vc else (key, "(does not decode: ignored)", "-", "-", "-"))
        if args.json:
            out(json.dumps([vc.model_dump(mode="json") for vc in records], indent=2))
            return EXIT_OK
        if "default" not in keys:
            rows.insert(1, ("default", "what the others leave", "*", "high", "yes"))
        out(columns(rows))
        return EXIT_OK
    finally:
        await nc.close()


# ---------------------------------------------------------------- admin dataset


def user_list(text: str) -> list[str]:
    users = [u.strip() for u in text.split(",") if u.strip()]
    if not users:
        raise CliError(f"--users {text!r}: name at least one user, or '*' for everyone", EXIT_INVALID)
    for u in users:
        if u != "*" and not auth.NAME_RE.match(u):
            raise CliError(
                f"--users {text!r}: {u!r} is not a user name (letters, digits, '_', '-'; "
                "or '*' for everyone)",
                EXIT_INVALID,
            )
    return users


async def admin_dataset(args: argparse.Namespace) -> int:
    """`muster admin dataset set|remove|list`: the datasets jobs may mount (`data`), in bucket
    muster_datasets. Validators watch it; agents read a job's datasets when they start its tasks."""
    from nats.js.errors import KeyNotFoundError
    from pydantic import ValidationError

    from shared.jobconfig import _reason
    from shared.messages import Dataset

    if args.action != "list" and not auth.NAME_RE.match(args.name):
        raise CliError(
            f"NAME {args.name!r}: a dataset's name starts with a letter or digit and has only "
            "letters, digits, '_' and '-' (64 at most)",
            EXIT_INVALID,
        )
    record = None
    if args.action == "set":
        try:
            record = Dataset.model_validate(
                {
                    "name": args.name,
                    "source": args.source,
                    "writable": args.writable,
                    "users": user_list(args.users),
                    "description": args.description,
                }
            )
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            field = str(first["loc"][0]) if first["loc"] else ""
            raise CliError(f"--{field}: {_reason(first)}", EXIT_INVALID) from None
    nc = await connect(args.connect_timeout)
    try:
        if client.asker(nc) != subjects.ALL:
            raise CliError("managing datasets takes an admin identity")
        try:
            kv = await nc.jetstream(timeout=10).key_value(subjects.DATASETS_BUCKET)
        except NotFoundError:
            raise CliError(
                f"bucket {subjects.DATASETS_BUCKET} is missing on this NATS: run `muster admin init`"
            ) from None
        if record is not None:
            await kv.put(record.name, record.to_bytes())
            kind = "Docker volume" if record.volume else "host directory"
            out(
                f"{record.name}: set — {kind} {record.source}; "
                f"{'writable with :rw' if record.writable else 'read-only'}; users {','.join(record.users)}"
            )
            return EXIT_OK
        if args.action == "remove":
            try:
                await kv.get(args.name)
            except KeyNotFoundError:
                raise CliError(f"no dataset {args.name!r}", EXIT_INVALID) from None
            await kv.purge(args.name)
            out(f"{args.name}: removed (running tasks keep their mounts; new jobs naming it are refused)")
            return EXIT_OK
        keys, found = await named_records(kv, Dataset)
        keys.sort()
        records = [found[k] for k in keys if found.get(k)]
        rows: list[tuple[str, ...]] = [("NAME", "SOURCE", "WRITABLE", "USERS", "DESCRIPTION")]
        for key in keys:
            ds = found.get(key)
            if ds is None:
                rows.append((key, "(does not decode: ignored)", "-", "-", "-"))
            else:
                writable = "yes" if ds.writable else "no"
                rows.append((ds.name, ds.source, writable, ",".join(ds.users), ds.description or "-"))
        if args.json:
            out(json.dumps([ds.model_dump(mode="json") for ds in records], indent=2))
            return EXIT_OK
        out(columns(rows))
        return EXIT_OK
    finally:
        await nc.close()


# ---------------------------------------------------------------- up


def check_agent_flags(args: argparse.Namespace) -> None:
    """The local agent's flags, refused before anything starts."""
    from services.agent.inventory import parse_gpus, parse_port_range

    if args.gpus is not None:
        try:
            parse_gpus(args.gpus)
        except ValueError as exc:
            raise CliError(f"--gpus {args.gpus!r}: {exc}", EXIT_INVALID) from None
    try:
        low, high = parse_port_range(args.ports)
    except ValueError:
        low = high = 0
    if not 1 <= low <= high <= 65535:
        raise CliError(
            f"--ports {args.ports!r}: expected LOW-HIGH within 1-65535, e.g. 5000-10000", EXIT_INVALID
        )
    for flag, value in (("--cpus", args.cpus), ("--memory-mb", args.memory_mb)):
        if value is not None and value < 1:
            raise CliError(f"{flag} {value}: must be ≥ 1", EXIT_INVALID)


def cmd_up(args: argparse.Namespace) -> int:
    from services.agent.config import make_runtime, options_from_args
    from services.agent.service import Agent
    from services.cli.mesh import default_data_dir, up
    from shared.service import tune_gc

    check_agent_flags(args)
    logs.configure("muster")
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    if not args.data_roots:
        # Jobs may mount what is under the directory `muster up` runs in (a config next to its
        # code: "codeDir": "./") and each user's own dir in the data dir.
        here = os.getcwd()
        roots = [] if here == "/" else [here]
        args.data_roots = ",".join([*roots, str(data_dir.absolute() / "users" / "{user}")])
    os.environ["MUSTER_DATA_ROOTS"] = args.data_roots  # the validator's too
    sim = None
    if args.runtime == "sim" and not args.no_agent:
        sim = sim_setup(args, str(data_dir))
    options = None if args.no_agent or sim else options_from_args(args, str(data_dir))

    def agent(metrics_port: int | None):
        if sim is not None:
            out(f"muster: {sim.describe()}")
            return sim.builder()
        assert options is not None
        options.metrics_port = metrics_port  # this process's /metrics, which has the agent's
        out(
            f"muster: local agent {options.node} at {options.address}: {options.cpus} CPUs, "
            f"{options.memory_mb} MB, GPUs: {_gpu_text(options.gpus)}"
        )
        return Agent.builder(
            options,
            make_runtime(
                args.runtime,
                str(Path(options.work_root) / "tasks"),
                options.task_user,
                options.pids_limit,
                args.task_caps,
                args.docker_network,
                options.address,
            ),
        )

    tune_gc()  # a long-running process of services, as `python -m services.<name>` is
    try:
        return asyncio.run(
            up(
                data_dir,
                args.port,
                lambda s: out(f"muster: {s}"),
                None if options is None and sim is None else agent,
                node=sim.prefix if sim else (options.node if options else None),
                open_bus=args.open,
                sim=sim is not None,
                metrics_port=args.metrics_port,
            )
        )
    except (RuntimeError, TimeoutError, ConnectionError, FileNotFoundError, auth.AuthError) as exc:
        raise CliError(str(exc)) from None


def sim_setup(args: argparse.Namespace, data_dir: str) -> SimSetup:
    """`--runtime sim`: the simulated nodes, and a node timeout the mesh's scheduler and
    supervisor (in this process) give their heartbeat period (services/agent/sim.py)."""
    from services.agent import sim

    try:
        setup = sim.setup_from_args(args, data_dir)
    except SystemExit as exc:
        raise CliError(str(exc), EXIT_INVALID) from None
    timeout = sim.node_timeout_for(setup.heartbeat)
    if timeout > bus.node_timeout():
        if "MUSTER_NODE_TIMEOUT" in os.environ:
            err(
                f"muster: MUSTER_NODE_TIMEOUT={bus.node_timeout():g} is short for nodes beating every "
                f"{setup.heartbeat:g}s: they will come and go (give {timeout:g} or more)"
            )
        else:
            os.environ["MUSTER_NODE_TIMEOUT"] = f"{timeout:g}"
            out(f"muster: MUSTER_NODE_TIMEOUT={timeout:g}: nodes beat every {setup.heartbeat:g}s")
    return setup


def _gpu_text(gpus) -> str:
    if not gpus:
        return "none"
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g.model] = counts.get(g.model, 0) + 1
    return ",".join(f"{n}x{m}" for m, n in counts.items())


# ---------------------------------------------------------------- entry point


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A bad argument: one line naming it (not the whole usage), exit 2."""
        self.exit(EXIT_INVALID, f"{self.prog}: {message} (see {self.prog} --help)\n")


def checked(kind: type, ok: Any, wanted: str) -> Any:
    """An argparse `type=`: `kind(text)`, refused with "`wanted`, got TEXT" unless `ok(value)`."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{wanted}, got {text!r}")
        return value

    return parse


MAX_GRACE = 24 * 3600  # shared.shapes.MAX_GRACE: a kill or drain order's longest grace (no model imported)
GRACE = checked(float, lambda v: 0 <= v <= MAX_GRACE, f"must be seconds from 0 to {MAX_GRACE}")
TIMEOUT = checked(float, lambda v: 0 < v < math.inf, "must be seconds > 0")
COUNT = checked(int, lambda v: v >= 1, "must be a whole number ≥ 1")
PORT = checked(int, lambda v: 1 <= v <= 65535, "must be a port, 1-65535")


NAME = checked(str, lambda v: bool(auth.NAME_RE.match(v)), "letters, digits, '_' and '-'")
AGO = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def job_states(text: str) -> list[str]:
    """--state: states by name (any case), comma-separated; `live` and `finished` for their groups."""
    out: list[str] = []
    for word in (w.strip().upper() for w in text.split(",")):
        named = {"LIVE": LIVE, "FINISHED": FINISHED}.get(word, [word] if word in STATES else None)
        if not named:
            raise argparse.ArgumentTypeError(
                f"expected states from {', '.join(s.lower() for s in STATES)}, live, finished; got {text!r}"
            )
        out += [s for s in named if s not in out]
    return out


def since(text: str) -> str:
    """--since: a time ago (30m, 12h, 7d, 2w) or a date/time (local unless it names its zone),
    as an ISO time with its zone."""
    from datetime import UTC, datetime, timedelta

    m = re.fullmatch(r"(\d+(?:\.\d+)?)([mhdw])", text.strip())
    try:
        if m:
            at = datetime.now(UTC) - timedelta(seconds=float(m[1]) * AGO[m[2]])
        else:
            at = datetime.fromisoformat(text.strip())
            at = at if at.tzinfo else at.astimezone()
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected 30m, 12h, 7d, 2w or a date/time, got {text!r}") from None
    return at.isoformat()


def task_ref(text: str) -> str:
    """--task: ROLE or ROLE.INDEX (never a subject wildcard)."""
    m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9_-]*)(?:\.(\d+))?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected ROLE or ROLE.INDEX (e.g. worker.0), got {text!r}")
    return m[1] if m[2] is None else f"{m[1]}.{int(m[2])}"


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="muster", description="Distributed training jobs on your GPU machines.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("up", help="start an embedded NATS and every Muster service on this machine")
    s.add_argument("--data-dir", help="where NATS keeps JetStream data (default ~/.local/share/muster)")
    s.add_argument("--port", type=PORT, help="NATS port (default 4222, or a free one if taken)")
    s.add_argument("--no-agent", action="store_true", help="start no local agent")
    s.add_argument(
        "--open",
        action="store_true",
        help="no authentication on the embedded NATS: anyone who reaches its port may do anything",
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics and /healthz of every service, the local agent and the embedded NATS "
        "here (default $MUSTER_METRICS_PORT, else 9100 or a free one if taken; 0: off)",
    )
    add_agent_arguments(s)
    s.set_defaults(func=cmd_up)

    s = sub.add_parser("submit", help="submit a job config (JSON, JSON with comments, or YAML)")
    s.add_argument("file", help="config file, or - for standard input")
    s.add_argument("--wait", action="store_true", help="follow the job to its final state")
    s.add_argument("--json", action="store_true", help="print the verdict (and final record) as JSON")
    s.add_argument(
        "--timeout",
        type=TIMEOUT,
        help="give up after S seconds in all: waiting for the verdict and, with --wait, for the job (exit 1)",
    )
    s.add_argument(
        "--verdict-timeout", type=TIMEOUT, default=30.0, help="seconds to wait for the validator's verdict"
    )
    s.set_defaults(func=lambda a: asyncio.run(submit(a)))

    s = sub.add_parser(
        "status",
        help="list jobs, newest first (by default the live ones and the newest finished), "
        "or show one job by id or name",
    )
    s.add_argument("job", nargs="?")
    s.add_argument("--json", action="store_true", help="a list: one line per page, as the gateway answers")
    s.add_argument("--events", action="store_true", help="with JOB: its history, event by event")
    s.add_argument(
        "--state",
        type=job_states,
        help="only jobs in these states, comma-separated (waiting, running, succeeded, failed, stopped; "
        "live, finished)",
    )
    s.add_argument("--all", action="store_true", help="every job still kept, whatever its state")
    s.add_argument("--user", type=NAME, help="only this user's jobs (an admin's view)")
    s.add_argument("--vc", type=NAME, help="only jobs of this virtual cluster")
    s.add_argument("--name", help="only jobs whose name holds this text (any case)")
    s.add_argument(
        "--since", type=since, help="only jobs submitted since: 30m, 12h, 7d, or a date/time (2024-05-01)"
    )
    s.add_argument("--limit", type=COUNT, help="at most this many jobs")
    s.set_defaults(func=lambda a: asyncio.run(status(a)))

    s = sub.add_parser(
        "vc", help="virtual clusters: quota, what each holds and borrows, jobs running and waiting"
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=lambda a: asyncio.run(vc_status(a)))

    s = sub.add_parser("kill", help="stop a job: SIGTERM, SIGKILL after the grace; it is not retried")
    s.add_argument("job")
    s.add_argument("--grace", type=GRACE, default=10.0, help="seconds between SIGTERM and SIGKILL")
    s.add_argument("--no-wait", action="store_true", help="do not wait for the tasks to stop")
    s.set_defaults(func=lambda a: asyncio.run(kill(a)))

    s = sub.add_parser("drain", help="stop every task on a node (retried elsewhere) and keep new work off it")
    s.add_argument("node")
    s.add_argument("--grace", type=GRACE, default=10.0, help="seconds between SIGTERM and SIGKILL")
    s.add_argument("--undo", action="store_true", help="let the node take work again")
    s.set_defaults(func=lambda a: asyncio.run(drain(a)))

    s = sub.add_parser("logs", help="print the output of a job's tasks (kept after they end)")
    s.add_argument("job")
    s.add_argument("--task", type=task_ref, help="one task, as ROLE.INDEX (or ROLE)")
    s.add_argument("--attempt", type=COUNT, help="which attempt (default: the current one)")
    s.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    s.set_defaults(func=lambda a: asyncio.run(show_logs(a)))

    s = sub.add_parser("metrics", help="print the training metrics a job's tasks printed (its `metrics`)")
    s.add_argument("job")
    s.add_argument("--task", type=task_ref, help="one task, as ROLE.INDEX (or ROLE)")
    s.add_argument("--attempt", type=COUNT, help="which attempt (default: the current one)")
    s.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    s.add_argument("--json", action="store_true", help="one JSON object per point")
    s.set_defaults(func=lambda a: asyncio.run(show_metrics(a)))

    s = sub.add_parser("validate", help="check a config locally (every rule but name uniqueness)")
    s.add_argument("file")
    s.set_defaults(func=cmd_validate)

    s = sub.add_parser("admin", help="set up a NATS for Muster; manage who may use it")
    admin = s.add_subparsers(dest="admin_command", metavar="{init,user,keys,vc,dataset}", required=True)
    s = admin.add_parser("init", help="declare or update every stream and bucket from this shell's settings")
    s.set_defaults(func=lambda a: asyncio.run(admin_init(a)))
    s = admin.add_parser("user", help="add, rotate, remove or list identities (then the server reloads)")
    s.add_argument("action", choices=("add", "rotate", "remove", "list"))
    s.add_argument("name", nargs="?")
    s.add_argument("--admin", action="store_true", help="add an admin (sees and kills every job)")
    s.add_argument("--auth-dir", help="default: MUSTER_AUTH_DIR, else the local `muster up`'s")
    s.set_defaults(func=admin_user)
    s = admin.add_parser(
        "keys",
        help="make an auth dir for a deployment (compose, systemd): every service's "
        "identity, one per agent node, an admin; prints the server's auth.conf path",
    )
    s.add_argument("auth_dir")
    s.add_argument("--node", action="append", default=[], help="an agent node (repeat)")
    s.add_argument("--admin-name", default="admin")
    s.add_argument(
        "--sim",
        action="store_true",
        help=f"add {auth.SIM_IDENTITY}, the identity of simulated nodes (benchmarks only: it acts as "
        "any node)",
    )
    s.set_defaults(func=admin_keys)
    s = admin.add_parser("vc", help="set, remove or list virtual clusters: who may submit to them, quotas")
    vc = s.add_subparsers(dest="action", metavar="{set,remove,list}", required=True)
    s = vc.add_parser(
        "set",
        help="write a virtual cluster's whole record (a flag left out takes its default); "
        "applies to the next submission",
    )
    s.add_argument("name", metavar="NAME")
    s.add_argument("--gpus", help="guaranteed GPUs per model, e.g. 4xV100,2xT4 (default: none)")
    s.add_argument("--cpus", type=int, help="guaranteed CPUs (default: not limited by the quota)")
    s.add_argument("--memory-mb", type=int, help="guaranteed memory (default: not limited by the quota)")
    s.add_argument("--users", default="*", help="who may submit to it: alice,bob or '*' (default: everyone)")
    s.add_argument(
        "--max-priority",
        choices=("low", "normal", "high"),
        default="high",
        help="the highest priority its jobs may ask for (default: high)",
    )
    s.add_argument(
        "--no-borrow", action="store_true", help="its jobs never run beyond its quota on idle capacity"
    )
    s = vc.add_parser("remove", help="remove a virtual cluster's record (its jobs go on)")
    s.add_argument("name", metavar="NAME")
    s = vc.add_parser("list", help="a table of the virtual clusters")
    s.add_argument("--json", action="store_true", help="the stored records as JSON")
    for s in vc.choices.values():
        s.set_defaults(func=lambda a: asyncio.run(admin_vc(a)))
    s = admin.add_parser("dataset", help="set, remove or list the datasets jobs may mount (`data`)")
    ds = s.add_subparsers(dest="action", metavar="{set,remove,list}", required=True)
    s = ds.add_parser("set", help="write a dataset's whole record; applies to the next submission")
    s.add_argument("name", metavar="NAME")
    s.add_argument(
        "--source",
        required=True,
        help="a host directory (absolute; under each agent's data roots) or a Docker volume name",
    )
    s.add_argument("--writable", action="store_true", help="jobs may mount it writable (`:rw`)")
    s.add_argument("--users", default="*", help="who may mount it: alice,bob or '*' (default: everyone)")
    s.add_argument("--description", default="", help="a line shown by `muster admin dataset list`")
    s = ds.add_parser("remove", help="remove a dataset's record (running tasks keep their mounts)")
    s.add_argument("name", metavar="NAME")
    s = ds.add_parser("list", help="a table of the datasets")
    s.add_argument("--json", action="store_true", help="the stored records as JSON")
    for s in ds.choices.values():
        s.set_defaults(func=lambda a: asyncio.run(admin_dataset(a)))

    for s in (
        *(sub.choices[n] for n in ("submit", "status", "vc", "logs", "metrics", "kill", "drain")),
        admin.choices["init"],
        *vc.choices.values(),
        *ds.choices.values(),
    ):
        s.add_argument(
            "--connect-timeout", type=TIMEOUT, default=2.0, help="seconds to keep trying to reach NATS"
        )
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        code = args.func(args)
    except CliError as exc:
        err(f"muster: {exc}")
        code = exc.code
    except BrokenPipeError:
        # The reader went away (`muster status | head -1`): stop quietly, as other tools do;
        # what is still buffered goes to /dev/null rather than fail again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    except (nats.errors.Error, ConnectionError, TimeoutError) as exc:  # the bus went away mid-command
        err(f"muster: {str(exc) or type(exc).__name__}")
        code = EXIT_FAIL
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
