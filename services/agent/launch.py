"""What to start for one task: the `TaskLaunch` a runtime gets, built from the assignment, the
attempt's cluster spec and this agent's settings (environment, hostfile, mounts, limits,
registry credentials, labels). Failures that would recur on any node (an unreadable authFile)
are configuration errors."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from services.agent import environment
from services.agent.runtime import (
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
from shared.messages import Assignment, ClusterSpec, TaskCause, TaskSpec

MAX_AUTH_FILE = 4096  # bytes: three short lines


@dataclass(frozen=True)
class Where:
    """The agent's settings a launch needs."""

    node: str
    work_root: str
    output_root: str
    default_fs_uri: str
    gpu_devices: bool


def task_name(job_id: str, attempt: int, role: str, index: int) -> str:
    return f"muster-{job_id}-{attempt}-{role}-{index}"


def build_launch(
    a: Assignment, spec: TaskSpec, ports: list[int], cluster: ClusterSpec, where: Where
) -> TaskLaunch:
    config, role = a.config, a.config.role(spec.role)
    attempt_dir = Path(where.work_root) / a.job_id / str(a.attempt)
    task_dir = attempt_dir / f"{spec.role}-{spec.index}"
    task_dir.mkdir(parents=True, exist_ok=True)
    hostfile = attempt_dir / "hostfile"
    hostfile.write_text(environment.render_hostfile(cluster, config))
    ctx = environment.TaskContext(
        job_id=a.job_id,
        attempt=a.attempt,
        user=a.user,
        config=config,
        spec=cluster,
        role=spec.role,
        index=spec.index,
        gpus=spec.gpus,
        output_root=where.output_root,
        default_fs_uri=where.default_fs_uri,
        hostfile_path=str(hostfile),
    )
    env = environment.render_env(ctx)
    dirs = environment.resolve_dirs(config, a.user, where.default_fs_uri, where.output_root)
    mounts = [Mount(str(attempt_dir), str(attempt_dir), read_only=False)]
    workdir = str(task_dir)
    for path, is_code in ((dirs.data, False), (dirs.code, True), (dirs.output, False)):
        local = local_path(path)
        if local:
            mounts.append(Mount(local, local))
            if is_code:
                workdir = local
    return TaskLaunch(
        name=task_name(a.job_id, a.attempt, spec.role, spec.index),
        image=config.image,
        command=role.command,
        env=env,
        cpus=role.cpuNumber,
        memory_mb=role.memoryMB,
        shm_mb=role.shmMB,
        gpus=spec.gpus if where.gpu_devices else [],
        mounts=mounts,
        workdir=workdir,
        auth=read_auth_file(config.authFile),
        labels={
            LABEL_JOB: a.job_id,
            LABEL_ATTEMPT: str(a.attempt),
            LABEL_ROLE: spec.role,
            LABEL_INDEX: str(spec.index),
            LABEL_NODE: where.node,
            LABEL_PORTS: ",".join(map(str, ports)),
            LABEL_HOME: where.work_root,
        },
    )


def local_path(path: str | None) -> str | None:
    """A dir field usable on this machine: an absolute path or a file:// URI."""
    if not path:
        return None
    if path.startswith("file://"):
        path = path[len("file://") :]
    return path if path.startswith("/") else None


def read_auth_file(path: str | None) -> RegistryAuth | None:
    """authFile: three lines — registry server, user name, password. Errors never show the contents."""
    local = local_path(path)
    if not local:
        return None
    try:
        if not stat.S_ISREG(os.stat(local).st_mode):  # a FIFO would block, a device never end
            raise LaunchError(f"authFile {local}: not a regular file", TaskCause.CONFIG)
        with open(local, "rb") as f:
            data = f.read(MAX_AUTH_FILE + 1)
    except OSError as exc:
        raise LaunchError(f"cannot read authFile {local}: {exc.strerror}", TaskCause.CONFIG) from None
    if len(data) > MAX_AUTH_FILE:
        raise LaunchError(f"authFile {local}: larger than {MAX_AUTH_FILE} bytes", TaskCause.CONFIG)
    lines = data.decode("utf-8", "replace").splitlines()
    if len(lines) < 3:
        raise LaunchError(f"authFile {local}: expected 3 lines (server, user, password)", TaskCause.CONFIG)
    return RegistryAuth(server=lines[0].strip(), username=lines[1].strip(), password=lines[2].rstrip("\r\n"))
