"""MPI jobs (`extras.mpi`, docs/mpi.md): the job shape, its hostfile and environment (pure), and
a real `mpirun` whose ranks start in the gang's tasks on hosts of their own, through the agents."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from muster.services.agent import environment, rsh
from muster.services.supervisor.policy import decide
from muster.shared import bus, mpi
from muster.shared.client import submit
from muster.shared.jobconfig import JobConfig, check_job
from muster.shared.messages import ClusterSpec, Endpoint, JobState, TaskState, TaskStatus
from muster.shared.natsserver import NatsServer
from tests.conftest import CORE, NET, ROOT, Cluster
from tests.test_jobs import attempt, nc, run_job, wait_final  # noqa: F401 - nc is a fixture

EXAMPLE = ROOT / "examples" / "mpi-allreduce"


def example() -> dict:
    text = (EXAMPLE / "job.json").read_text().splitlines()
    return json.loads("\n".join(line for line in text if not line.strip().startswith("//")))


def role(name: str, n: int, gpus: int = 0, command: str = "mpirun x") -> dict:
    return {
        "name": name,
        "taskNumber": n,
        "cpuNumber": 1,
        "memoryMB": 256,
        "gpuNumber": gpus,
        "command": command,
    }


def job(roles: list[dict], mpi_extras: object) -> dict:
    return {"jobName": "m", "image": "muster/mpi:bookworm", "taskRoles": roles, "extras": {"mpi": mpi_extras}}


def errors(data: dict) -> list[str]:
    config, errs = check_job(data)
    assert (config is None) == bool(errs)
    return [str(e) for e in errs]


# ------------------------------------------------------------------ the shape (pure)


def test_the_example_is_an_mpi_job_whose_worker_0_launches():
    config, errs = check_job(example())
    assert config is not None, errs
    shape = mpi.shape(config)
    assert shape == mpi.MpiShape(launcher="worker", workers="worker")
    assert shape.is_launcher("worker", 0) and not shape.hosts_ranks_only("worker", 0)
    assert shape.hosts_ranks_only("worker", 2)


def test_workers_default_to_the_only_role_or_the_other_of_two():
    one, _ = check_job(job([role("w", 2)], {"launcher": "w"}))
    two, _ = check_job(job([role("launcher", 1), role("w", 2)], {"launcher": "launcher"}))
    assert one is not None and mpi.shape(one) == mpi.MpiShape("w", "w")
    assert two is not None and mpi.shape(two) == mpi.MpiShape("launcher", "w")
    assert (
        mpi.shape(JobConfig.model_validate(job([role("w", 1)], {"launcher": "w"}) | {"extras": {}})) is None
    )


@pytest.mark.parametrize(
    ("asked", "roles", "expected"),
    [
        ("yes", None, 'extras.mpi: must be an object: {"launcher": ROLE, "workers": ROLE}'),
        ({}, None, "extras.mpi.launcher: required: the role whose task 0 runs mpirun"),
        ({"launcher": "ps"}, None, "extras.mpi.launcher: must name a task role (launcher, w), got 'ps'"),
        (
            {"launcher": "w", "workers": 3},
            None,
            "extras.mpi.workers: must name a task role (launcher, w), got 3",
        ),
        ({"launcher": "w", "hosts": "w"}, None, "extras.mpi.hosts: unknown field"),
        (
            {"launcher": "launcher"},
            [role("launcher", 1), role("w", 2), role("ps", 1)],
            "extras.mpi.workers: required when the job has more than two roles",
        ),
        (
            {"launcher": "launcher", "workers": "w"},
            [role("launcher", 2), role("w", 2)],
            "taskRoles[0].taskNumber: an MPI launcher role of its own runs one task (mpirun), got 2",
        ),
        (
            {"launcher": "w"},
            [role("w", 2) | {"minTaskNumber": 1, "maxTaskNumber": 3}],
            "taskRoles[0].minTaskNumber: an MPI role cannot be elastic: "
            "the hostfile is fixed when mpirun starts",
        ),
    ],
)
def test_a_bad_mpi_section_is_refused_naming_the_field_and_why(asked, roles, expected):
    data = job(roles or [role("launcher", 1), role("w", 2)], asked)
    assert expected in errors(data)


def spec_of(config: JobConfig, placed: list[tuple[str, int, str]]) -> ClusterSpec:
    """A spec for `config`: (role, index, host) in spec order, node = the host."""
    role_no = {r.name: i for i, r in enumerate(config.taskRoles)}
    return ClusterSpec(
        job_id="j1",
        attempt=1,
        endpoints=[
            Endpoint(
                role=r, index=i, role_no=role_no[r], node="n-" + h.replace(".", "-"), host=h, port=5000 + n
            )
            for n, (r, i, h) in enumerate(placed)
        ],
    )


def test_the_hostfile_has_a_line_per_worker_task_with_a_slot_per_gpu_and_not_a_launcher_of_its_own():
    """Tasks that share a node (and so an address) each get a line of their own, named by their
    host alias: each task's ranks start in it, with its GPUs."""
    config, _ = check_job(job([role("launcher", 1), role("w", 3, gpus=2)], {"launcher": "launcher"}))
    assert config is not None
    spec = spec_of(
        config,
        [("launcher", 0, "10.0.0.1"), ("w", 0, "10.0.0.1"), ("w", 1, "10.0.0.2"), ("w", 2, "10.0.0.2")],
    )
    assert environment.render_hostfile(spec, config) == (
        "muster-mpi-w-0 slots=2\nmuster-mpi-w-1 slots=2\nmuster-mpi-w-2 slots=2\n"
    )
    cpu, _ = check_job(job([role("w", 3)], {"launcher": "w"}))
    assert cpu is not None
    spec = spec_of(cpu, [("w", 0, "10.0.0.1"), ("w", 1, "10.0.0.1"), ("w", 2, "10.0.0.2")])
    assert environment.render_hostfile(spec, cpu) == (
        "muster-mpi-w-0 slots=1\nmuster-mpi-w-1 slots=1\nmuster-mpi-w-2 slots=1\n"
    )


def test_a_host_alias_is_a_name_open_mpi_takes():
    """Open MPI 4.1 refuses '_' in node names, cuts them at a '.', and crashes on names of 58
    characters or more (all seen with the real mpirun): an alias has none of these."""
    assert mpi.host_alias("worker", 3) == "muster-mpi-worker-3"
    assert mpi.host_alias("GPU_Worker", 0) == "muster-mpi-gpu-worker-0"
    longest = mpi.host_alias("r" * 64, 9_999_999_999)
    assert len(longest) == mpi.ALIAS_MAX <= 57
    ok = re.compile(r"[a-z0-9][a-z0-9-]*")
    assert all(ok.fullmatch(mpi.host_alias(name, 12)) for name in ("w", "a-b", "x_y", "W0", "0w"))


def test_muster_rsh_maps_an_alias_to_its_task_else_an_address_to_the_first_task_there():
    config, _ = check_job(job([role("launcher", 1), role("w", 3)], {"launcher": "launcher"}))
    assert config is not None
    shape = mpi.shape(config)
    assert shape is not None
    spec = spec_of(
        config,
        [("launcher", 0, "10.0.0.1"), ("w", 0, "10.0.0.2"), ("w", 1, "10.0.0.2"), ("w", 2, "10.0.0.3")],
    )

    def target(host: str) -> tuple[str, int] | None:
        found = rsh._target(spec, shape, host)
        return (found.role, found.index) if found else None

    assert [target(mpi.host_alias("w", i)) for i in range(3)] == [("w", 0), ("w", 1), ("w", 2)]
    assert target("10.0.0.2") == ("w", 0)  # a host list the job wrote itself
    assert target("10.0.0.1") is None  # the launcher of its own hosts no ranks
    assert target(mpi.host_alias("launcher", 0)) is None
    assert target(mpi.host_alias("w", 3)) is None


def env_of(config: JobConfig, spec: ClusterSpec, who: str, index: int) -> dict[str, str]:
    return environment.render_env(
        environment.TaskContext(
            job_id="j1",
            attempt=1,
            user="u",
            config=config,
            spec=spec,
            role=who,
            index=index,
            gpus=[],
            output_root="/out",
            hostfile_path="/w/j1/1/hostfile",
            rsh_agent_path="/w/j1/1/muster-rsh",
        )
    )


def test_an_mpi_task_gets_open_mpi_settings_for_the_host_network_without_ssh():
    data = job([role("w", 3)], {"launcher": "w"})
    data["jobEnvs"] = {"OMPI_MCA_btl": "self,vader,tcp"}  # the job may tune Open MPI
    config, _ = check_job(data)
    assert config is not None
    spec = spec_of(config, [("w", 0, "198.18.0.1"), ("w", 1, "198.18.0.1"), ("w", 2, "198.18.0.2")])
    env = env_of(config, spec, "w", 0)
    assert env["OMPI_MCA_plm_rsh_agent"] == "/usr/bin/env python3 /w/j1/1/muster-rsh"
    assert env["OMPI_MCA_orte_default_hostfile"] == env["MUSTER_MPI_HOSTFILE"] == "/w/j1/1/hostfile"
    assert env["OMPI_MCA_plm_rsh_no_tree_spawn"] == env["OMPI_MCA_if_base_do_not_resolve"] == "1"
    assert env["OMPI_MCA_btl"] == "self,vader,tcp"
    assert env["OMPI_MCA_btl_tcp_if_include"] == env["OMPI_MCA_oob_tcp_if_include"] == "198.18.0.0/30"
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] == "1"
    assert env["PMIX_MCA_gds"] == "hash"
    assert (env["MUSTER_MPI_NP"], env["MUSTER_MPI_LAUNCHER"]) == ("3", "1")
    assert env_of(config, spec, "w", 2)["MUSTER_MPI_LAUNCHER"] == "0"
    plain, _ = check_job(job([role("w", 3)], {"launcher": "w"}) | {"extras": {}})
    assert plain is not None
    assert "OMPI_MCA_plm_rsh_agent" not in env_of(plain, spec, "w", 0)


def test_common_network():
    # Never a /32: Open MPI 4.1 takes one for netmask 0, every interface (shared/mpi.py).
    assert mpi.common_network(["10.1.2.3"]) == "10.1.2.2/31"
    assert mpi.common_network(["10.1.2.2", "10.1.2.2"]) == "10.1.2.2/31"
    assert mpi.common_network(["10.1.2.3", "10.1.2.2"]) == "10.1.2.2/31"
    assert mpi.common_network(["10.1.2.3", "10.1.3.9"]) == "10.1.2.0/23"
    assert mpi.common_network(["10.1.2.3", "node-2"]) is None


def test_the_job_ends_with_its_launcher():
    config, _ = check_job(job([role("launcher", 1), role("w", 2)], {"launcher": "launcher"}))
    assert config is not None

    def status(r: str, i: int, state: TaskState) -> TaskStatus:
        return TaskStatus(role=r, index=i, role_no=0 if r == "launcher" else 1, node="n1", state=state)

    running = [status("w", 0, TaskState.RUNNING), status("w", 1, TaskState.RUNNING)]
    done = decide(config, [status("launcher", 0, TaskState.SUCCEEDED), *running])
    assert (done.outcome, done.kill_rest) == (JobState.SUCCEEDED, True)
    failed = decide(config, [status("launcher", 0, TaskState.FAILED), *running])
    assert failed.outcome == JobState.FAILED
    lost = decide(
        config, [status("launcher", 0, TaskState.RUNNING), status("w", 0, TaskState.FAILED), running[1]]
    )
    assert lost.outcome == JobState.FAILED


# ------------------------------------------------------------------ a real mpirun


def _mpi_on_this_machine() -> str | None:
    """Why a real mpirun cannot run here (None: it can)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 for ip netns"
    if shutil.which("mpirun") is None or shutil.which("orted") is None:
        return "needs Open MPI (apt-get install openmpi-bin python3-mpi4py)"
    probe = subprocess.run(["/usr/bin/python3", "-c", "import mpi4py"], capture_output=True)
    if probe.returncode != 0:
        return "needs mpi4py for /usr/bin/python3 (apt-get install python3-mpi4py)"
    return None


RANK = re.compile(r"rank (\d+) of (\d+) in task (\S+)(?: \(GPUs ([0-9,]+)\))? at ([^:]+): sum = (\d+)")


def check_ranks(tasks: list[TaskStatus], slots: int, addresses: dict[str, str]) -> list[str]:
    """The example's rank lines (in its launcher's output), checked: every rank summed right, and
    each workers task hosted its own ranks (mapped by slot: ranks slots*i .. slots*i+slots-1 in
    worker.i), with that task's GPUs and its node's address (`addresses`: node -> address). The
    rank lines, sorted."""
    workers = sorted((t for t in tasks if t.role == "worker"), key=lambda t: t.index)
    launcher = next(t for t in workers if t.index == 0)  # the example: worker 0 runs mpirun
    lines = sorted(line for line in launcher.last_lines if RANK.fullmatch(line))
    size = slots * len(workers)
    assert len(lines) == size, launcher.last_lines
    for line in lines:
        m = RANK.fullmatch(line)
        assert m is not None
        rank, total = int(m[1]), int(m[6])
        assert (int(m[2]), total) == (size, size * (size + 1) // 2), line
        host = workers[rank // slots]
        assert m[3] == f"worker.{host.index}", (line, workers)
        assert (m[4] or "") == ",".join(map(str, host.gpus)), (line, host.gpus)
        assert m[5] == addresses[host.node], (line, host.node)
    return lines


@pytest.mark.skipif(_mpi_on_this_machine() is not None, reason=str(_mpi_on_this_machine()))
async def test_mpirun_across_three_tasks_on_two_hosts_all_reduces_and_the_job_succeeds(hosts, tmp_path):
    """Process runtime: each agent (and so each task) in a network namespace of its own. The
    first host has room for two of the three workers, 2 GPUs each (declared): its two tasks share
    its address, yet each hosts its own two ranks, with its own GPUs and environment, as the
    worker on the other host does. Worker 0's mpirun starts every rank through the agents."""
    with NatsServer(tmp_path / "nats", host=f"{NET}.254") as server:
        cluster = Cluster(server.url, tmp_path)
        try:
            for module in CORE:
                cluster.start(module)
            for (ns, address), room in zip(hosts[:2], (2, 1), strict=True):
                cluster.agent(
                    ns,
                    *("--address", address, "--cpus", str(room), "--gpus", f"{2 * room}xV100"),
                    prefix=("ip", "netns", "exec", ns),
                )
            config = example()
            config["codeDir"] = str(EXAMPLE)
            config["taskRoles"][0]["gpuNumber"] = 2
            nc = await bus.connect("test", server.url)
            try:
                await bus.open_jetstream(nc, wait=60)  # the services have declared the streams
                record = await run_job(nc, config, timeout=100)
                a = await attempt(nc, record.job_id)
                assert record.state == JobState.SUCCEEDED, (record.reason, a.tasks, cluster.logs())
                placed = sorted(t.node for t in a.tasks)
                assert placed == sorted([hosts[0][0], hosts[0][0], hosts[1][0]]), a.tasks
                check_ranks(a.tasks, slots=2, addresses=dict(hosts))
            finally:
                await nc.close()
        finally:
            cluster.stop_all()


@pytest.fixture(scope="session")
def mpi_image(base_image: str) -> str:
    """muster/mpi:bookworm (deploy/build-mpi-image.sh); skips when there is no Docker engine."""
    proc = subprocess.run(
        [str(ROOT / "deploy" / "build-mpi-image.sh")], capture_output=True, text=True, timeout=900
    )
    if proc.returncode == 2:
        pytest.skip(f"cannot build the MPI image: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, f"build-mpi-image.sh failed:\n{proc.stderr}"
    return os.environ.get("MUSTER_MPI_IMAGE", "muster/mpi:bookworm")


@pytest.mark.docker
@pytest.mark.timeout(900)  # the first run builds the images (debootstrap, apt-get)
async def test_mpirun_starts_ranks_in_other_agents_containers_by_docker_exec(mpi_image, cluster, nc):  # noqa: F811
    """Docker runtime: two agents on this machine, each its own address on the loopback network,
    the first with room for two workers; worker 0's mpirun (in its container) has the agents
    start each task's daemon in that task's container (docker exec), as user 1000, never root:
    the two workers of the first node each host their own rank."""
    cluster.core()
    addresses = {"mpi-a": "127.0.0.2", "mpi-b": "127.0.0.3"}
    for (node, address), cpus in zip(addresses.items(), ("2", "1"), strict=True):
        cluster.agent(node, "--runtime", "docker", "--address", address, "--cpus", cpus)
    config = example()
    # The test's addresses are not the interfaces' own (127.0.0.1 is): the job says where Open
    # MPI's TCP goes, as a job on such a network would.
    net = {"OMPI_MCA_btl_tcp_if_include": "127.0.0.0/8", "OMPI_MCA_oob_tcp_if_include": "127.0.0.0/8"}
    config.update(image=mpi_image, codeDir=str(EXAMPLE), jobEnvs=net)
    await bus.open_jetstream(nc, wait=60)  # the services have declared the streams
    record = await run_job(nc, config, timeout=100)
    a = await attempt(nc, record.job_id)
    launcher = next(t for t in a.tasks if (t.role, t.index) == ("worker", 0))
    assert record.state == JobState.SUCCEEDED, (record.reason, launcher.last_lines, a.tasks, cluster.logs())
    assert sorted(t.node for t in a.tasks) == ["mpi-a", "mpi-a", "mpi-b"], a.tasks
    check_ranks(a.tasks, slots=1, addresses=addresses)


def docker(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 or not check, f"docker {' '.join(args)}: {proc.stderr}"
    return proc.stdout.strip()


# Run by every rank after the all-reduce: the address its traffic leaves from (a UDP connect
# to the network's gateway sends nothing), so the test sees the network namespace each rank
# ran in, not only the address its task was told (PAI_CURRENT_CONTAINER_IP).
WHERE = """import os, socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.connect((os.environ["GATEWAY"], 9))
print(f"rank in task worker.{os.environ['MUSTER_TASK_INDEX']} has address {s.getsockname()[0]}", flush=True)
"""


@contextlib.contextmanager
def docker_hosts(image: str, cluster: Cluster) -> Iterator[tuple[str, dict[str, str]]]:
    """Two network-namespaced hosts: holder containers (`sleep infinity`) of `image` at fixed
    addresses on a bridge network of the test's own. Yields (the network's /24 prefix, node (=
    holder) -> address); on exit stops the cluster, then removes the tasks' containers, the
    holders and the network."""
    tag = f"muster-mpi-{os.getpid() % 10000}"
    net = f"198.19.{os.getpid() % 200 + 20}"
    holders = {f"{tag}-a": f"{net}.2", f"{tag}-b": f"{net}.3"}
    docker("network", "create", "--subnet", f"{net}.0/24", "--gateway", f"{net}.1", tag)
    try:
        for holder, address in holders.items():
            docker(
                "run", "-d", "--name", holder, "--network", tag, "--ip", address, image, "sleep", "infinity"
            )
        yield net, holders
    finally:
        cluster.stop_all()
        for holder in holders:  # the tasks' containers first: they live in the holders' namespaces
            leftovers = docker("ps", "-aq", "--filter", f"label=muster.node={holder}", check=False)
            if leftovers:
                docker("rm", "-f", *leftovers.split(), check=False)
        docker("rm", "-f", *holders, check=False)
        docker("network", "rm", tag, check=False)


def docker_agent(
    cluster: Cluster, holder: str, address: str, room: int, gpus: int
) -> subprocess.Popen[bytes]:
    """A Docker-runtime agent whose tasks run in `holder`'s network namespace at `address`."""
    return cluster.agent(
        holder,
        *("--runtime", "docker", "--docker-network", f"container:{holder}", "--address", address),
        *("--cpus", str(room), "--gpus", f"{gpus}xV100"),
    )


@pytest.mark.docker
@pytest.mark.timeout(900)  # the first run builds the images (debootstrap, apt-get)
async def test_mpirun_across_docker_hosts_in_network_namespaces_of_their_own(mpi_image, cluster, nc):  # noqa: F811
    """The issue's done-when on Docker: 3 tasks on 2 network-namespaced hosts. Each host is a
    holder container (`sleep infinity`) at a fixed address on a bridge network of the test's own;
    its agent runs tasks in the holder's network namespace (--docker-network container:HOLDER)
    and advertises the holder's address. The first host has room for two workers, 2 GPUs
    (declared) each: every task hosts its own two ranks. The ranks all-reduce, report the task,
    GPUs and address they ran at, and the job SUCCEEDS."""
    with docker_hosts(mpi_image, cluster) as (net, holders):
        cluster.core()
        for (holder, address), room in zip(holders.items(), (2, 1), strict=True):
            docker_agent(cluster, holder, address, room, 2 * room)
        config = example()
        command = config["taskRoles"][0]["command"]
        config["taskRoles"][0].update(
            gpuNumber=2, command=f'{command} && mpirun -np $MUSTER_MPI_NP /usr/bin/python3 -c "$WHERE"'
        )
        config.update(image=mpi_image, codeDir=str(EXAMPLE), jobEnvs={"WHERE": WHERE, "GATEWAY": f"{net}.1"})
        await bus.open_jetstream(nc, wait=60)  # the services have declared the streams
        record = await run_job(nc, config, timeout=100)
        a = await attempt(nc, record.job_id)
        launcher = next(t for t in a.tasks if (t.role, t.index) == ("worker", 0))
        assert record.state == JobState.SUCCEEDED, (
            record.reason,
            launcher.last_lines,
            a.tasks,
            cluster.logs(),
        )
        a_, b_ = holders
        assert sorted(t.node for t in a.tasks) == [a_, a_, b_], a.tasks
        check_ranks(a.tasks, slots=2, addresses=holders)
        node_of = {f"worker.{t.index}": t.node for t in a.tasks}
        found = (re.fullmatch(r"rank in task (\S+) has address (\S+)", line) for line in launcher.last_lines)
        seen = sorted([m[1], m[2]] for m in found if m)
        assert seen == sorted([task, holders[node]] for task, node in node_of.items() for _ in range(2)), seen


# The ranks meet, rank 0 (in the launcher's task) marks that the daemons are up in its attempt's
# directory and waits there for "go"; all then sum. They wait without spinning (Ibarrier + sleep).
HOLD = """import os, time
from mpi4py import MPI
c = MPI.COMM_WORLD
c.barrier()
here = os.path.dirname(os.environ["MUSTER_MPI_HOSTFILE"])
if c.rank == 0:
    open(os.path.join(here, "ranks-up"), "w").close()
    while not os.path.exists(os.path.join(here, "go")):
        time.sleep(0.2)
req = c.Ibarrier()
while not req.Test():
    time.sleep(0.2)
print(f"rank {c.rank} of {c.size}: sum {c.allreduce(c.rank + 1)}", flush=True)
"""


@pytest.mark.docker
@pytest.mark.timeout(900)
@pytest.mark.parametrize("restarted", ["launcher", "other", "both", "launcher-crash"])
async def test_an_mpi_job_on_docker_outlives_restarts_of_its_agents(
    mpi_image,
    cluster,
    nc,  # noqa: F811
    restarted: str,
    monkeypatch: pytest.MonkeyPatch,
):
    """Agents restart (an upgrade) while an MPI job runs: the launcher's node's, whose
    muster-rsh sessions carry mpirun's daemons, the other node's, whose tasks run them, or both
    in turn; or the launcher's node's agent crashes (SIGKILL: no goodbye) and is started again.
    The daemons go on (mpirun talks to them directly), the next agents adopt the tasks, and
    the job SUCCEEDS with every rank's sum: before, each restart aborted mpirun."""
    monkeypatch.setenv("MUSTER_NODE_TIMEOUT", "60")  # a loaded machine's slow restart is no loss
    with docker_hosts(mpi_image, cluster) as (_, holders):
        cluster.core()
        rooms = dict(zip(holders, (2, 1), strict=True))
        agents = {h: docker_agent(cluster, h, holders[h], rooms[h], 0) for h in holders}
        config = example()
        config["taskRoles"][0]["command"] = 'mpirun -np $MUSTER_MPI_NP /usr/bin/python3 -c "$HOLD"'
        config.update(image=mpi_image, codeDir=str(EXAMPLE), jobEnvs={"HOLD": HOLD})
        await bus.open_jetstream(nc, wait=60)  # the services have declared the streams
        _, verdict = await submit(nc, json.dumps(config).encode(), timeout=30)
        assert verdict is not None and verdict.accepted, verdict
        deadline = time.monotonic() + 240
        while not (up := list((cluster.log_dir / "work").glob(f"*/{verdict.job_id}/1/ranks-up"))):
            if time.monotonic() > deadline:
                a = await attempt(nc, verdict.job_id)
                raise AssertionError(
                    f"the ranks never met: {[(t.key, t.state, t.last_lines) for t in a.tasks]}"
                )
            await asyncio.sleep(0.5)

        here = up[0].parent  # the launcher's attempt directory, on its node
        launcher_node = here.parents[1].name
        chosen = {
            "other": [h for h in holders if h != launcher_node],
            "both": sorted(holders, key=lambda h: h != launcher_node),
        }
        for holder in chosen.get(restarted, [launcher_node]):
            old = agents[holder]
            if restarted.endswith("crash"):
                old.kill()
            else:
                old.terminate()
            old.wait(60)
            agents[holder] = docker_agent(cluster, holder, holders[holder], rooms[holder], 0)
        # The ranks speak at once: a crashed agent's successor reads its tasks' output on from
        # what the crashed one had read by its last heartbeat (docs/deploy.md), so even lines
        # written before it adopts them reach the launcher's last_lines.
        (here / "go").touch()

        record = await wait_final(nc, verdict.job_id, 180)
        a = await attempt(nc, verdict.job_id)
        assert a.attempt == 1 and record.retries == record.platform_retries == 0, record
        launcher = next(t for t in a.tasks if (t.role, t.index) == ("worker", 0))
        assert launcher.node == launcher_node, a.tasks
        assert record.state == JobState.SUCCEEDED, (record.reason, launcher.last_lines, cluster.logs())
        sums = sorted(line for line in launcher.last_lines if line.startswith("rank "))
        assert sums == [f"rank {r} of 3: sum 6" for r in range(3)], launcher.last_lines


def launcher_job(command: str) -> dict:
    """Arena's default shape: a launcher role of its own (no GPU, hosts no ranks) and workers."""
    config = example()
    worker = dict(config["taskRoles"][0], taskNumber=2, command="true")  # hosts ranks: not run
    launcher = dict(config["taskRoles"][0], name="launcher", taskNumber=1, command=command)
    config.update(
        taskRoles=[launcher, worker],
        extras={"mpi": {"launcher": "launcher", "workers": "worker"}},
        codeDir=str(EXAMPLE),
        # The test's addresses are not the interfaces' own (127.0.0.1 is).
        jobEnvs={"OMPI_MCA_btl_tcp_if_include": "127.0.0.0/8", "OMPI_MCA_oob_tcp_if_include": "127.0.0.0/8"},
    )
    return config


async def launched(cluster: Cluster, client, config: dict):
    """Run `config` on two agents of this machine: its final record, attempt and launcher task."""
    cluster.core()
    for node, address in (("mpi-a", "127.0.0.2"), ("mpi-b", "127.0.0.3")):
        cluster.agent(node, "--address", address, "--cpus", "2")
    await bus.open_jetstream(client, wait=60)  # the services have declared the streams
    record = await run_job(client, config, 100)
    a = await attempt(client, record.job_id)
    return record, a, next(t for t in a.tasks if t.role == "launcher")


@pytest.mark.skipif(_mpi_on_this_machine() is not None, reason=str(_mpi_on_this_machine()))
async def test_a_launcher_of_its_own_starts_every_rank_in_the_workers_and_the_job_succeeds(cluster, nc):  # noqa: F811
    job = launcher_job("mpirun -np $MUSTER_MPI_NP /usr/bin/python3 allreduce.py")
    record, a, launcher = await launched(cluster, nc, job)
    assert record.state == JobState.SUCCEEDED, (record.reason, launcher.last_lines, cluster.logs())
    ranks = sorted(line for line in launcher.last_lines if line.startswith("rank "))
    assert len(ranks) == 2 and all(" in task worker." in r and r.endswith("sum = 3") for r in ranks), ranks
    # The workers are stopped once the launcher has ended (their end is reported just after).
    deadline = time.monotonic() + 60
    while not all(t.state.ended for t in a.tasks) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        a = await attempt(nc, record.job_id)
    assert all(t.state == TaskState.STOPPED for t in a.tasks if t.role == "worker"), a.tasks


@pytest.mark.skipif(_mpi_on_this_machine() is not None, reason=str(_mpi_on_this_machine()))
async def test_ranks_that_fail_fail_the_job_and_nothing_hangs(cluster, nc):  # noqa: F811
    record, _, launcher = await launched(cluster, nc, launcher_job("mpirun -np $MUSTER_MPI_NP /bin/false"))
    assert record.state == JobState.FAILED, (record.reason, launcher.last_lines)
    assert launcher.state == TaskState.FAILED and launcher.exit_code not in (0, None), launcher


@pytest.mark.skipif(_mpi_on_this_machine() is not None, reason=str(_mpi_on_this_machine()))
async def test_workers_that_only_host_ranks_are_not_taken_for_hung(cluster, nc):  # noqa: F811
    """noProgressTimeoutSec watches the launcher (mpirun prints for every rank), not the
    workers, which print nothing of their own."""
    ticks = "for i in 1 2 3 4 5 6 7 8 9 10; do echo tick $i; sleep 1; done"
    config = launcher_job(f"{ticks}; mpirun -np $MUSTER_MPI_NP /usr/bin/python3 allreduce.py")
    config["noProgressTimeoutSec"] = 5
    record, _, _ = await launched(cluster, nc, config)
    assert (record.state, record.attempt) == (JobState.SUCCEEDED, 1), record.reason


def test_muster_rsh_runs_on_the_old_pythons_of_mpi_images():
    """Open MPI runs every daemon launch through `python3 muster-rsh`, under the task image's own
    python3: the arena example's image has 3.5, Horovod's and NGC's older ones 3.6-3.8. An
    annotation such as `list[str]` (3.9+) or an f-string (3.6+) failed there, and every MPI job
    on such an image failed to start its daemons. The script is held to what 3.5 runs; it is run
    under each older python3 this machine has (pyenv's), if any."""
    import ast

    path = ROOT / "services" / "agent" / "muster_rsh.py"
    tree = ast.parse(path.read_text())
    late = [
        f"line {node.lineno}: {type(node).__name__}"
        for node in ast.walk(tree)
        if isinstance(node, ast.JoinedStr)  # f-strings: 3.6
        or (isinstance(node, ast.arg) and node.annotation is not None)  # evaluated when defined
        or (isinstance(node, ast.FunctionDef) and node.returns is not None)
        or isinstance(node, ast.AnnAssign | ast.NamedExpr)
        or (isinstance(node, ast.ImportFrom) and node.module == "__future__")
    ]
    assert not late, late
    olds = sorted(Path.home().glob(".pyenv/versions/3.[5-8].*/bin/python3"))
    for python in olds:
        out = subprocess.run(
            [str(python), str(path), "nowhere", "true"], capture_output=True, text=True, timeout=30
        )
        assert out.returncode == 255 and "cannot reach this node's Muster agent" in out.stderr, (python, out)
