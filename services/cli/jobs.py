"""The commands about jobs: validate, submit (and follow), status (one job, its events, or the
list), vc (the virtual clusters' usage), kill, logs and metrics."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS

from muster.services.cli import render
from muster.services.cli.connect import ask, connect, job_and_attempts, job_of, resolve
from muster.services.cli.console import EXIT_FAIL, EXIT_INVALID, EXIT_OK, CliError, err, out
from muster.shared import bus, client, subjects
from muster.shared.loader import MAX_CONFIG_BYTES, ConfigSyntaxError, absolutize, loads
from muster.shared.trainmetrics import MetricFormat

# The models (pydantic), the mesh (mesh.py: the services) and the agent's modules are imported
# where a command needs them, not here: most commands need few of them, and importing them is
# most of a start-up otherwise (docs/BENCHMARKS.md; tests/test_cli.py checks `submit`).

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
    for line in render.rejection(errors, source):
        err(line)


def print_warnings(warnings: list[Any], source: str) -> None:
    """An accepted config's warnings (FieldErrors or a verdict's JSON), on stderr."""
    for w in warnings:
        err(f"{source}: warning: {render.problem(w)}")


def cmd_validate(args: argparse.Namespace) -> int:
    from muster.shared.jobconfig import check_job, job_warnings

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


# ---------------------------------------------------------------- submit


async def submit(args: argparse.Namespace) -> int:
    data, raw = read_config(args.file)
    # YAML in flow style (`{jobName: j, ...}`) starts as JSON does, and the validator reads such
    # bytes as JSON only (a JSON typo is not silently another YAML value): sent as the JSON it is.
    flow = args.file.endswith((".yaml", ".yml")) and data.lstrip()[:1] in (b"{", b"[")
    if (args.file != "-" and absolutize(raw, os.path.dirname(os.path.abspath(args.file)))) or flow:  # noqa: ASYNC240
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
    from muster.shared.messages import JobState

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
                doc["attempts"] = [a.model_dump(mode="json") for a in history]  # the newest
                doc["attempts_total"] = answer.get("attempts_total", record.attempt)
                if latest:
                    doc["metrics"] = latest
                out(json.dumps(doc, indent=2))
            else:
                out(render.describe(record, history))
                if latest:
                    out(render.metrics_table(record, latest))
            if args.events:
                after = 0
                while True:
                    page = await ask(nc, "events", job_id=record.job_id, after=after)
                    for e in page["events"]:
                        out(render.event_line(e))
                    after = page["last"]
                    if not page["more"]:
                        break
            return EXIT_OK
        return await list_jobs(nc, args)
    finally:
        await nc.close()


RECENT = 20  # finished jobs `muster status` shows by default


async def list_jobs(nc: NATS, args: argparse.Namespace) -> int:
    """Jobs newest first, as the gateway pages them: by default every live job, then the most
    recent finished ones; `--all` or `--state` instead. Filtered, at most `--limit`; each page
    printed as it comes (`--json`: as the gateway answered it, one line each)."""
    filters = {"user": args.user, "vc": args.vc, "name": args.name, "since": args.since}
    chosen = bool(args.all or args.state)
    parts = (
        [(args.state or render.STATES, args.limit)]
        if chosen
        else [(render.LIVE, None), (render.FINISHED, RECENT)]
    )
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
            rows = [render.job_row(j) for j in page["jobs"]]
            if rows and widths is None:
                header = render.HEADER
                widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
                out(render.aligned(header, widths))
            for row in rows:
                out(render.aligned(row, widths or []))
    if args.json:
        return EXIT_OK
    if widths is None:
        out("no jobs")
    note = render.listing_note(counts, shown, wanted, chosen)
    if note:
        err(f"muster: {note}")
    return EXIT_OK


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
    out(render.columns(render.vc_usage_rows(rows)))
    return EXIT_OK


# ---------------------------------------------------------------- kill


async def kill(args: argparse.Namespace) -> int:
    from muster.shared.messages import JobState, KillRequest

    nc = await connect(args.connect_timeout)
    try:
        record = await resolve(nc, args.job)
        if record.state.final:
            out(f"{record.job_id}  {record.state}: already ended ({record.reason})")
            return EXIT_OK
        # Sent as the job's owner: a user can only send as itself, an admin as anyone.
        request = KillRequest(job_id=record.job_id, user=client.submitter(nc), grace=args.grace)
        await bus.publish_once(
            nc.jetstream(timeout=10),
            subjects.kill_request(record.user),
            request.to_bytes(),
            f"kill:{record.job_id}",
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


# ---------------------------------------------------------------- logs and metrics


async def show_logs(args: argparse.Namespace) -> int:
    """A job's output, page by page as the gateway reads it from the stream (no model is
    imported: its first lines come as soon as the first page does)."""
    nc = await connect(args.connect_timeout)
    try:
        job = (await ask(nc, "job", ref=args.job))["job"]
        attempt = _attempt_and_task(job, args)

        def show(lines: list[Any]) -> None:
            if lines:
                sys.stdout.write(render.log_text(lines))
                sys.stdout.flush()

        await _pages(nc, "logs", "lines", job["job_id"], attempt, args, show)
        return EXIT_OK
    finally:
        await nc.close()


async def show_metrics(args: argparse.Namespace) -> int:
    """The series of a job's training metrics (its `metrics`), as `logs` prints its output."""
    nc = await connect(args.connect_timeout)
    try:
        from muster.shared.messages import JobRecord

        job = (await ask(nc, "job", ref=args.job))["job"]
        record = JobRecord.model_validate(job)
        if not record.config.metrics:
            raise CliError(f"job {record.job_id} declares no metrics (its config's `metrics`)", EXIT_INVALID)
        attempt = _attempt_and_task(job, args)
        formats = {s.name: s.format for s in record.config.metric_specs}
        if not args.json:
            out(render.METRICS_HEADER)

        def show(batches: list[Any]) -> None:
            for batch in batches:
                for p in batch["points"]:
                    if args.json:
                        out(json.dumps({"task": batch["task"], "attempt": attempt, **p}))
                        continue
                    out(render.metric_line(batch["task"], p, formats.get(p["name"], MetricFormat.RAW)))
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
        moved, after = page["last"] > after, page["last"]
        if page["more"] and moved:
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
