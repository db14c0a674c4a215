"""What a task sees in its environment: every variable a task is started with, rendered from its
job config and the attempt's ClusterSpec. Pure: no I/O, no clock, same input -> same output.

Owns the variable families users' commands rely on:

- OpenPAI (seed 000 plus the v1 names): PAI_JOB_NAME, PAI_TASK_ROLE_<i>_HOST_LIST,
  PAI_TASK_ROLE_<name>_HOST_LIST, PAI_CONTAINER_HOST_<label>_PORT_LIST, PAI_DEFAULT_FS_URI, ...
- TensorFlow / AI Platform (seed 004): TF_CONFIG and CLUSTER_SPEC, JSON.
- ModelArts / Volcano (seed 002): VC_TASK_INDEX, VC_<ROLE>_HOSTS, VC_<ROLE>_NUM, TF_PS_HOSTS,
  TF_WORKER_HOSTS, MA_TASK_NAME.
- PyTorch: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK, LOCAL_WORLD_SIZE.
- MPI: MUSTER_MPI_HOSTFILE, OMPI_MCA_orte_default_hostfile (and `render_hostfile` for the file);
  for an MPI job (`extras.mpi`, shared/mpi.py) also MUSTER_MPI_NP, MUSTER_MPI_LAUNCHER, the rsh
  agent (OMPI_MCA_plm_rsh_agent) and OMPI_*/PMIX_* settings for the host network (docs/mpi.md).
- GPUs: CUDA_VISIBLE_DEVICES, NVIDIA_VISIBLE_DEVICES; for a task holding part of one GPU also
  MUSTER_GPU_SHARE, MUSTER_GPU_SHARING and, with MPS, CUDA_MPS_* (services/agent/gpushare.py).
- Muster: MUSTER_JOB_ID, MUSTER_ATTEMPT, MUSTER_TASK_ROLE, MUSTER_TASK_INDEX.
- The config's jobEnvs, as plain variables. The platform's variables win over a jobEnvs entry of
  the same name (jobEnvs cannot start with PAI_/MUSTER_, but could say TF_CONFIG or MASTER_ADDR).

"Spec order" is the gang's rank order: role in config order, then index. A spec that does not
hold exactly the config's tasks (one missing, duplicated, extra, or a portList label without its
ports) is a programming error and raises ValueError; nothing here fails on user input.

GPU indexes are rendered as given (host device indexes). A runtime that exposes only the task's
GPUs to it under new numbers (Docker with the NVIDIA runtime numbers them from 0) must rewrite
CUDA_VISIBLE_DEVICES to match.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
from dataclasses import dataclass

from muster.services.agent.gpushare import share_env
from muster.shared import mpi
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import ClusterSpec, Endpoint, GpuSharing

# Role names as TensorFlow's TF_CONFIG and AI Platform's CLUSTER_SPEC spell them; a role name not
# listed is kept as it is.
ROLE_TYPES: dict[str, dict[str, str]] = {
    "TF_CONFIG": {"master": "chief", "chief": "chief", "ps": "ps", "ps_server": "ps", "worker": "worker"},
    "CLUSTER_SPEC": {
        "chief": "master",
        "master": "master",
        "ps": "ps",
        "ps_server": "ps",
        "worker": "worker",
    },
}


@dataclass(frozen=True)
class TaskContext:
    job_id: str
    attempt: int
    user: str
    config: JobConfig
    spec: ClusterSpec
    role: str
    index: int
    gpus: list[int]  # device indexes this task owns on its node
    output_root: str  # where outputDir defaults to: <output_root>/<jobName>
    default_fs_uri: str = ""  # PAI_DEFAULT_FS_URI
    hostfile_path: str | None = None  # where the MPI hostfile will be visible to the task
    rsh_agent_path: str | None = None  # an MPI job's plm_rsh_agent (services/agent/rsh.py)
    # A task holding part of one GPU: its share in thousandths, how this node shares the GPU,
    # its MPS daemon's pipe directory and the device's memory (MB, 0: unknown).
    gpu_milli: int | None = None
    gpu_sharing: GpuSharing = GpuSharing.TIMESLICE
    mps_pipe: str | None = None
    gpu_memory_mb: int = 0


@dataclass(frozen=True)
class Dirs:
    data: str  # "" when unset
    code: str  # "" when unset
    output: str


_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


def resolve_dirs(config: JobConfig, user: str, default_fs_uri: str, output_root: str) -> Dirs:
    """The config's dataDir/codeDir/outputDir with $PAI_DEFAULT_FS_URI, $PAI_USERNAME and
    $PAI_JOB_NAME (or ${...}) expanded; other `$NAME`s are left for the task's shell. outputDir
    defaults to <output_root>/<jobName>, as OpenPAI's hdfs://uri/output/$jobName."""
    known = {"PAI_DEFAULT_FS_URI": default_fs_uri, "PAI_USERNAME": user, "PAI_JOB_NAME": config.jobName}

    def expand(value: str | None) -> str:
        if not value:
            return ""
        return _VAR.sub(lambda m: known.get(m.group(1) or m.group(2), m.group(0)), value)

    output = expand(config.outputDir) or posixpath.join(output_root, config.jobName)
    return Dirs(data=expand(config.dataDir), code=expand(config.codeDir), output=output)


def render_env(ctx: TaskContext) -> dict[str, str]:
    """Every variable the task (ctx.role, ctx.index) is started with; all values are strings."""
    if ctx.config.elastic:
        ctx = dataclasses.replace(ctx, config=for_spec(ctx.config, ctx.spec))
    g = _gang(ctx.spec, ctx.config)
    gang = g.order
    if (ctx.spec.job_id, ctx.spec.attempt) != (ctx.job_id, ctx.attempt):
        raise ValueError(
            f"spec is for {ctx.spec.job_id} attempt {ctx.spec.attempt}, "
            f"task is of {ctx.job_id} attempt {ctx.attempt}"
        )
    at = g.position.get((ctx.role, ctx.index))
    if at is None:
        raise ValueError(f"spec has no task {ctx.role}.{ctx.index}")
    me = gang[at]
    env = _job_envs(ctx.config)  # first, so that every platform variable below wins
    env.update(_openpai(ctx, g, me))
    env.update(_tf_config(ctx, g, "TF_CONFIG"))
    env.update(_tf_config(ctx, g, "CLUSTER_SPEC"))
    env.update(_modelarts(ctx, g))
    env.update(_pytorch(g, me, at, bool(ctx.gpus)))
    env.update(_mpi(ctx, gang, me))
    if ctx.gpu_milli is not None and ctx.gpus:
        env.update(share_env(ctx.gpus, ctx.gpu_milli, ctx.gpu_sharing, ctx.mps_pipe, ctx.gpu_memory_mb))
    else:
        env.update(_gpus(ctx.gpus))
    env.update(_muster(ctx, gang, me))
    return env


def for_spec(config: JobConfig, spec: ClusterSpec) -> JobConfig:
    """The config as large as the spec's version says (an elastic role's size changes)."""
    if not config.elastic:
        return config
    counts: dict[str, int] = {}
    for ep in spec.endpoints:
        counts[ep.role] = counts.get(ep.role, 0) + 1
    return config.sized(counts)


def render_hostfile(spec: ClusterSpec, config: JobConfig) -> str:
    """An MPI hostfile: one `<host> slots=<n>` line per host in spec order, n = the summed slots of
    the host's tasks (a task's slots: its role's gpuNumber, or 1 for a CPU-only role).

    An MPI job (`extras.mpi`) has one line per task of its workers role instead, named by the
    task's host alias (`mpi.host_alias`), n = that task's slots: mpirun starts a daemon for each
    line, and muster-rsh has it run in that very task, so each task's ranks run in it (with its
    GPUs) even when several share a node, and so an address (docs/mpi.md)."""
    config = for_spec(config, spec)
    gang = _gang(spec, config)  # one text for every task of the spec
    if gang.hostfile is not None:
        return gang.hostfile
    shape = mpi.shape(config)
    if shape is not None:
        gang.hostfile = "".join(
            f"{mpi.host_alias(ep.role, ep.index)} slots={mpi.slots(config, ep.role)}\n"
            for ep in gang.order
            if ep.role == shape.workers
        )
        return gang.hostfile
    slots: dict[str, int] = {}
    for ep in gang.order:
        gpus = config.taskRoles[ep.role_no].gpu_devices
        slots[ep.host] = slots.get(ep.host, 0) + (gpus if gpus > 0 else 1)
    gang.hostfile = "".join(f"{host} slots={n}\n" for host, n in slots.items())
    return gang.hostfile


# ------------------------------------------------------------------ the gang


def _ordered(spec: ClusterSpec, config: JobConfig) -> list[Endpoint]:
    """The spec's endpoints in spec order, checked to be exactly the config's tasks."""
    by_key: dict[tuple[str, int], Endpoint] = {}
    for listed in spec.endpoints:
        if (listed.role, listed.index) in by_key:
            raise ValueError(f"spec lists task {listed.role}.{listed.index} twice")
        by_key[(listed.role, listed.index)] = listed
    gang = []
    for role_no, role in enumerate(config.taskRoles):
        # An elastic role's members are any indexes (newest removed first, failed ones replaced
        # by new indexes); a fixed role's are 0..taskNumber-1.
        indexes = sorted(i for r, i in by_key if r == role.name) if role.elastic else range(role.taskNumber)
        if role.elastic and len(indexes) != role.taskNumber:
            raise ValueError(
                f"spec has {len(indexes)} tasks of elastic role {role.name}, not {role.taskNumber}"
            )
        for index in indexes:
            ep = by_key.pop((role.name, index), None)
            if ep is None:
                raise ValueError(f"spec has no task {role.name}.{index}")
            if ep.role_no != role_no:
                raise ValueError(f"spec gives task {role.name}.{index} role_no {ep.role_no}, not {role_no}")
            for port in role.portList:
                if len(ep.ports.get(port.label, [])) != port.portNumber:
                    raise ValueError(
                        f"spec gives task {role.name}.{index} {ep.ports.get(port.label, [])} "
                        f"for port label {port.label!r}, which needs {port.portNumber} port(s)"
                    )
            gang.append(ep)
    if by_key:
        extra = ", ".join(f"{role}.{index}" for role, index in by_key)
        raise ValueError(f"spec lists tasks the config does not have: {extra}")
    return gang


class Gang:
    """A spec's gang in spec order and what each task's environment reads of all of it, worked
    out once for every task of the spec: a task's variables list its whole gang, O(N) each,
    and a process of many sim nodes holds all N tasks (O(N²) if each did it all again)."""

    def __init__(self, spec: ClusterSpec, config: JobConfig) -> None:
        self.order = _ordered(spec, config)
        self.position = {(ep.role, ep.index): i for i, ep in enumerate(self.order)}
        # A task's place in its role's list: its index for a fixed role (0..taskNumber-1); an
        # elastic role's indexes have gaps (a failed task is replaced by a new index), and TF's
        # task.index, OpenPAI's PAI_TASK_ROLE_INDEX and ModelArts' VC_TASK_INDEX are each a place
        # in the host list beside them (MUSTER_TASK_INDEX keeps the task's own index).
        self.in_role: dict[tuple[str, int], int] = {}
        self.addresses: dict[str, list[str]] = {}  # role -> its tasks' addresses, in order
        self.on_node: dict[str, list[Endpoint]] = {}  # node -> its tasks, in order
        for ep in self.order:
            self.in_role[(ep.role, ep.index)] = len(self.addresses.get(ep.role, ()))
            self.addresses.setdefault(ep.role, []).append(ep.address)
            self.on_node.setdefault(ep.node, []).append(ep)
        self._hosts = {role: ",".join(addresses) for role, addresses in self.addresses.items()}
        self._tf: dict[str, dict[str, list[str]]] = {}
        self._tf_json: dict[str, str] = {}  # var -> its cluster as JSON
        self.hostfile: str | None = None  # render_hostfile's text, once made

    def hosts(self, role: str) -> str:
        return self._hosts.get(role, "")

    def tf_cluster(self, var: str, config: JobConfig) -> dict[str, list[str]]:
        if var not in self._tf:
            types = _role_types(config, ROLE_TYPES[var])
            self._tf[var] = {types[r.name]: self.addresses.get(r.name, []) for r in config.taskRoles}
        return self._tf[var]

    def tf_cluster_json(self, var: str, config: JobConfig) -> str:
        """`tf_cluster` as JSON, made once: each task's TF_CONFIG holds it whole (O(N) bytes
        each), and copying a string costs far less than encoding the gang again per task."""
        if var not in self._tf_json:
            self._tf_json[var] = json.dumps(self.tf_cluster(var, config))
        return self._tf_json[var]


_GANGS: dict[int, tuple[ClusterSpec, JobConfig, Gang]] = {}  # id(spec) -> the spec, its config, its gang
_KEEP = 8


def _gang(spec: ClusterSpec, config: JobConfig) -> Gang:
    """The spec's `Gang`, shared by the tasks launched from the same spec object with equal
    configs (each order is decoded apart; a few kept, holding their spec, so an id is never
    reused while kept)."""
    kept = _GANGS.get(id(spec))
    if kept is not None and kept[0] is spec and (kept[1] is config or kept[1] == config):
        return kept[2]
    gang = Gang(spec, config)
    _GANGS.pop(id(spec), None)
    _GANGS[id(spec)] = (spec, config, gang)
    while len(_GANGS) > _KEEP:
        del _GANGS[next(iter(_GANGS))]
    return gang


# ------------------------------------------------------------------ variable families


def _job_envs(config: JobConfig) -> dict[str, str]:
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.jobEnvs.items()}


def _openpai(ctx: TaskContext, gang: Gang, me: Endpoint) -> dict[str, str]:
    config = ctx.config
    role = config.taskRoles[me.role_no]
    dirs = resolve_dirs(config, ctx.user, ctx.default_fs_uri, ctx.output_root)
    kill_all = config.killAllOnCompletedTaskNumber
    env = {
        "PAI_JOB_NAME": config.jobName,
        "PAI_USERNAME": ctx.user,
        "PAI_DEFAULT_FS_URI": ctx.default_fs_uri,
        "PAI_DATA_DIR": dirs.data,
        "PAI_OUTPUT_DIR": dirs.output,
        "PAI_CODE_DIR": dirs.code,
        "PAI_TASK_ROLE_NAME": role.name,
        "PAI_TASK_ROLE_NUM": str(role.taskNumber),
        "PAI_TASK_CPU_NUM": str(role.cpuNumber),
        "PAI_TASK_MEM_MB": str(role.memoryMB),
        "PAI_TASK_GPU_NUM": str(role.gpuNumber),
        "PAI_TASK_ROLE_INDEX": str(gang.in_role[(me.role, me.index)]),
        "PAI_TASK_ROLE_NO": str(me.role_no),
        "PAI_TASKS_NUM": str(config.total_tasks),
        "PAI_TASK_ROLES_NUM": str(len(config.taskRoles)),
        "PAI_KILL_ALL_ON_COMPLETED_TASK_NUM": str(kill_all or 0),
        "PAI_CURRENT_CONTAINER_IP": me.host,
        "PAI_CURRENT_CONTAINER_PORT": str(me.port),
        "PAI_CURRENT_TASK_ROLE_NAME": role.name,
        "PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX": str(gang.in_role[(me.role, me.index)]),
    }
    for i, r in enumerate(config.taskRoles):
        env[f"PAI_TASK_ROLE_{i}_HOST_LIST"] = gang.hosts(r.name)
        env[f"PAI_TASK_ROLE_{r.name}_HOST_LIST"] = gang.hosts(r.name)
    labels = [p.label for p in role.portList]
    for label in labels:
        env[f"PAI_CONTAINER_HOST_{label}_PORT_LIST"] = ",".join(map(str, me.ports[label]))
    env["PAI_CONTAINER_HOST_PORT_LIST"] = ";".join(
        f"{label}:{','.join(map(str, me.ports[label]))}" for label in labels
    )
    return env


def _role_types(config: JobConfig, table: dict[str, str]) -> dict[str, str]:
    """Role name -> its type under `table`. Two roles that would get the same type (say `master`
    and `chief`) both keep their own names, so no two roles ever share a type."""
    mapped = {r.name: table.get(r.name, r.name) for r in config.taskRoles}
    taken = list(mapped.values())
    return {name: t if taken.count(t) == 1 else name for name, t in mapped.items()}


def _tf_config(ctx: TaskContext, gang: Gang, var: str) -> dict[str, str]:
    types = _role_types(ctx.config, ROLE_TYPES[var])
    cluster = gang.tf_cluster_json(var, ctx.config)
    task = json.dumps({"type": types[ctx.role], "index": gang.in_role[(ctx.role, ctx.index)]})
    # json.dumps({"cluster": ..., "task": ..., "environment": "cloud"}), the cluster encoded once.
    return {var: f'{{"cluster": {cluster}, "task": {task}, "environment": "cloud"}}'}


def _modelarts(ctx: TaskContext, gang: Gang) -> dict[str, str]:
    tf_type = ROLE_TYPES["TF_CONFIG"]
    env = {"VC_TASK_INDEX": str(gang.in_role[(ctx.role, ctx.index)])}
    for r in ctx.config.taskRoles:  # roles differing only in case: the first in config order wins
        env.setdefault(f"VC_{r.name.upper()}_HOSTS", gang.hosts(r.name))
        env.setdefault(f"VC_{r.name.upper()}_NUM", str(r.taskNumber))
    for kind in ("ps", "worker"):  # the first role of that type, in config order
        role = next((r.name for r in ctx.config.taskRoles if tf_type.get(r.name) == kind), None)
        env[f"TF_{kind.upper()}_HOSTS"] = gang.hosts(role) if role else ""
    mine = tf_type.get(ctx.role)
    env["MA_TASK_NAME"] = mine if mine in ("ps", "worker") else ctx.role
    return env


def _pytorch(gang: Gang, me: Endpoint, rank: int, own_gpus: bool) -> dict[str, str]:
    """torch's variables. LOCAL_RANK is what `torch.cuda.set_device(LOCAL_RANK)` takes: a task
    holding GPUs sees only its own, counted from 0 (torchrun's "virtual" mode: 0), so 1 for the
    second GPU task of a node named a device it does not have; a task without GPUs gets its place
    among the gang's tasks on its node."""
    local = gang.on_node[me.node]
    first = gang.order[0]
    return {
        "MASTER_ADDR": first.host,
        "MASTER_PORT": str(first.port),
        "WORLD_SIZE": str(len(gang.order)),
        "RANK": str(rank),
        "LOCAL_RANK": "0" if own_gpus else str(local.index(me)),
        "LOCAL_WORLD_SIZE": str(len(local)),
    }


def _mpi(ctx: TaskContext, gang: list[Endpoint], me: Endpoint) -> dict[str, str]:
    if ctx.hostfile_path is None:
        return {}
    env = {"MUSTER_MPI_HOSTFILE": ctx.hostfile_path, "OMPI_MCA_orte_default_hostfile": ctx.hostfile_path}
    shape = mpi.shape(ctx.config)
    if shape is None:
        return env
    workers = [ep for ep in gang if ep.role == shape.workers]
    # Open MPI settings for tasks on the host network without ssh: the job's jobEnvs may tune any
    # of these (a jobEnvs entry of the same name is kept); the hostfile and the rsh agent are ours.
    tunable = {
        "OMPI_MCA_btl": "tcp,self",
        "OMPI_MCA_pml": "ob1",
        "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
        "OMPI_MCA_hwloc_base_binding_policy": "none",
        # No hwloc topology in shared memory at a guessed free address: under load the guess
        # collides now and then and orted dies in hwloc_shmem_topology_write (SIGSEGV).
        "OMPI_MCA_rtc_hwloc_vmhole": "none",
        "OMPI_MCA_rmaps_base_mapping_policy": "slot",
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "PMIX_MCA_gds": "hash",
    }
    network = mpi.common_network(sorted({ep.host for ep in gang}))
    if network is not None:
        tunable["OMPI_MCA_btl_tcp_if_include"] = network
        tunable["OMPI_MCA_oob_tcp_if_include"] = network
    env.update({k: v for k, v in tunable.items() if k not in ctx.config.jobEnvs})
    env["MUSTER_MPI_NP"] = str(len(workers) * mpi.slots(ctx.config, shape.workers))
    env["MUSTER_MPI_LAUNCHER"] = "1" if shape.is_launcher(me.role, me.index) else "0"
    if ctx.rsh_agent_path is not None:
        # Run through /usr/bin/env: the daemons check that the agent's first word exists where
        # they run too, and the script is in the launcher's attempt directory only.
        env["OMPI_MCA_plm_rsh_agent"] = f"/usr/bin/env python3 {ctx.rsh_agent_path}"
        # Only mpirun starts daemons (through its own agent's bus link), never a daemon on a worker.
        env["OMPI_MCA_plm_rsh_no_tree_spawn"] = "1"
        env["OMPI_MCA_plm_rsh_assume_same_shell"] = "1"
        # Daemons stay in the foreground (no --daemonize): the agent's session lives as long as
        # the daemon, stopping it stops the daemon, and what it says reaches mpirun's output.
        env["OMPI_MCA_orte_leave_session_attached"] = "1"
        # The hostfile names tasks by alias (mpi.host_alias), which no DNS knows: mpirun must
        # neither look them up nor take a line for its own host (tasks of a node share its
        # address), so every task's ranks start in that task, through the agent.
        env["OMPI_MCA_if_base_do_not_resolve"] = "1"
    return env


def _gpus(gpus: list[int]) -> dict[str, str]:
    """With no GPUs, hide them all: "void" tells the NVIDIA container runtime to expose none, and an
    empty CUDA_VISIBLE_DEVICES hides them from a task run as a plain process."""
    visible = ",".join(map(str, gpus))
    env = {"CUDA_VISIBLE_DEVICES": visible, "NVIDIA_VISIBLE_DEVICES": visible or "void"}
    if gpus:  # the agent's indexes are NVML's, in PCI bus order; CUDA's own default order is
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # fastest first, another GPU on a mixed node
    return env


def _muster(ctx: TaskContext, gang: list[Endpoint], me: Endpoint) -> dict[str, str]:
    env = {
        "MUSTER_JOB_ID": ctx.job_id,
        "MUSTER_ATTEMPT": str(ctx.attempt),
        "MUSTER_TASK_ROLE": ctx.role,
        "MUSTER_TASK_INDEX": str(ctx.index),
    }
    elastic = next((r.name for r in ctx.config.taskRoles if r.elastic), None)
    if elastic is not None:
        # Where a framework that rendezvouses by itself (torchrun --rdzv-backend=c10d) meets:
        # the elastic role's oldest member, which shrinking never removes, hosts the store.
        first = next(ep for ep in gang if ep.role == elastic)
        env["MUSTER_RDZV_ENDPOINT"] = first.address
        env["MUSTER_RDZV_IS_HOST"] = "1" if first is me else "0"
        env["MUSTER_RDZV_ID"] = f"{ctx.job_id}.{ctx.attempt}"
        # torchrun otherwise lends its rendezvous store to the workers too, and a node joining a
        # running group then waits for keys that are never written (pytorch#139702): workers
        # get a store of their own.
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env
