"""What to start for one task: the `TaskLaunch` a runtime gets, built from the assignment, the
attempt's cluster spec and this agent's settings (environment, hostfile, mounts, limits,
registry credentials, labels). Failures that would recur on any node (an unreadable authFile)
are configuration errors."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import signal
import stat
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from dataclasses import field as dc_field
from pathlib import Path
from typing import Literal

from muster.services.agent import environment, gpushare, rsh, workdirs
from muster.services.agent.prepare import Prepared
from muster.services.agent.runtime import (
    LABEL_ATTEMPT,
    LABEL_HOME,
    LABEL_INDEX,
    LABEL_JOB,
    LABEL_NODE,
    LABEL_PORTS,
    LABEL_ROLE,
    LaunchError,
    Mount,
    RegistryAuth,
    TaskLaunch,
)
from muster.shared import hostpaths, mpi
from muster.shared.jobconfig import RESIZE_SIGNALS
from muster.shared.messages import Assignment, ClusterSpec, GpuSharing, TaskCause, TaskSpec

MAX_AUTH_FILE = 4096  # bytes: three short lines


@dataclass(frozen=True)
class Where:
    """The agent's settings a launch needs."""

    node: str
    work_root: str
    output_root: str
    default_fs_uri: str
    gpu_devices: bool
    data_roots: tuple[str, ...] = ()  # where dir fields may point ({user}: the submitter)
    containers: bool = True  # tasks run in containers (mounts are seen at their container paths)
    gpu_sharing: GpuSharing = GpuSharing.TIMESLICE  # how tasks holding part of a GPU share it
    gpu_memory_mb: Mapping[int, int] = dc_field(default_factory=dict, hash=False)  # GPU index -> MB


def gpu_share(a: Assignment, spec: TaskSpec, where: Where) -> tuple[int, Path | None] | None:
    """A task holding part of one GPU: its share in thousandths and, with MPS, its GPU's daemon's
    pipe directory; None for a task of whole GPUs (or none)."""
    milli = gpushare.share_milli(a.config, spec)
    if milli is None:
        return None
    if where.gpu_sharing is not GpuSharing.MPS:
        return milli, None
    return milli, gpushare.mps_dirs(where.work_root, spec.gpus[0])[0]


def task_name(job_id: str, attempt: int, role: str, index: int) -> str:
    return f"muster-{job_id}-{attempt}-{role}-{index}"


def attempt_path(where: Where, a: Assignment) -> Path:
    """The attempt's directory on this node, mounted into each of its tasks here (what is in it,
    and how long it is kept: services/agent/workdirs.py)."""
    return workdirs.attempt_dir(where.work_root, a.job_id, a.attempt)


def task_env(a: Assignment, spec: TaskSpec, cluster: ClusterSpec, where: Where) -> dict[str, str]:
    """The task's environment for the gang of `cluster`; writes the attempt's MPI hostfile and,
    for an elastic job, the task's env file (MUSTER_ENV_FILE: the platform's variables, not the
    job's own jobEnvs, as `export NAME='value'` lines), both replaced whole, never half-written.
    Called at launch and again for each new spec version of an elastic attempt."""
    attempt_dir = attempt_path(where, a)
    task_dir = workdirs.task_dir(where.work_root, a.job_id, a.attempt, spec.role, spec.index)
    task_dir.mkdir(parents=True, exist_ok=True)
    hostfile = attempt_dir / "hostfile"
    _replace(hostfile, environment.render_hostfile(cluster, a.config))
    # An MPI job's launcher starts its daemons in the other tasks through this (docs/mpi.md).
    rsh_agent = str(rsh.install(attempt_dir)) if mpi.shape(a.config) is not None else None
    share = gpu_share(a, spec, where)
    ctx = environment.TaskContext(
        job_id=a.job_id,
        attempt=a.attempt,
        user=a.user,
        config=a.config,
        spec=cluster,
        role=spec.role,
        index=spec.index,
        gpus=spec.gpus,
        output_root=where.output_root,
        default_fs_uri=where.default_fs_uri,
        hostfile_path=str(hostfile),
        rsh_agent_path=rsh_agent,
        gpu_milli=share[0] if share else None,
        gpu_sharing=where.gpu_sharing,
        mps_pipe=str(share[1]) if share and share[1] else None,
        gpu_memory_mb=where.gpu_memory_mb.get(spec.gpus[0], 0) if share else 0,
    )
    env = environment.render_env(ctx)
    if a.config.elastic:
        env_file = task_dir / "env"
        env["MUSTER_ENV_FILE"] = str(env_file)
        env["MUSTER_SPEC_VERSION"] = str(cluster.version)
        # The job's own values (secrets among them) stay out of files; a name it sets that the
        # platform sets too (MASTER_PORT, TF_CONFIG, a PAI_ name) holds the platform's value,
        # which the file carries: left out, a task that sourced the file kept the old gang's.
        own = set(a.config.jobEnvs)
        if own:
            bare = a.config.model_copy(update={"jobEnvs": {}})
            own -= set(environment.render_env(dataclasses.replace(ctx, config=bare)))
        told = dict(env)
        if where.containers and spec.gpus:  # as the container sees its GPUs (docker_runtime)
            told["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(spec.gpus)))
        _replace(
            env_file,
            "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(told.items()) if k not in own),
        )
    return env


def spec_version(a: Assignment, spec: TaskSpec, where: Where) -> int:
    """The spec version an elastic task's env file describes (0: none written, or unreadable):
    what an agent that adopts the task knows it was told."""
    path = workdirs.task_dir(where.work_root, a.job_id, a.attempt, spec.role, spec.index) / "env"
    try:
        for line in path.read_text().splitlines():
            if line.startswith("export MUSTER_SPEC_VERSION="):
                return int(line.partition("=")[2])
    except (OSError, ValueError):
        pass
    return 0


def resize_signal(extras: dict[str, object]) -> int | None:
    """The signal an elastic job asked for on each change of its gang (`extras.elastic.signal`),
    or None (the default: frameworks that rendezvous by themselves need none)."""
    asked = extras.get("elastic")
    name = asked.get("signal") if isinstance(asked, dict) else None
    return int(signal.Signals[name]) if name in RESIZE_SIGNALS else None


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def build_launch(
    a: Assignment,
    spec: TaskSpec,
    ports: list[int],
    cluster: ClusterSpec,
    where: Where,
    prepared: Prepared | None = None,
    auth: RegistryAuth | Literal["read"] | None = "read",
) -> TaskLaunch:
    """`prepared`: the job's datasets and synced code (services/agent/prepare.py), if any.
    `auth`: the registry credentials from its authFile (`task_auth`), when the caller has read
    them already (the agent does, off its event loop); "read": read them here."""
    config, role = a.config, a.config.role(spec.role)
    image = config.image_for(spec.role)  # the role's own image, else the job's
    attempt_dir = attempt_path(where, a)
    task_dir = workdirs.task_dir(where.work_root, a.job_id, a.attempt, spec.role, spec.index)
    env = task_env(a, spec, cluster, where)
    dirs = environment.resolve_dirs(config, a.user, where.default_fs_uri, where.output_root)
    roots = hostpaths.roots_for(list(where.data_roots), a.user)
    mounts = [Mount(str(attempt_dir), str(attempt_dir), read_only=False)]
    workdir = str(task_dir)
    fields = (("dataDir", dirs.data, False), ("codeDir", dirs.code, True), ("outputDir", dirs.output, False))
    for field, path, is_code in fields:
        local = local_path(path)
        if not local:
            continue
        # outputDir unset: the platform's own default, under its output root.
        real = local if field == "outputDir" and not config.outputDir else allowed(field, local, roots)
        mounts.append(Mount(real, real))
        if is_code:
            workdir = real
    if prepared is not None:
        mounts += prepared.mounts
        env.update(prepared.env)
        if prepared.code_dir:
            workdir = prepared.code_dir
            env["MUSTER_CODE_DIR"] = prepared.code_dir
            if not config.codeDir:
                env["PAI_CODE_DIR"] = prepared.code_dir
    share = gpu_share(a, spec, where)
    mps_pipe = share[1] if share else None
    if mps_pipe is not None:  # the task talks to its GPU's MPS daemon through this directory
        mounts.append(Mount(str(mps_pipe), str(mps_pipe)))
    shape = mpi.shape(config)
    hosts_only = shape is not None and shape.hosts_ranks_only(spec.role, spec.index)
    return TaskLaunch(
        name=task_name(a.job_id, a.attempt, spec.role, spec.index),
        image=image,
        # An MPI worker that is not the launcher only hosts ranks: it waits to be stopped.
        command=mpi.HOST_RANKS_COMMAND if hosts_only else role.command,
        env=env,
        cpus=role.cpuNumber,
        memory_mb=role.memoryMB,
        shm_mb=role.shmMB,
        gpus=spec.gpus if where.gpu_devices else [],
        mounts=mounts,
        workdir=workdir,
        auth=task_auth(a, spec, where) if auth == "read" else auth,
        labels={
            LABEL_JOB: a.job_id,
            LABEL_ATTEMPT: str(a.attempt),
            LABEL_ROLE: spec.role,
            LABEL_INDEX: str(spec.index),
            LABEL_NODE: where.node,
            LABEL_PORTS: ",".join(map(str, ports)),
            LABEL_HOME: where.work_root,
        },
        extras=config.extras,
        # MPS clients in containers share the host's IPC namespace with the MPS server.
        ipc_host=mps_pipe is not None,
    )


def task_auth(a: Assignment, spec: TaskSpec, where: Where) -> RegistryAuth | None:
    """The registry credentials the task's image is pulled with, from its job's authFile (if any).
    Blocks up to AUTH_TIMEOUT (a hung network filesystem): the agent calls it in a thread."""
    config = a.config
    return read_auth_file(
        config.authFile, list(where.data_roots), a.user, config.image_for(spec.role), config.images
    )


def local_path(path: str | None) -> str | None:
    """A dir field usable on this machine: an absolute path or a file:// URI."""
    if not path:
        return None
    if path.startswith("file://"):
        path = path[len("file://") :]
    return path if path.startswith("/") else None


def allowed(field: str, path: str, roots: list[str]) -> str:
    """`path` resolved (symlinks followed), if under one of `roots`; else a configuration error
    naming the field: nothing outside them is ever mounted or read."""
    try:
        return hostpaths.resolve_under_roots(path, roots)
    except ValueError as exc:
        raise LaunchError(f"{field} {path}: {exc}", TaskCause.CONFIG) from None


AUTH_TIMEOUT = 5.0  # seconds to read an authFile (a hung network filesystem must not hang us)
_readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="authfile")


def read_auth_file(
    path: str | None,
    roots: list[str] | None = None,
    user: str = "",
    image: str = "",
    images: list[str] | None = None,
) -> RegistryAuth | None:
    """authFile: three lines — registry server, user name, password. Read only from the
    submitting user's own roots (those with {user}), only a regular file of at most 4 KiB,
    within AUTH_TIMEOUT, and only for the registry of the task's `image`. Where roles have their
    own images (`images`: every image of the job), a role whose image is on another registry
    than the file's gets no credentials (it pulls anonymously); a file whose registry none of the
    job's images is on is refused. Errors never show the contents."""
    local = local_path(path)
    if not local:
        return None
    own = hostpaths.roots_for([r for r in roots or [] if hostpaths.USER in r], user)
    if not own:
        raise LaunchError(
            f"authFile {local}: no per-user data root ({{user}}) is configured to keep it in",
            TaskCause.CONFIG,
        )
    real = allowed("authFile", local, own)
    future = _readers.submit(_read_bounded, real, owners(real, own))
    try:
        data = future.result(timeout=AUTH_TIMEOUT)
    except FutureTimeout:
        raise LaunchError(f"authFile {local}: not read within {AUTH_TIMEOUT:g}s", TaskCause.CONFIG) from None
    lines = data.decode("utf-8", "replace").splitlines()
    if len(lines) < 3:
        raise LaunchError(f"authFile {local}: expected 3 lines (server, user, password)", TaskCause.CONFIG)
    auth = RegistryAuth(server=lines[0].strip(), username=lines[1].strip(), password=lines[2].rstrip("\r\n"))
    if image and registry_host(auth.server) != image_registry(image):
        if any(registry_host(auth.server) == image_registry(other) for other in images or []):
            return None  # another role's registry: this role's image is pulled without them
        raise LaunchError(
            f"authFile {local}: its registry {registry_host(auth.server)} is not the image's "
            f"({image_registry(image)}); credentials are sent only to the registry of the job's image",
            TaskCause.CONFIG,
        )
    return auth


def owners(path: str, own: list[str]) -> frozenset[int]:
    """Whose an authFile at `path` (resolved, under one of the user's own roots `own`) may be:
    the owner of that root (the user, where each has a directory of their own), root, or the
    agent itself. An agent running as root so never sends a file another user put in a shared
    or writable directory as this user's credentials."""
    uids = {0, os.geteuid()}
    for root in own:
        real_root = os.path.realpath(root)
        if hostpaths.under(path, real_root):
            with contextlib.suppress(OSError):
                uids.add(os.stat(real_root).st_uid)
    return frozenset(uids)


def _read_bounded(path: str, allowed_uids: frozenset[int] | None = None) -> bytes:
    """A regular file of at most MAX_AUTH_FILE bytes, owned by one of `allowed_uids`: opened
    without following a link and without blocking (a FIFO would block, a device never end),
    checked with fstat (on what was opened, so nothing can be swapped in between), then read.
    A regular file's read cannot block for long, but one on a hung network filesystem can: the
    caller bounds the whole with AUTH_TIMEOUT."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise LaunchError(f"cannot read authFile {path}: {exc.strerror}", TaskCause.CONFIG) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LaunchError(f"authFile {path}: not a regular file", TaskCause.CONFIG)
        if info.st_size > MAX_AUTH_FILE:
            raise LaunchError(f"authFile {path}: larger than {MAX_AUTH_FILE} bytes", TaskCause.CONFIG)
        if allowed_uids is not None and info.st_uid not in allowed_uids:
            raise LaunchError(
                f"authFile {path}: owned by uid {info.st_uid}, not by the owner of the user's "
                f"directory (uids {', '.join(map(str, sorted(allowed_uids)))})",
                TaskCause.CONFIG,
            )
        data = os.read(fd, MAX_AUTH_FILE + 1)
    except OSError as exc:
        raise LaunchError(f"cannot read authFile {path}: {exc.strerror}", TaskCause.CONFIG) from None
    finally:
        os.close(fd)
    if len(data) > MAX_AUTH_FILE:
        raise LaunchError(f"authFile {path}: larger than {MAX_AUTH_FILE} bytes", TaskCause.CONFIG)
    return data


DOCKER_HUB = "docker.io"


def image_registry(image: str) -> str:
    """The registry an image reference pulls from, as Docker reads it: the first component when
    it has a '.' or ':' or is 'localhost', else Docker Hub."""
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return registry_host(first)
    return DOCKER_HUB


def registry_host(server: str) -> str:
    """A registry as an authFile or `docker login` may write it (https://index.docker.io/v1/)."""
    host = server.strip().lower()
    for prefix in ("https://", "http://"):
        host = host.removeprefix(prefix)
    host = host.split("/", 1)[0]
    return DOCKER_HUB if host in ("index.docker.io", "registry-1.docker.io", "docker.io") else host
