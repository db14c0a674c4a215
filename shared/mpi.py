"""MPI jobs: `extras.mpi` marks a job as an MPI job (Arena's MPIJob shape) and says which role
launches `mpirun` and which hosts its ranks. Pure: no I/O.

    "extras": {"mpi": {"launcher": "worker"}}                        # rank 0 of the workers launches
    "extras": {"mpi": {"launcher": "launcher", "workers": "worker"}}  # a launcher role of its own

- `launcher`: the role whose task 0 runs its command (`mpirun ...`). Required.
- `workers`: the role whose tasks host the ranks; the MPI hostfile has a line for each of their
  tasks (a host alias of its own, `host_alias`), with a slot per GPU (1 for a CPU-only role).
  Default: the launcher's role when the job has one role, the other role when it has two;
  required with more.

Only the launcher task runs its command. Every other task of the workers role only hosts ranks
(its command is not run: it waits), and the job ends with the launcher: it succeeds when the
launcher succeeds (the rest are stopped) and fails when the launcher or any worker fails.
A launcher role of its own has one task and hosts no ranks (unless it is also the workers role).
MPI roles cannot be elastic: the hostfile is fixed when `mpirun` starts.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from muster.shared.fielderror import FieldError

if TYPE_CHECKING:  # only named in annotations: shared/jobconfig.py runs this module's `errors`
    from muster.shared.jobconfig import JobConfig

KEY = "mpi"  # extras.mpi
FIELDS = ("launcher", "workers")
# What a task that only hosts ranks runs instead of its command: it waits until it is stopped.
HOST_RANKS_COMMAND = "exec sleep infinity"


@dataclass(frozen=True)
class MpiShape:
    launcher: str  # the role whose task 0 runs mpirun
    workers: str  # the role whose tasks host the ranks (the hostfile)

    def is_launcher(self, role: str, index: int) -> bool:
        return role == self.launcher and index == 0

    def hosts_ranks_only(self, role: str, index: int) -> bool:
        """A workers task other than the launcher: it waits while mpirun starts ranks in it."""
        return role == self.workers and not self.is_launcher(role, index)


def shape(config: JobConfig) -> MpiShape | None:
    """The job's MPI shape, or None when it is not an MPI job (validated configs only)."""
    asked = config.extras.get(KEY)
    if not isinstance(asked, dict):
        return None
    names = [r.name for r in config.taskRoles]
    launcher = asked.get("launcher")
    workers = asked.get("workers") or _default_workers(launcher, names)
    if not isinstance(launcher, str) or not isinstance(workers, str):
        return None
    return MpiShape(launcher=launcher, workers=workers)


def _default_workers(launcher: Any, names: list[str]) -> str | None:
    if len(names) == 1:
        return names[0]
    if len(names) == 2 and launcher in names:
        return next(n for n in names if n != launcher)
    return None


def errors(data: dict[str, Any]) -> list[FieldError]:
    """What is wrong with a raw config's `extras.mpi`, each naming the field and the reason."""
    extras = data.get("extras")
    if not isinstance(extras, dict) or KEY not in extras:
        return []
    asked = extras[KEY]
    at = f"extras.{KEY}"
    if not isinstance(asked, dict):
        return [FieldError(path=at, reason='must be an object: {"launcher": ROLE, "workers": ROLE}')]
    out = [FieldError(path=f"{at}.{k}", reason="unknown field") for k in asked if k not in FIELDS]
    raw_roles = data.get("taskRoles")
    roles = [r for r in raw_roles if isinstance(r, dict)] if isinstance(raw_roles, list) else []
    names = [r["name"] for r in roles if isinstance(r.get("name"), str)]
    listed = ", ".join(names)
    launcher, workers = asked.get("launcher"), asked.get("workers")
    if launcher is None:
        out.append(FieldError(path=f"{at}.launcher", reason="required: the role whose task 0 runs mpirun"))
    elif not isinstance(launcher, str) or launcher not in names:
        out.append(
            FieldError(path=f"{at}.launcher", reason=f"must name a task role ({listed}), got {launcher!r}")
        )
    if workers is not None and (not isinstance(workers, str) or workers not in names):
        out.append(
            FieldError(path=f"{at}.workers", reason=f"must name a task role ({listed}), got {workers!r}")
        )
    if workers is None and launcher in names:
        workers = _default_workers(launcher, names)
        if workers is None:
            out.append(
                FieldError(path=f"{at}.workers", reason="required when the job has more than two roles")
            )
    if out:
        return out
    for i, role in enumerate(roles):
        name = role.get("name")
        if name not in (launcher, workers):
            continue
        if role.get("minTaskNumber") is not None or role.get("maxTaskNumber") is not None:
            out.append(
                FieldError(
                    path=f"taskRoles[{i}].minTaskNumber",
                    reason="an MPI role cannot be elastic: the hostfile is fixed when mpirun starts",
                )
            )
        n = role.get("taskNumber")
        if name == launcher != workers and isinstance(n, int) and n != 1:
            out.append(
                FieldError(
                    path=f"taskRoles[{i}].taskNumber",
                    reason=f"an MPI launcher role of its own runs one task (mpirun), got {n}",
                )
            )
    return out


def slots(config: JobConfig, role: str) -> int:
    """Ranks one task of `role` hosts: its GPUs, or 1 for a CPU-only role."""
    gpus = config.role(role).gpu_devices
    return gpus if gpus > 0 else 1


# Open MPI 4.1 takes node names of letters, digits, '-' and '.' only (it refuses '_'), cuts a name
# at its first '.' (a domain), and overflows a buffer (stack smashing) on names of 58 characters
# or more: an alias stays within ALIAS_MAX.
ALIAS_PREFIX = "muster-mpi-"
ALIAS_ROLE_MAX = 30
ALIAS_MAX = len(ALIAS_PREFIX) + ALIAS_ROLE_MAX + 1 + 10  # 52: up to a 10-digit index


def host_alias(role: str, index: int) -> str:
    """The hostfile's name for one workers task (`muster-mpi-<role>-<index>`): every task gets a
    line of its own, so mpirun starts a daemon in each (muster-rsh maps the name back to the task
    through the cluster spec) even when tasks share a node and so an address. Not a real host
    name: mpirun never resolves it (OMPI_MCA_if_base_do_not_resolve=1). Unique within an attempt:
    only the one workers role has aliases, and the index ends the name."""
    safe = role.lower().replace("_", "-")[:ALIAS_ROLE_MAX]
    return f"{ALIAS_PREFIX}{safe}-{index}"


# The longest prefix Open MPI 4.1 reads right in an if_include: it computes a netmask as
# `((1 << prefix) - 1) << (32 - prefix)` (opal_net_prefix2netmask), and `1 << 32` is undefined in
# C; on x86 it is 1, so a /32 becomes netmask 0.0.0.0 and includes every interface ("Searching
# for include address+prefix: 192.0.2.2 / 32", then "Found match" for lo, eth0 and docker0).
# On a Docker host the TCP BTL then also connects to peers' docker0 address (172.17.0.1, the same
# on every Docker host), and dockerd's rule masquerades what leaves 172.17.0.0/16 by another
# interface (here lo): the peer gets a connection from a source address it does not know for
# that interface, drops it ("dropped inbound connection"), and the ranks wait in MPI_Allreduce
# for ever. So the whole gang on one node (one address) hung; a /31 holds only that interface.
MAX_PREFIX = 31


def common_network(addresses: list[str]) -> str | None:
    """The smallest IPv4 network (CIDR) holding every address, and at least a /31 (MAX_PREFIX:
    one node's address alone gives it and its neighbour), for Open MPI's tcp if_include: on a
    host with several interfaces (lo, docker0, a management network) the ranks then use only the
    one the gang's addresses are on. None when an address is not an IPv4 literal (a host name)."""
    try:
        ips = [ipaddress.IPv4Address(a) for a in addresses]
    except ValueError:
        return None
    if not ips:
        return None
    prefix = MAX_PREFIX
    first = int(ips[0])
    for ip in ips[1:]:
        prefix = min(prefix, 32 - (first ^ int(ip)).bit_length())
    return str(ipaddress.IPv4Network((first, prefix), strict=False))
