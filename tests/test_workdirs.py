"""Issue 23 point 5, disks fill: an attempt's directory on a node goes once the attempt has ended
there and the retention has passed (services/agent/workdirs.py), never while a task of it is
live; a sweep removes what a crashed agent left; codeSync fetches once per job on a node.

Unit tests drive `Workdirs` on a real directory; the end-to-end ones run real agents (process
runtime) on a real bus."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from muster.services.agent import workdirs
from muster.services.agent.output import output_path
from muster.services.agent.prepare import CodeSyncs
from muster.services.agent.workdirs import Workdirs
from muster.shared import bus
from muster.shared.jobconfig import CodeSync
from tests.test_contract import git, job, nc, repo, roots

__all__ = ["nc", "repo", "roots"]  # fixtures


async def until(cond: Callable[[], bool], timeout: float = 20, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.05)


def attempt_with_output(root: Path, job_id: str, attempt: int) -> Path:
    out = output_path(str(root), job_id, attempt, "worker", 0)  # the task's whole output
    out.parent.mkdir(parents=True)
    out.write_text("line\n" * 100)
    (workdirs.attempt_dir(root, job_id, attempt) / "hostfile").write_text("h slots=1\n")
    return workdirs.attempt_dir(root, job_id, attempt)


# ---------------------------------------------------------------- the module


async def test_an_ended_attempt_is_kept_for_the_retention_then_removed_with_its_job(tmp_path: Path):
    dirs = Workdirs(tmp_path, set, retention=1.0)
    path = attempt_with_output(tmp_path, "j1", 1)
    workdirs.job_code(tmp_path, "j1").mkdir()
    started = time.monotonic()
    dirs.ended("j1", 1)
    assert (tmp_path / "j1" / "1.ended").is_file()  # noted on disk for an agent that starts meanwhile
    await asyncio.sleep(0.3)
    assert path.is_dir(), "removed before the retention passed"
    await until(lambda: not (tmp_path / "j1").exists(), what="the job's directory gone")
    assert time.monotonic() - started >= 1.0
    await until(lambda: not any((tmp_path / workdirs.TRASH).iterdir()), what="the trash emptied")
    assert dirs.removed == 1
    await dirs.close()


async def test_retention_zero_removes_at_once(tmp_path: Path):
    dirs = Workdirs(tmp_path, set, retention=0)
    attempt_with_output(tmp_path, "j1", 1)
    dirs.ended("j1", 1)
    assert not (tmp_path / "j1").exists()  # moved aside on the spot, deleted in a thread
    await dirs.close()


async def test_nothing_a_live_task_uses_is_removed(tmp_path: Path):
    live: set[tuple[str, int]] = {("j1", 1)}
    dirs = Workdirs(tmp_path, lambda: set(live), retention=0.2)
    attempt_with_output(tmp_path, "j1", 1)
    dirs.ended("j1", 1)  # a task of it ended, another of it (an elastic joiner) is live
    await asyncio.sleep(0.6)
    assert workdirs.attempt_dir(tmp_path, "j1", 1).is_dir()
    live.clear()
    dirs.ended("j1", 1)  # the last one ends
    await until(lambda: not (tmp_path / "j1").exists(), what="removed once nothing uses it")

    # The job's next attempt is live here: the ended one goes, the job's directory (its shared
    # fetch, the next attempt's directory) stays.
    live.add(("j2", 2))
    attempt_with_output(tmp_path, "j2", 1)
    workdirs.job_code(tmp_path, "j2").mkdir()
    dirs.ended("j2", 1)
    await until(lambda: not workdirs.attempt_dir(tmp_path, "j2", 1).exists(), what="attempt 1 gone")
    assert workdirs.job_code(tmp_path, "j2").is_dir()
    assert (await dirs.sweep()) == 0 and workdirs.job_code(tmp_path, "j2").is_dir()  # still in use
    await dirs.close()


async def test_the_sweep_finds_what_a_crashed_agent_left(tmp_path: Path):
    now = time.time()
    attempt_with_output(tmp_path, "left", 1)  # no mark: its agent died before its end
    attempt_with_output(tmp_path, "old", 3)
    (tmp_path / "old" / "3.ended").write_text(f"{now - 7200}\n")
    attempt_with_output(tmp_path, "future", 1)
    (tmp_path / "future" / "1.ended").write_text(f"{now + 10**6}\n")  # not believed: from now
    (tmp_path / "fetched" / "git").mkdir(parents=True)  # a job's fetch, no attempt left
    attempt_with_output(tmp_path, "adopted", 1)  # a task of it was adopted: live
    for own in ("outbox", "assignments", "tasks"):
        (tmp_path / own / "j9").mkdir(parents=True)
    (tmp_path / "agent.pid").write_text("1")
    (tmp_path / workdirs.TRASH / "half-deleted" / "x").mkdir(parents=True)

    dirs = Workdirs(tmp_path, lambda: {("adopted", 1)}, retention=3600)
    assert await dirs.sweep() == 1  # old
    await until(lambda: not (tmp_path / workdirs.TRASH / "half-deleted").exists(), what="trash emptied")
    names = {p.name for p in tmp_path.iterdir()}
    assert {"left", "future", "adopted", "outbox", "assignments", "tasks", "agent.pid"} <= names
    assert not {"old", "fetched"} & names
    for job_id in ("left", "future"):  # kept the retention from now, marked so on disk
        assert now - 1 <= float((tmp_path / job_id / "1.ended").read_text()) <= time.time()
    assert not (tmp_path / "adopted" / "1.ended").exists()
    await dirs.close()

    # The next agent, with a short retention: the leftovers go, what is live stays.
    again = Workdirs(tmp_path, lambda: {("adopted", 1)}, retention=0.5)
    await again.sweep()
    await until(lambda: not (tmp_path / "left").exists() and not (tmp_path / "future").exists(), what="gone")
    assert (tmp_path / "adopted" / "1").is_dir() and (tmp_path / "outbox" / "j9").is_dir()
    await again.close()


async def test_the_sweep_forgets_the_orders_kept_of_attempts_ended_past_the_retention(tmp_path: Path):
    """The orders an agent keeps (to adopt its tasks after a restart) were pruned only when it
    started: a node kept one per attempt it ever ran, each its job's config with its secret
    values, for as long as its agent ran."""
    import os

    orders = tmp_path / workdirs.ORDERS
    orders.mkdir()
    old = time.time() - 7200
    for name in ("done.1.json", "done.2.tmp", "live.1.json", "recent.1.json", "not-an-order"):
        (orders / name).write_text("{}")
        if name != "recent.1.json":
            os.utime(orders / name, (old, old))
    dirs = Workdirs(tmp_path, lambda: {("live", 1)}, retention=3600)
    await dirs.sweep()
    assert sorted(p.name for p in orders.iterdir()) == ["live.1.json", "not-an-order", "recent.1.json"]
    await dirs.close()


# ---------------------------------------------------------------- codeSync: one fetch per job here


async def test_a_jobs_attempts_on_a_node_share_one_fetch_and_each_gets_a_clean_checkout(repo, tmp_path):
    sync = CodeSync(git=str(repo), branch="main")
    root = tmp_path / "work"
    shared = workdirs.job_code(root, "j1")

    async def attempt(syncs: CodeSyncs, n: int) -> tuple[str, Path]:
        path = workdirs.attempt_dir(root, "j1", n)
        path.mkdir(parents=True, exist_ok=True)
        code = path / "code"
        commit = await syncs.sync("j1", n, sync, str(code), False, path / ".muster-code-sync", shared)
        return commit, code

    syncs = CodeSyncs(timeout=60)
    first, code1 = await attempt(syncs, 1)
    assert first == git("rev-parse", "main", cwd=repo)
    assert (code1 / "train.py").read_text() == "print('v2')\n"
    (code1 / "train.py").write_text("broken\n")  # attempt 1 changed its code, then failed
    (repo / "train.py").write_text("print('v3')\n")  # and the repository moved on
    git("commit", "-qam", "v3", cwd=repo)
    second, code2 = await attempt(syncs, 2)
    # Not fetched again: the commit the job first ran, checked out as it was fetched.
    assert second == first and (code2 / "train.py").read_text() == "print('v2')\n"
    assert git("rev-parse", "HEAD", cwd=code2) == first
    assert str(repo) not in (code2 / ".git" / "config").read_text()  # no source URL in the task's dir
    # An agent restarted finds the job's fetch on disk.
    third, code3 = await attempt(CodeSyncs(timeout=60), 3)
    assert third == first and (code3 / "train.py").read_text() == "print('v2')\n"
    # Its directory removed meanwhile (the job's attempts all ended here long ago): fetched anew.
    import shutil

    shutil.rmtree(shared)
    fourth, code4 = await attempt(syncs, 4)
    assert fourth != first and (code4 / "train.py").read_text() == "print('v3')\n"


# ---------------------------------------------------------------- end to end (process runtime)


async def test_a_finished_jobs_directory_leaves_the_node_after_the_retention(cluster, nc, monkeypatch):
    from tests.test_jobs import run_job

    monkeypatch.setenv("MUSTER_WORKDIR_RETENTION", "1")
    await bus.ensure_jetstream(nc)
    cluster.core()
    cluster.agent("node-a", "--cpus", "4")
    config = job()
    for r in config["taskRoles"]:
        r["command"] = "echo hello from $PAI_TASK_ROLE_NAME; sleep 0.2"
        r.pop("image", None)
    record = await run_job(nc, config, timeout=120)
    assert record.state.value == "SUCCEEDED", (record.reason, cluster.logs())
    work = cluster.log_dir / "work" / "node-a"
    await until(
        lambda: not (work / record.job_id).exists(), timeout=30, what=f"{work / record.job_id} removed"
    )
    assert (work / "outbox").is_dir() and (work / "assignments").is_dir()  # the agent's own stay


async def test_a_retry_runs_the_code_its_first_attempt_fetched_without_fetching_again(
    cluster, nc, repo, roots
):
    from tests.test_jobs import attempt, run_job

    await bus.ensure_jetstream(nc)
    flag = roots / "shared" / "failed-once"
    (repo / "train.py").write_text(
        "import os, pathlib, sys\n"
        f"flag = pathlib.Path({str(flag)!r})\n"
        "if not flag.exists():\n"
        "    flag.touch()\n"
        "    open('train.py', 'a').write('raise SystemExit(3)\\n')  # this attempt's copy only\n"
        "    sys.exit(1)\n"
        "print('trained')\n"
    )
    git("commit", "-qam", "train", cwd=repo)
    cluster.core()
    cluster.agent("node-a", "--cpus", "4", "--data-roots", f"{roots}/users/{{user}},{roots}/shared")
    config = job(codeSync={"git": f"file://{repo}", "branch": "main"}, retryCount=2)
    config["taskRoles"] = [
        {
            "name": "worker",
            "taskNumber": 1,
            "cpuNumber": 1,
            "memoryMB": 128,
            "gpuNumber": 0,
            "command": f"{sys.executable} train.py",
        }
    ]
    record = await run_job(nc, config, timeout=120)
    assert record.state.value == "SUCCEEDED" and record.attempt == 2, (record.reason, cluster.logs())
    assert (await attempt(nc, record.job_id, 1)).tasks[0].exit_code == 1
    logs = "".join(p.read_text() for p in cluster.log_dir.glob("agent-*.log"))
    assert logs.count("agent.code_synced") == 1, logs[-3000:]  # two attempts, one fetch
    work = cluster.log_dir / "work" / "node-a" / record.job_id
    assert (work / "2" / "code" / "train.py").read_text() == (repo / "train.py").read_text()


@pytest.mark.parametrize("n", [200])
async def test_many_attempts_leave_only_what_the_retention_covers(tmp_path: Path, n: int):
    """The module at a small N (bench.workdirs drives 10,000): attempts end one after another;
    at the end nothing older than the retention is left."""
    dirs = Workdirs(tmp_path, set, retention=0.3)
    for k in range(n):
        attempt_with_output(tmp_path, f"j{k:05d}", 1)
        dirs.ended(f"j{k:05d}", 1)
        if k % 50 == 0:
            await asyncio.sleep(0.01)
    await until(
        lambda: not [p for p in tmp_path.iterdir() if p.name != workdirs.TRASH], timeout=30, what="all gone"
    )
    assert dirs.removed == n
    await dirs.close()
