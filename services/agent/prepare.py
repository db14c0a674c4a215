"""What a task needs before it starts beyond its launch: the datasets its job mounts (`data`,
resolved from the operators' records in bucket `muster_datasets`) and its code fetched from git
(`codeSync`), once per attempt on this node. Failures that would recur on any node (an unknown
dataset, a source outside the data roots, a repository that cannot be fetched) are configuration
errors: the job fails at once. Nothing here ever shows credentials a git URL holds.

Datasets (docs/data.md):
- a host directory must resolve (symlinks followed) under the agent's data roots for the
  submitter (shared/hostpaths.py); a Docker named volume needs the Docker runtime;
- mounted at the job's path, read-only unless the job asked `:rw` and the record is `writable`;
- every task gets MUSTER_DATA_<NAME> (the name upper-cased, '-' as '_'): where the dataset is as
  the task sees it (the mount path in a container; the host directory under the process runtime,
  which mounts nothing and cannot make it read-only).

Code sync (`codeSync: {"git": URL, "branch" | "commit"}`):
- fetched into codeDir when the job names one (a host path under the data roots, empty or a git
  checkout), else into `<attempt dir>/code` (mounted with the attempt dir); tasks get
  MUSTER_CODE_DIR (and PAI_CODE_DIR when codeDir is unset) and start there;
- one fetch per attempt on a node, shared by its tasks there (whoever comes first fetches, the
  others wait for it); shallow (`--depth 1`) where the server allows, within
  MUSTER_CODE_SYNC_TIMEOUT seconds (default 300), without prompts, hooks or remote helpers;
- a local repository (a path or file://) must lie under the submitter's data roots: the agent
  copies nothing a job could not mount;
- git runs on the host (never in the task's image).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from services.agent.runtime import LaunchError, Mount
from shared import hostpaths, settings
from shared.jobconfig import CodeSync, JobConfig, shown_url
from shared.messages import Dataset, TaskCause

log = structlog.get_logger(service="agent")

CODE_SYNC_TIMEOUT = settings.seconds("MUSTER_CODE_SYNC_TIMEOUT", 300.0, low=1)
SYNCED_MARK = ".muster-code-sync"  # in the attempt dir: the fetch of this attempt is done
GIT_PROTOCOLS = "https:http:ssh:git:file"
MAX_ERROR = 300  # characters of git's own words kept in a reason


@dataclass(frozen=True)
class Prepared:
    """What build_launch adds to a task: dataset mounts, their variables, the synced code dir."""

    mounts: list[Mount] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    code_dir: str | None = None


def data_var(name: str) -> str:
    return "MUSTER_DATA_" + re.sub(r"[^A-Za-z0-9_]", "_", name).upper()


async def resolve_datasets(
    config: JobConfig,
    user: str,
    lookup: Callable[[str], Awaitable[Dataset | None]],
    roots: list[str],
    containers: bool,
) -> tuple[list[Mount], dict[str, str]]:
    """The job's `data` entries as mounts and variables; LaunchError(CONFIG) naming the entry
    when a dataset is unknown now, not the user's, outside the roots, or a volume without Docker."""
    mounts: list[Mount] = []
    env: dict[str, str] = {}
    mine = hostpaths.roots_for(roots, user)
    for i, m in enumerate(config.mounts):
        at = f"data[{i}] ({m.name})"
        ds = await lookup(m.name)
        if ds is None:
            raise LaunchError(
                f"{at}: no dataset {m.name!r} (removed since the job was accepted?)", TaskCause.CONFIG
            )
        if not ds.admits(user):
            raise LaunchError(f"{at}: user {user!r} may not mount dataset {m.name!r}", TaskCause.CONFIG)
        read_only = not (m.rw and ds.writable)
        if ds.volume:
            if not containers:
                raise LaunchError(
                    f"{at}: dataset {m.name!r} is a Docker volume; this node's runtime mounts none",
                    TaskCause.CONFIG,
                )
            mounts.append(Mount(ds.source, m.path, read_only=read_only, kind="volume"))
            env[data_var(m.name)] = m.path
            continue
        try:
            real = hostpaths.resolve_under_roots(ds.source, mine)
        except ValueError as exc:
            raise LaunchError(f"{at}: dataset source {exc}", TaskCause.CONFIG) from None
        if not await asyncio.to_thread(os.path.isdir, real):
            raise LaunchError(f"{at}: dataset source {real} is not a directory here", TaskCause.CONFIG)
        mounts.append(Mount(real, m.path, read_only=read_only))
        env[data_var(m.name)] = m.path if containers else real
    return mounts, env


# ---------------------------------------------------------------- code sync


def _masked(text: str, url: str) -> str:
    """`text` with `url` (and any user info it holds) shown as `shown_url` shows it."""
    shown = shown_url(url)
    text = text.replace(url, shown)
    _, sep, rest = url.partition("://")
    if sep and "@" in rest.partition("/")[0]:
        userinfo = rest.partition("/")[0].rsplit("@", 1)[0]
        text = text.replace(userinfo, "***")
    return text


def sync_target(config: JobConfig, user: str, attempt_dir: Path, roots: list[str]) -> tuple[str, bool]:
    """Where the attempt's code goes on this node, and whether it is the job's own codeDir."""
    code = hostpaths.expand(config.codeDir, config, user) if config.codeDir else None
    local = hostpaths.local(code) if code else None
    if code and local is None:
        raise LaunchError(
            f"codeSync: codeDir {code} is not a host path; codeSync fetches into a host directory",
            TaskCause.CONFIG,
        )
    if local is None:
        return str(attempt_dir / "code"), False
    try:
        return hostpaths.resolve_under_roots(local, hostpaths.roots_for(roots, user)), True
    except ValueError as exc:
        raise LaunchError(f"codeDir {local}: {exc}", TaskCause.CONFIG) from None


def check_source(sync: CodeSync, user: str, roots: list[str]) -> None:
    """A local repository (a path, file://) only from under the user's roots."""
    url = sync.git
    if url.startswith("/") or url.lower().startswith("file://"):
        path = url[len("file://") :] if url.lower().startswith("file://") else url
        try:
            hostpaths.resolve_under_roots(path, hostpaths.roots_for(roots, user))
        except ValueError as exc:
            raise LaunchError(f"codeSync.git {path}: {exc}", TaskCause.CONFIG) from None


async def _git(args: list[str], cwd: str, deadline: float) -> tuple[int, str]:
    """Run git (no prompt, no hooks, no system or global config, no remote helpers) until
    `deadline` (loop time); (exit code, its stderr). Killed, its whole group, at the deadline."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": cwd,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_ASKPASS": "/bin/false",
        "SSH_ASKPASS": "/bin/false",
        "GIT_SSH_COMMAND": "ssh -o BatchMode=yes -o StrictHostKeyChecking=accept-new",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_ALLOW_PROTOCOL": GIT_PROTOCOLS,
        "LC_ALL": "C",
    }
    proc = await asyncio.create_subprocess_exec(
        "git",
        "-c",
        "core.hooksPath=/dev/null",
        "-c",
        "advice.detachedHead=false",
        *args,
        cwd=cwd,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    loop = asyncio.get_running_loop()
    try:
        _, err = await asyncio.wait_for(proc.communicate(), max(0.1, deadline - loop.time()))
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
        return -1, "timed out"
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc.returncode or 0, err.decode("utf-8", "replace")


async def fetch_code(sync: CodeSync, target: str, own_dir: bool, timeout: float = CODE_SYNC_TIMEOUT) -> str:
    """Fetch `sync` into `target` and check it out (detached); the commit checked out. Raises
    LaunchError(CONFIG) naming the URL (credentials cut out) and what git said."""
    url = sync.git
    ref = sync.commit or sync.branch or "HEAD"
    what = f"codeSync: cannot fetch {shown_url(url)} ({'commit' if sync.commit else 'branch'} {ref})"
    if sync.commit is None and sync.branch is None:
        what = f"codeSync: cannot fetch {shown_url(url)} (its default branch)"
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    def failed(why: str) -> LaunchError:
        lines = [line.strip() for line in _masked(why, url).splitlines() if line.strip()]
        said = "; ".join(lines[-2:])[:MAX_ERROR] or "git failed"
        if why == "timed out":
            said = f"not done within {timeout:g}s (MUSTER_CODE_SYNC_TIMEOUT)"
        return LaunchError(f"{what}: {said}", TaskCause.CONFIG)

    await asyncio.to_thread(_make_target, target, own_dir)
    code, err = await _git(["init", "-q", "."], target, deadline)
    if code != 0:
        raise failed(err)
    checkout = "FETCH_HEAD"
    full = sync.commit is not None and len(sync.commit) < 40  # an abbreviated commit: no shallow fetch
    if not full:
        code, err = await _git(["fetch", "-q", "--no-tags", "--depth", "1", "--", url, ref], target, deadline)
        if code != 0 and sync.commit is not None and err != "timed out":
            full = True  # a server that gives no commit by id: fetch its branches and look there
        elif code != 0:
            raise failed(err)
    if full:
        refs = "+refs/heads/*:refs/remotes/sync/*"
        code, err = await _git(["fetch", "-q", "--no-tags", "--", url, refs], target, deadline)
        if code != 0:
            raise failed(err)
        checkout = f"{sync.commit}^{{commit}}"
    code, err = await _git(["checkout", "-q", "-f", "--detach", checkout], target, deadline)
    if code != 0:
        raise failed(err)
    return await asyncio.to_thread(_read, Path(target, ".git", "HEAD")) or ""


def _make_target(target: str, own_dir: bool) -> None:
    os.makedirs(target, exist_ok=True)
    if own_dir and os.listdir(target) and not os.path.exists(os.path.join(target, ".git")):
        raise LaunchError(
            f"codeSync: codeDir {target} is neither empty nor a git checkout; it would be overwritten",
            TaskCause.CONFIG,
        )


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        return None


class CodeSyncs:
    """One fetch per attempt on this node, shared by its tasks here; the outcome (a commit or a
    LaunchError) is kept for the attempt's later tasks (bounded: the most recent attempts)."""

    KEEP = 256

    def __init__(self, timeout: float = CODE_SYNC_TIMEOUT):
        self.timeout = timeout
        self._fetches: OrderedDict[tuple[str, int], asyncio.Task[str]] = OrderedDict()

    async def sync(
        self, job_id: str, attempt: int, sync: CodeSync, target: str, own_dir: bool, mark: Path
    ) -> str:
        key = (job_id, attempt)
        fetch = self._fetches.get(key)
        if fetch is None:
            fetch = asyncio.create_task(self._fetch(sync, target, own_dir, mark))
            self._fetches[key] = fetch
            excess = len(self._fetches) - self.KEEP
            if excess > 0:  # the oldest that are done (one still running is never dropped)
                for old in [k for k, t in self._fetches.items() if t.done()][:excess]:
                    del self._fetches[old]
        # One task cancelled (killed before start) must not cancel the others' fetch.
        return await asyncio.shield(fetch)

    async def _fetch(self, sync: CodeSync, target: str, own_dir: bool, mark: Path) -> str:
        done = await asyncio.to_thread(_read, mark)
        if done:  # fetched before this agent restarted
            return done
        started = asyncio.get_running_loop().time()
        commit = await fetch_code(sync, target, own_dir, self.timeout)
        await asyncio.to_thread(mark.write_text, commit + "\n")
        log.info(
            "agent.code_synced",
            source=shown_url(sync.git),
            commit=commit,
            seconds=round(asyncio.get_running_loop().time() - started, 2),
        )
        return commit
