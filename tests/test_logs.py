"""Task output: bounded on the bus, whole on the node (issue 23.4), and believed only from the
node that ran the task (issue 24.2). The limiter and the shipper alone (services/agent/output.py,
with the clock and the publish as seams), then a real agent whose task floods, then the gateway
reading a stream where another node wrote for tasks that are not its own."""

from __future__ import annotations

import asyncio
import errno
import json
import re
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from muster.services.agent import output
from muster.services.agent.output import Budget, OutputLimits, Shipper, parse_size
from muster.shared import bus, client, subjects
from muster.shared.jobconfig import check_job
from muster.shared.messages import AttemptRecord, JobRecord, JobState, TaskStatus
from tests.test_cli import VALID, muster
from tests.test_jobs import nc, role, run_job  # noqa: F401 (nc is a fixture)

KiB, MiB = 1024, 1024 * 1024


# ---------------------------------------------------------------- limits, alone


def test_limits_come_from_the_environment_and_a_bad_one_is_named():
    assert OutputLimits.from_env({}) == OutputLimits()
    limits = OutputLimits.from_env(
        {"MUSTER_TASK_LOG_RATE": "1KiB", "MUSTER_TASK_LOG_BURST": "2k", "MUSTER_TASK_LOG_MAX_BYTES": " 3MiB "}
    )
    assert (limits.rate, limits.burst, limits.total) == (1024, 2000, 3 * MiB)
    assert parse_size("0") == 0 and parse_size("7") == 7 and parse_size("1GiB") == 1 << 30
    with pytest.raises(ValueError, match="MUSTER_TASK_LOG_MAX_BYTES: expected bytes"):
        OutputLimits.from_env({"MUSTER_TASK_LOG_MAX_BYTES": "lots"})


def test_the_budget_lets_a_burst_through_then_the_rate_then_nothing_past_the_total():
    budget = Budget(OutputLimits(rate=100, burst=1000, total=1500), now=0.0)
    assert [budget.take(100, 0.0) for _ in range(11)] == [None] * 10 + ["rate"]
    assert budget.take(100, 0.5) == "rate"  # 50 bytes of room so far
    assert budget.take(100, 1.0) is None  # a second: 100 more
    assert budget.take(100, 4.0) is None and budget.take(100, 4.0) is None
    assert budget.shipped == 1300
    assert budget.take(300, 60.0) == "total" and budget.take(200, 60.0) is None
    assert budget.take(1, 1000.0) == "total"
    unlimited = Budget(OutputLimits(rate=0, burst=0, total=0), now=0.0)
    assert all(unlimited.take(MiB, 0.0) is None for _ in range(100))


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_a_flood_ships_its_burst_and_rate_and_says_what_it_cut_while_the_file_keeps_all(tmp_path):
    sent: list[bytes] = []

    async def publish(subject: str, data: bytes) -> None:
        assert subject == "muster.logs.j1.1.main.0.n1"
        sent.append(data)

    clock = Clock()
    path = tmp_path / "out" / "main-0.log"
    limits = OutputLimits(rate=10 * KiB, burst=100 * KiB, total=200 * KiB)
    shipper = Shipper(publish, "muster.logs.j1.1.main.0.n1", "n1", path, limits, clock)
    cut = output.NOT_SHIPPED_LINES.labels("n1", "rate")._value.get()
    lines = [f"{i:05d} " + "x" * 93 for i in range(5000)]  # 100 bytes each with its newline
    for i, line in enumerate(lines):
        clock.now = i / 1000  # 100 KB/s: ten times the rate
        shipper.line(line)
        if i % 100 == 0:
            await asyncio.sleep(0)  # the loop turns now and then, as it does under a reader
    clock.now = 10.0
    await shipper.close()

    assert path.read_text().splitlines() == lines  # the whole output, on the node
    shipped = [line.decode() for batch in sent for line in batch.split(b"\n")]
    notes = [line for line in shipped if line.startswith("[muster:")]
    data = [line for line in shipped if not line.startswith("[muster:")]
    # The burst (1,024 lines), then the rate's share of the 5 s (10 KiB/s: 512 lines).
    assert 1500 <= len(data) <= 1540, len(data)
    assert data[:1024] == lines[:1024] and set(data) < set(lines) and data == sorted(data)
    not_shipped = len(lines) - len(data)
    said = [
        re.fullmatch(
            r"\[muster: (\d+) lines \((\d+) bytes\) not shipped: over the limit of 10 KiB/s "
            rf"\(burst 100 KiB\) per task; the whole output is in {re.escape(str(path))} on node n1\]",
            note,
        )
        for note in notes
    ]
    assert said and all(said), notes  # one at the end (and one every 5 s on a slow machine)
    assert sum(int(m[1]) for m in said if m) == not_shipped
    assert sum(int(m[2]) for m in said if m) == not_shipped * 100
    assert output.NOT_SHIPPED_LINES.labels("n1", "rate")._value.get() - cut == not_shipped
    assert all(len(batch) <= output.BATCH_BYTES for batch in sent)
    assert len(sent) < len(data) / 10  # many lines to a message


async def test_past_its_total_a_task_ships_nothing_and_says_so_at_once_and_at_the_end(tmp_path):
    sent: list[bytes] = []

    async def publish(subject: str, data: bytes) -> None:
        sent.append(data)

    path = tmp_path / "main-0.log"
    shipper = Shipper(publish, "s", "n1", path, OutputLimits(rate=0, total=1000, file=3000), Clock())
    lines = [f"{i:02d}" + "y" * 97 for i in range(50)]  # 100 bytes each
    for line in lines:
        shipper.line(line)
    await shipper.close()
    shipped = [line.decode() for batch in sent for line in batch.split(b"\n")]
    over = f"over the limit of 1000 bytes per task attempt; the whole output is in {path} on node n1]"
    assert shipped == [
        *lines[:10],
        f"[muster: from here on, output is not shipped: {over}",
        f"[muster: 40 lines (4000 bytes) not shipped: {over}",
    ]
    assert path.read_text().splitlines() == [*lines[:30], "[muster: output beyond 3000 bytes is not kept]"]


async def test_an_output_file_that_failed_a_write_is_written_again_once_there_is_room(tmp_path):
    """A full disk failed one write of the task's output file, and nothing more reached it for
    the rest of the task's life (days, for a training run), the notes saying the output was kept
    nowhere. Now the file is opened again FILE_RETRY seconds later and says what it missed."""

    async def publish(subject: str, data: bytes) -> None:
        pass

    class Full:
        def __init__(self, real) -> None:
            self.real = real

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self) -> None:
            self.real.close()

    path, clock = tmp_path / "main-0.log", Clock()
    shipper = Shipper(publish, "s", "n1", path, OutputLimits(rate=0, total=0), clock)
    shipper.line("a")
    shipper.file = Full(shipper.file)  # the disk fills: no test can fill one on demand
    shipper.line("b")
    shipper.line("c")
    clock.now += output.FILE_RETRY + 1  # space was freed meanwhile
    shipper.line("d")
    await shipper.close()
    assert path.read_text().splitlines() == [
        "a",
        "[muster: 2 lines or more not kept here: [Errno 28] No space left on device]",
        "d",
    ]


async def test_a_long_line_is_cut_in_the_stream_and_whole_in_the_file(tmp_path):
    sent: list[bytes] = []

    async def publish(subject: str, data: bytes) -> None:
        sent.append(data)

    path = tmp_path / "main-0.log"
    shipper = Shipper(publish, "s", "n1", path, OutputLimits(rate=0, total=0), Clock())
    shipper.line("a" * 100_000)
    shipper.line("after")
    await shipper.close()
    shipped = [line.decode() for batch in sent for line in batch.split(b"\n")]
    cut = 100_000 - output.LINE_BYTES
    assert shipped == [
        "a" * output.LINE_BYTES + f" [muster: {cut} bytes cut]",
        "after",
        f"[muster: {cut} bytes of long lines not shipped: over the limit of 16 KiB a line; "
        f"the whole output is in {path} on node n1]",
    ]
    assert path.read_text() == "a" * 100_000 + "\nafter\n"


# ---------------------------------------------------------------- a real task that floods


FLOOD_LINES = 100_000  # of 100 bytes: 10 MB as fast as Python prints


async def test_a_task_printing_10_mb_costs_the_stream_its_limit_and_keeps_it_all_on_its_node(
    cluster,
    nc,  # noqa: F811
    monkeypatch,
):
    monkeypatch.setenv("MUSTER_TASK_LOG_MAX_BYTES", "512KiB")
    monkeypatch.setenv("MUSTER_TASK_LOG_RATE", "0")  # the total alone, whatever the machine's speed
    cluster.core()
    cluster.agent("n1", "--address", "127.0.0.1", "--cpus", "2")
    code = (
        f"import sys\nw=sys.stdout.write\nfor i in range({FLOOD_LINES}): w(f'{{i:07d}} ' + 'z' * 92 + '\\n')"
    )
    command = f"{sys.executable} -c {shlex.quote(code)}"
    record = await run_job(
        nc, {"jobName": "chatty", "image": "img", "taskRoles": [role("main", 1, command)]}, 180
    )
    assert record.state == JobState.SUCCEEDED, (record, cluster.logs())

    stream_bytes = (await nc.jetstream().stream_info(subjects.LOGS_STREAM)).state.bytes
    assert stream_bytes < 600 * KiB, stream_bytes  # 10 MB printed; 512 KiB (and notes) shipped

    path = Path(cluster.log_dir) / "work" / "n1" / record.job_id / "1" / "output" / "main-0.log"
    kept = path.read_text().splitlines()
    assert len(kept) == FLOOD_LINES and kept[-1].startswith(f"{FLOOD_LINES - 1:07d} ")

    r = cluster.cli("logs", record.job_id)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "[main.0] 0000000 " + "z" * 92
    assert f"the whole output is in {path} on node n1]" in lines[-1] and "not shipped" in lines[-1]
    assert 5190 <= len(lines) <= 5200, len(lines)  # 512 KiB of 101-byte lines, and the notes


# ---------------------------------------------------------------- believed only from the task's node


async def test_lines_from_another_node_or_for_a_task_the_attempt_has_not_are_not_shown(nats_url, procs):
    """Agent n1 may publish output under its own node's name only, but for any task: lines for a
    task placed on n2, and for a task the job does not have, are skipped (and counted)."""
    procs.start("muster.services.gateway")
    nc = await bus.connect("test", nats_url)  # noqa: F811 (not the fixture)
    try:
        js, buckets = await bus.ensure_jetstream(nc)
        config, errors = check_job(
            {**VALID, "taskRoles": [dict(VALID["taskRoles"][0], name="w", taskNumber=2)]}
        )
        assert not errors and config is not None
        record = JobRecord(
            job_id="j1",
            job_name="two",
            state=JobState.RUNNING,
            submission_id="s1",
            user="u",
            config=config,
            submitted_at=datetime.now(UTC),
            attempt=1,
        )
        await buckets[subjects.JOBS_BUCKET].put("j1", record.to_bytes())
        tasks = [
            TaskStatus(role="w", role_no=0, index=0, node="n1"),
            TaskStatus(role="w", role_no=0, index=1, node="n2"),
        ]
        await buckets[subjects.ATTEMPTS_BUCKET].put(
            "j1.1", AttemptRecord(job_id="j1", attempt=1, tasks=tasks).to_bytes()
        )
        for task, node, text in (
            (("w", 0), "n1", "n1 about its own task"),
            (("w", 1), "n1", "n1 pretending to be w.1"),
            (("w", 1), "n2", "n2 about its own task\nand a second line"),
            (("ghost", 0), "n1", "n1 about a task the job has not"),
            (("w", 7), "n1", "n1 about w.7"),
        ):
            await js.publish(subjects.task_logs("j1", 1, *task, node), text.encode())
        for _ in range(100):
            try:
                await client.ask(nc, "ping", timeout=0.5)
                break
            except TimeoutError:
                await asyncio.sleep(0.2)
        page = await client.ask(nc, "logs", {"job_id": "j1", "attempt": 1})
        assert page["lines"] == [
            ["w.0", "n1 about its own task"],
            ["w.1", "n2 about its own task"],
            ["w.1", "and a second line"],
        ]
        assert page["last"] == 5 and not page["more"]
        one = await client.ask(nc, "logs", {"job_id": "j1", "attempt": 1, "task": "w.1"})
        assert [line for _, line in one["lines"]] == ["n2 about its own task", "and a second line"]
        r = muster("logs", "j1", env=procs.env())
        assert r.stdout.splitlines() == [
            "[w.0] n1 about its own task",
            "[w.1] n2 about its own task",
            "[w.1] and a second line",
        ], r.stderr
    finally:
        await nc.close()


async def test_logs_page_through_a_stream_a_bounded_page_at_a_time(nats_url, procs):
    """5,000 messages of 1 KB: pages of at most `limit` lines and 512 KiB follow one another to
    the end, each line once, in order."""
    procs.start("muster.services.gateway")
    nc = await bus.connect("test", nats_url)  # noqa: F811 (not the fixture)
    try:
        js, buckets = await bus.ensure_jetstream(nc)
        config, _ = check_job(VALID)
        assert config is not None
        record = JobRecord(
            job_id="j2",
            job_name="long",
            state=JobState.SUCCEEDED,
            submission_id="s2",
            user="u",
            config=config,
            submitted_at=datetime.now(UTC),
            attempt=1,
        )
        await buckets[subjects.JOBS_BUCKET].put("j2", record.to_bytes())
        task = TaskStatus(role="main", role_no=0, index=0, node="n1")
        await buckets[subjects.ATTEMPTS_BUCKET].put(
            "j2.1", AttemptRecord(job_id="j2", attempt=1, tasks=[task]).to_bytes()
        )
        subject = subjects.task_logs("j2", 1, "main", 0, "n1")
        for i in range(0, 5000, 500):
            await asyncio.gather(
                *(js.publish(subject, f"{n:05d} ".encode() + b"q" * 1000) for n in range(i, i + 500))
            )
        for _ in range(100):
            try:
                await client.ask(nc, "ping", timeout=0.5)
                break
            except TimeoutError:
                await asyncio.sleep(0.2)
        seen, after, pages = [], 0, 0
        while True:
            page = await client.ask(nc, "logs", {"job_id": "j2", "attempt": 1, "after": after, "limit": 700})
            assert 0 < len(page["lines"]) <= 700 and len(json.dumps(page)) <= 520 * 1024
            seen += [int(line[:5]) for _, line in page["lines"]]
            after, pages = page["last"], pages + 1
            if not page["more"]:
                break
        assert seen == list(range(5000)) and pages >= 10
    finally:
        await nc.close()
