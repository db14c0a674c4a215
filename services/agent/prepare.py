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
  checkout), once per attempt; else once per job on a node, into the job's directory there
  (`<work root>/<job>/git`, not mounted), and each attempt gets a checkout of the commit fetched
  in `<attempt dir>/code` (mounted with the attempt dir), cloned from it without fetching again:
  a retry runs the code its first attempt ran, as it was fetched; tasks get MUSTER_CODE_DIR (and
  PAI_CODE_DIR when codeDir is unset) and start there;
- shared by an attempt's tasks on a node (whoever comes first fetches, the others wait for it);
  shallow (`--depth 1`) where the server allows, within MUSTER_CODE_SYNC_TIMEOUT seconds
  (default 300), without prompts, hooks or remote helpers;
- a local repository (a path or file://) must lie under the submitter's data roots: the agent
  copies nothing a job could not mount;
- git runs on the host (never in the task's image);
- credentials in the URL (`https://user:token@host/...`) never reach git's command line, which
  every local user can read (`ps`): git gets the URL without them and asks a credential helper
  for them, a shell function on its command line that prints them from git's environment
  (readable, as /proc/PID/environ, only by the agent's user), only for the URL's own protocol
  and host (`_credentials`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import signal
import urllib.parse
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from muster.services.agent.runtime import LaunchError, Mount
from muster.shared import hostpaths, settings
from muster.shared.jobconfig import CodeSync, JobConfig, shown_url
from muster.shared.messages import Dataset, TaskCause

log = structlog.get_logger(service="agent")

CODE_SYNC_TIMEOUT = settings.seconds("MUSTER_CODE_SYNC_TIMEOUT", 300.0, low=1)
SYNCED_MARK = ".muster-code-sync"  # in the attempt dir: the fetch of this attempt is done
FETCHED_MARK = "git.synced"  # in the job's dir: its fetch is done (the commit, the source's digest)
GIT_PROTOCOLS = "https:http:ssh:git:file"
MAX_ERROR = 300  # characters of git's own words kept in a reason
# What git says (LC_ALL=C) when this node's disk is full: the node's failure, not the job's config.
DISK_FULL = ("No space left on device", "Disk quota exceeded")


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


# git's credential helper for a codeSync URL's user info (`_credentials`): reads what git asks
# (`protocol=`, `host=`, ... up to an empty line) and, for a `get` of the URL's own protocol and
# host, answers the username and password from git's environment. `printf` is a shell builtin:
# the values are never any process's arguments. Other actions (store, erase) do nothing.
CREDENTIAL_HELPER = (
    '!f() { p=; h=; while IFS= read -r l && [ -n "$l" ]; do case "$l" in '
    'protocol=*) p="${l#protocol=}";; host=*) h="${l#host=}";; esac; done; '
    '[ "$1" = get ] && [ "$p" = "$MUSTER_GIT_PROTOCOL" ] && [ "$h" = "$MUSTER_GIT_HOST" ] || return 0; '
    'printf "username=%s\\npassword=%s\\n" "$MUSTER_GIT_USERNAME" "$MUSTER_GIT_PASSWORD"; }; f'
)


def _credentials(url: str) -> tuple[str, dict[str, str]]:
    """`url` as git gets it, and what git's environment adds for CREDENTIAL_HELPER. An http(s)
    URL's user info (percent-decoded, as git decodes it; a user without a password gets an empty
    one, so nothing prompts) moves to the environment; other schemes keep their user (ssh's login)
    and lose a password, which none of them can use without a prompt. LaunchError(CONFIG) for user
    info holding a line break or NUL, which no environment or credential protocol can carry."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    if not sep or "@" not in authority:
        return url, {}
    userinfo, host = authority.rsplit("@", 1)
    user, colon, password = userinfo.partition(":")
    if scheme.lower() not in ("http", "https"):
        return f"{scheme}://{user}@{host}{slash}{path}" if user else f"{scheme}://{host}{slash}{path}", {}
    env = {
        "MUSTER_GIT_PROTOCOL": scheme.lower(),
        "MUSTER_GIT_HOST": urllib.parse.unquote(host),
        "MUSTER_GIT_USERNAME": urllib.parse.unquote(user),
        "MUSTER_GIT_PASSWORD": urllib.parse.unquote(password) if colon else "",
    }
    if any(c in v for v in env.values() for c in "\n\r\0"):
        raise LaunchError(
            f"codeSync.git {shown_url(url)}: its user info holds a line break or NUL", TaskCause.CONFIG
        )
    return f"{scheme}://{host}{slash}{path}", env


async def _git(
    args: list[str], cwd: str, deadline: float, secrets: dict[str, str] | None = None
) -> tuple[int, str]:
    """Run git (no prompt, no hooks, no system or global config, no remote helpers) until
    `deadline` (loop time); (exit code, its stderr). Killed, its whole group, at the deadline.
    `secrets`: `_credentials`' environment, for CREDENTIAL_HELPER (only the helper git is
    given: none from a checkout's own config)."""
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
    helper: list[str] = []
    if secrets:
        env.update(secrets)
        helper = ["-c", "credential.helper=", "-c", f"credential.helper={CREDENTIAL_HELPER}"]
    proc = await asyncio.create_subprocess_exec(
        "git",
        "-c",
        "core.hooksPath=/dev/null",
        "-c",
        "advice.detachedHead=false",
        *helper,
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
    bare, secrets = _credentials(url)

    def failed(why: str) -> LaunchError:
        for value in (secrets.get("MUSTER_GIT_PASSWORD"), secrets.get("MUSTER_GIT_USERNAME")):
            if value and len(value) >= 4:  # as git might echo them (a one-letter user would garble)
                why = why.replace(value, "***")
        lines = [line.strip() for line in _masked(why, url).splitlines() if line.strip()]
        said = "; ".join(lines[-2:])[:MAX_ERROR] or "git failed"
        if why == "timed out":
            said = f"not done within {timeout:g}s (MUSTER_CODE_SYNC_TIMEOUT)"
        if any(full in why for full in DISK_FULL):  # this node's, not the job's: elsewhere it runs
            return LaunchError(f"{what}: this node's disk is full: {said}", TaskCause.PLATFORM)
        return LaunchError(f"{what}: {said}", TaskCause.CONFIG)

    await asyncio.to_thread(_make_target, target, own_dir)
    code, err = await _git(["init", "-q", "."], target, deadline)
    if code != 0:
        raise failed(err)
    checkout = "FETCH_HEAD"
    full = sync.commit is not None and len(sync.commit) < 40  # an abbreviated commit: no shallow fetch
    if not full:
        fetch = ["fetch", "-q", "--no-tags", "--depth", "1", "--", bare, ref]
        code, err = await _git(fetch, target, deadline, secrets)
        if code != 0 and sync.commit is not None and err != "timed out":
            full = True  # a server that gives no commit by id: fetch its branches and look there
        elif code != 0:
            raise failed(err)
    if full:
        refs = "+refs/heads/*:refs/remotes/sync/*"
        code, err = await _git(["fetch", "-q", "--no-tags", "--", bare, refs], target, deadline, secrets)
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
    LaunchError) is kept for the attempt's later tasks (bounded: the most recent attempts). With
    `shared` (the job's fetch on this node, workdirs.job_code), the source is fetched there once
    per job and each attempt's code is a checkout of that commit cloned from it."""

    KEEP = 256

    def __init__(self, timeout: float = CODE_SYNC_TIMEOUT):
        self.timeout = timeout
        self._fetches: OrderedDict[tuple[str, int], asyncio.Task[str]] = OrderedDict()
        self._jobs: OrderedDict[str, asyncio.Task[str]] = OrderedDict()  # the jobs' shared fetches

    async def sync(
        self,
        job_id: str,
        attempt: int,
        sync: CodeSync,
        target: str,
        own_dir: bool,
        mark: Path,
        shared: Path | None = None,
    ) -> str:
        key = (job_id, attempt)
        fetch = self._fetches.get(key)
        if fetch is None:
            fetch = asyncio.create_task(self._fetch(job_id, sync, target, own_dir, mark, shared))
            self._fetches[key] = fetch
            _bound(self._fetches, self.KEEP)
        # One task cancelled (killed before start) must not cancel the others' fetch.
        return await asyncio.shield(fetch)

    async def _fetch(
        self, job_id: str, sync: CodeSync, target: str, own_dir: bool, mark: Path, shared: Path | None
    ) -> str:
        done = await asyncio.to_thread(_read, mark)
        if done:  # fetched before this agent restarted
            return done
        if shared is not None and not own_dir:
            commit = await self._fetched(job_id, sync, shared)
            await checkout(shared, target, commit, self.timeout)
        else:
            commit = await self._fetch_into(sync, target, own_dir)
        await asyncio.to_thread(mark.write_text, commit + "\n")
        return commit

    async def _fetch_into(self, sync: CodeSync, target: str, own_dir: bool) -> str:
        started = asyncio.get_running_loop().time()
        commit = await fetch_code(sync, target, own_dir, self.timeout)
        log.info(
            "agent.code_synced",
            source=shown_url(sync.git),
            commit=commit,
            seconds=round(asyncio.get_running_loop().time() - started, 2),
        )
        return commit

    async def _fetched(self, job_id: str, sync: CodeSync, shared: Path) -> str:
        """The job's fetch on this node: made once (a failed one is tried again by a later
        attempt), found on disk after a restart, made again if its directory was removed."""
        fetch = self._jobs.get(job_id)
        reusable = fetch is not None and (
            not fetch.done()
            or (
                not fetch.cancelled() and fetch.exception() is None and await asyncio.to_thread(shared.is_dir)
            )
        )
        if fetch is None or not reusable:
            fetch = asyncio.create_task(self._fetch_shared(sync, shared))
            self._jobs[job_id] = fetch
            self._jobs.move_to_end(job_id)
            _bound(self._jobs, self.KEEP)
        return await asyncio.shield(fetch)

    async def _fetch_shared(self, sync: CodeSync, shared: Path) -> str:
        mark = shared.with_name(FETCHED_MARK)
        source = hashlib.sha256(f"{sync.git}\n{sync.branch}\n{sync.commit}".encode()).hexdigest()[:16]
        kept = (await asyncio.to_thread(_read, mark) or "").split()
        if len(kept) == 2 and kept[1] == source and await asyncio.to_thread(shared.is_dir):
            return kept[0]
        # Not fetched, half fetched (the agent died), or from another source: from scratch.
        await asyncio.to_thread(mark.unlink, missing_ok=True)
        await asyncio.to_thread(shutil.rmtree, shared, True)
        commit = await self._fetch_into(sync, str(shared), False)
        await asyncio.to_thread(mark.write_text, f"{commit} {source}\n")
        return commit


def _bound(tasks: OrderedDict[Any, asyncio.Task[str]], keep: int) -> None:
    """Drop the oldest that are done beyond `keep` (one still running is never dropped)."""
    excess = len(tasks) - keep
    if excess > 0:
        for old in [k for k, t in tasks.items() if t.done()][:excess]:
            del tasks[old]


async def checkout(source: Path, target: str, commit: str, timeout: float = CODE_SYNC_TIMEOUT) -> None:
    """A checkout of `commit` in `target`, cloned from this node's fetch of the job (`source`):
    nothing is fetched from the job's server again; a half-made one (the agent died) is made
    anew. A failure here is this node's (its disk), not the job's."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    await asyncio.to_thread(shutil.rmtree, target, True)
    parent = str(Path(target).parent)
    await asyncio.to_thread(os.makedirs, parent, exist_ok=True)
    code, err = await _git(["clone", "-q", "--no-checkout", "--", str(source), target], parent, deadline)
    if code == 0:
        code, err = await _git(["checkout", "-q", "-f", "--detach", commit], target, deadline)
    if code != 0:
        said = "; ".join(line.strip() for line in err.splitlines() if line.strip())[-MAX_ERROR:]
        raise LaunchError(f"codeSync: cannot check out {commit[:12]} from this node's fetch: {said}")
