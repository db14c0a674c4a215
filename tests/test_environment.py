"""The task environment: exact values for the seeds' examples, and every PAI_ variable the
conformance corpus's commands use is defined."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from muster.services.agent.environment import Dirs, TaskContext, render_env, render_hostfile, resolve_dirs
from muster.shared.jobconfig import JobConfig, check_job
from muster.shared.loader import loads
from muster.shared.messages import ClusterSpec, Endpoint

CORPUS = Path(__file__).resolve().parent / "data" / "openpai-v1"  # copied from OpenPAI: see its README
CORPUS_FILES = sorted(CORPUS.glob("*.json"))
IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
PAI_REF = re.compile(r"\$\{?(PAI_[A-Za-z0-9_]*)")


def role(name: str, n: int, gpus: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "taskNumber": n,
        "cpuNumber": 2,
        "memoryMB": 8192,
        "gpuNumber": gpus,
        "command": "true",
        **extra,
    }


def job(*roles: dict[str, Any], **fields: Any) -> JobConfig:
    config, errors = check_job({"jobName": "j", "image": "busybox", "taskRoles": list(roles), **fields})
    assert not errors, errors
    assert config is not None
    return config


def ep(
    config: JobConfig, name: str, index: int, node: str, host: str, port: int, **ports: list[int]
) -> Endpoint:
    role_no = [r.name for r in config.taskRoles].index(name)
    return Endpoint(role=name, role_no=role_no, index=index, node=node, host=host, port=port, ports=ports)


def ctx(config: JobConfig, endpoints: list[Endpoint], name: str, index: int, **kw: Any) -> TaskContext:
    spec = ClusterSpec(job_id="j1", attempt=2, endpoints=endpoints)
    defaults: dict[str, Any] = {"gpus": [], "output_root": "/muster/output"}
    return TaskContext(
        job_id="j1",
        attempt=2,
        user="alice",
        config=config,
        spec=spec,
        role=name,
        index=index,
        **{**defaults, **kw},
    )


# ------------------------------------------------------------------ seed 000: distributed TensorFlow

TF_EXAMPLE = JobConfig.model_validate(
    {
        "jobName": "tensorflow-distributed-jobguid",
        "image": "your_docker_registry/pai.run.tensorflow",
        "dataDir": "hdfs://path/tensorflow-distributed-jobguid/data",
        "outputDir": "hdfs://path/tensorflow-distributed-jobguid/output",
        "codeDir": "hdfs://path/tensorflow-distributed-jobguid/code",
        "taskRoles": [
            {**role("ps_server", 2), "memoryMB": 8192},
            {**role("worker", 2, gpus=4), "memoryMB": 16384},
        ],
        "killAllOnCompletedTaskNumber": 2,
        "retryCount": 0,
    }
)
# ps_server.0 and worker.0 on node a, ps_server.1 and worker.1 on node b.
TF_GANG = [
    ep(TF_EXAMPLE, "ps_server", 0, "a", "10.0.0.1", 5000),
    ep(TF_EXAMPLE, "ps_server", 1, "b", "10.0.0.2", 5000),
    ep(TF_EXAMPLE, "worker", 0, "a", "10.0.0.1", 5001),
    ep(TF_EXAMPLE, "worker", 1, "b", "10.0.0.2", 5001),
]
PS_HOSTS = "10.0.0.1:5000,10.0.0.2:5000"
WORKER_HOSTS = "10.0.0.1:5001,10.0.0.2:5001"
TF_CLUSTER = {"ps": PS_HOSTS.split(","), "worker": WORKER_HOSTS.split(",")}

# The variables that are the same for every task of the job.
TF_COMMON = {
    "PAI_JOB_NAME": "tensorflow-distributed-jobguid",
    "PAI_USERNAME": "alice",
    "PAI_DATA_DIR": "hdfs://path/tensorflow-distributed-jobguid/data",
    "PAI_OUTPUT_DIR": "hdfs://path/tensorflow-distributed-jobguid/output",
    "PAI_CODE_DIR": "hdfs://path/tensorflow-distributed-jobguid/code",
    "PAI_DEFAULT_FS_URI": "",
    "PAI_TASKS_NUM": "4",
    "PAI_TASK_ROLES_NUM": "2",
    "PAI_KILL_ALL_ON_COMPLETED_TASK_NUM": "2",
    "PAI_TASK_ROLE_0_HOST_LIST": PS_HOSTS,
    "PAI_TASK_ROLE_1_HOST_LIST": WORKER_HOSTS,
    "PAI_TASK_ROLE_ps_server_HOST_LIST": PS_HOSTS,
    "PAI_TASK_ROLE_worker_HOST_LIST": WORKER_HOSTS,
    "PAI_CONTAINER_HOST_PORT_LIST": "",
    "VC_PS_SERVER_HOSTS": PS_HOSTS,
    "VC_WORKER_HOSTS": WORKER_HOSTS,
    "VC_PS_SERVER_NUM": "2",
    "VC_WORKER_NUM": "2",
    "TF_PS_HOSTS": PS_HOSTS,
    "TF_WORKER_HOSTS": WORKER_HOSTS,
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "5000",
    "WORLD_SIZE": "4",
    "LOCAL_WORLD_SIZE": "2",
    "MUSTER_JOB_ID": "j1",
    "MUSTER_ATTEMPT": "2",
}

# Per task: the variables that differ between the four tasks.
PS = {
    "PAI_TASK_ROLE_NAME": "ps_server",
    "PAI_TASK_MEM_MB": "8192",
    "PAI_TASK_GPU_NUM": "0",
    "PAI_TASK_ROLE_NO": "0",
}
WORKER = {
    "PAI_TASK_ROLE_NAME": "worker",
    "PAI_TASK_MEM_MB": "16384",
    "PAI_TASK_GPU_NUM": "4",
    "PAI_TASK_ROLE_NO": "1",
}
NODE_A = {"PAI_CURRENT_CONTAINER_IP": "10.0.0.1"}
NODE_B = {"PAI_CURRENT_CONTAINER_IP": "10.0.0.2"}
TF_TASKS = [
    (
        "ps_server",
        0,
        "ps",
        {**PS, **NODE_A, "PAI_CURRENT_CONTAINER_PORT": "5000", "RANK": "0", "LOCAL_RANK": "0"},
    ),
    (
        "ps_server",
        1,
        "ps",
        {**PS, **NODE_B, "PAI_CURRENT_CONTAINER_PORT": "5000", "RANK": "1", "LOCAL_RANK": "0"},
    ),
    (
        "worker",
        0,
        "worker",
        {**WORKER, **NODE_A, "PAI_CURRENT_CONTAINER_PORT": "5001", "RANK": "2", "LOCAL_RANK": "1"},
    ),
    (
        "worker",
        1,
        "worker",
        {**WORKER, **NODE_B, "PAI_CURRENT_CONTAINER_PORT": "5001", "RANK": "3", "LOCAL_RANK": "1"},
    ),
]


@pytest.mark.parametrize(("name", "index", "tf_type", "per_task"), TF_TASKS)
def test_seed_tensorflow_example(name: str, index: int, tf_type: str, per_task: dict[str, str]) -> None:
    env = render_env(ctx(TF_EXAMPLE, TF_GANG, name, index))
    expected = {
        **TF_COMMON,
        **per_task,
        "PAI_CURRENT_TASK_ROLE_NAME": name,
        "PAI_TASK_ROLE_NUM": "2",
        "PAI_TASK_CPU_NUM": "2",
        "PAI_TASK_ROLE_INDEX": str(index),
        "PAI_CURRENT_TASK_ROLE_CURRENT_TASK_INDEX": str(index),
        "VC_TASK_INDEX": str(index),
        "MA_TASK_NAME": tf_type,
        "MUSTER_TASK_ROLE": name,
        "MUSTER_TASK_INDEX": str(index),
    }
    assert {k: env.get(k) for k in expected} == expected
    task = {"type": tf_type, "index": index}
    assert json.loads(env["TF_CONFIG"]) == {"cluster": TF_CLUSTER, "task": task, "environment": "cloud"}
    assert json.loads(env["CLUSTER_SPEC"]) == {"cluster": TF_CLUSTER, "task": task, "environment": "cloud"}


def test_seed_tensorflow_example_commands_expand() -> None:
    """The seed's own ps_server command reads PAI_TASK_ROLE_0/1_HOST_LIST and PAI_TASK_ROLE_INDEX."""
    env = render_env(ctx(TF_EXAMPLE, TF_GANG, "ps_server", 1))
    command = (
        "--ps_hosts=$PAI_TASK_ROLE_0_HOST_LIST --worker_hosts=$PAI_TASK_ROLE_1_HOST_LIST"
        " --task_index=$PAI_TASK_ROLE_INDEX"
    )
    assert PAI_REF.sub(lambda m: env[m.group(1)], command) == (
        f"--ps_hosts={PS_HOSTS} --worker_hosts={WORKER_HOSTS} --task_index=1"
    )


# ------------------------------------------------------------------ role types (seed 004)

ROLES_JOB = job(role("master", 1), role("ps", 1), role("worker", 2), role("evaluator", 1), role("tb", 1))
ROLES_GANG = [
    ep(ROLES_JOB, "master", 0, "a", "h", 1),
    ep(ROLES_JOB, "ps", 0, "a", "h", 2),
    ep(ROLES_JOB, "worker", 0, "a", "h", 3),
    ep(ROLES_JOB, "worker", 1, "a", "h", 4),
    ep(ROLES_JOB, "evaluator", 0, "a", "h", 5),
    ep(ROLES_JOB, "tb", 0, "a", "h", 6),
]


@pytest.mark.parametrize(
    ("name", "index", "tf", "cloud", "ma"),
    [
        ("master", 0, "chief", "master", "master"),
        ("ps", 0, "ps", "ps", "ps"),
        ("worker", 1, "worker", "worker", "worker"),
        ("evaluator", 0, "evaluator", "evaluator", "evaluator"),
        ("tb", 0, "tb", "tb", "tb"),
    ],
)
def test_role_types(name: str, index: int, tf: str, cloud: str, ma: str) -> None:
    env = render_env(ctx(ROLES_JOB, ROLES_GANG, name, index))
    cluster = {"ps": ["h:2"], "worker": ["h:3", "h:4"], "evaluator": ["h:5"], "tb": ["h:6"]}
    assert json.loads(env["TF_CONFIG"]) == {
        "cluster": {"chief": ["h:1"], **cluster},
        "task": {"type": tf, "index": index},
        "environment": "cloud",
    }
    assert json.loads(env["CLUSTER_SPEC"]) == {
        "cluster": {"master": ["h:1"], **cluster},
        "task": {"type": cloud, "index": index},
        "environment": "cloud",
    }
    assert env["MA_TASK_NAME"] == ma
    assert (env["TF_PS_HOSTS"], env["TF_WORKER_HOSTS"]) == ("h:2", "h:3,h:4")


def test_roles_that_would_share_a_type_keep_their_names() -> None:
    config = job(role("chief", 1), role("master", 1), role("ps", 1), role("ps_server", 1))
    gang = [ep(config, r.name, 0, "a", "h", i) for i, r in enumerate(config.taskRoles)]
    env = render_env(ctx(config, gang, "master", 0))
    cluster = {"chief": ["h:0"], "master": ["h:1"], "ps": ["h:2"], "ps_server": ["h:3"]}
    assert json.loads(env["TF_CONFIG"])["cluster"] == cluster
    assert json.loads(env["CLUSTER_SPEC"])["cluster"] == cluster
    assert json.loads(env["TF_CONFIG"])["task"] == {"type": "master", "index": 0}
    assert env["TF_PS_HOSTS"] == "h:2"  # the first ps-type role in config order
    assert env["TF_WORKER_HOSTS"] == ""


# ------------------------------------------------------------------ PyTorch

TORCH_JOB = job(role("worker", 3, gpus=1))
# worker.0 and worker.2 on node a, worker.1 on node b.
TORCH_GANG = [
    ep(TORCH_JOB, "worker", 0, "a", "10.0.0.1", 29500),
    ep(TORCH_JOB, "worker", 1, "b", "10.0.0.2", 29500),
    ep(TORCH_JOB, "worker", 2, "a", "10.0.0.1", 29501),
]


@pytest.mark.parametrize(
    ("index", "rank", "local_rank", "local_world"),
    [(0, "0", "0", "2"), (1, "1", "0", "1"), (2, "2", "1", "2")],
)
def test_pytorch(index: int, rank: str, local_rank: str, local_world: str) -> None:
    env = render_env(ctx(TORCH_JOB, TORCH_GANG, "worker", index))
    assert {
        k: env[k]
        for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    } == {
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "WORLD_SIZE": "3",
        "RANK": rank,
        "LOCAL_RANK": local_rank,
        "LOCAL_WORLD_SIZE": local_world,
    }


def test_spec_order_does_not_matter() -> None:
    """Ranks come from role order then index, not from the order the endpoints arrived in."""
    shuffled = [TORCH_GANG[2], TORCH_GANG[0], TORCH_GANG[1]]
    for index in range(3):
        assert render_env(ctx(TORCH_JOB, shuffled, "worker", index)) == render_env(
            ctx(TORCH_JOB, TORCH_GANG, "worker", index)
        )


# ------------------------------------------------------------------ ports, jobEnvs, dirs, GPUs, MPI


def test_port_list_labels() -> None:
    ports = [
        {"label": "http", "beginAt": 0, "portNumber": 1},
        {"label": "nccl", "beginAt": 0, "portNumber": 3},
    ]
    config = job(role("server", 2, portList=ports))
    gang = [
        ep(config, "server", 0, "a", "h1", 5000, http=[8080], nccl=[9000, 9001, 9002]),
        ep(config, "server", 1, "b", "h2", 5000, http=[8081], nccl=[9100, 9101, 9102]),
    ]
    env = render_env(ctx(config, gang, "server", 1))
    assert env["PAI_CONTAINER_HOST_http_PORT_LIST"] == "8081"
    assert env["PAI_CONTAINER_HOST_nccl_PORT_LIST"] == "9100,9101,9102"
    assert env["PAI_CONTAINER_HOST_PORT_LIST"] == "http:8081;nccl:9100,9101,9102"


def test_job_envs_are_plain_variables_and_platform_variables_win() -> None:
    envs = {"LR": "0.1", "EPOCHS": 10, "SCALE": 1.5, "DEBUG": True, "QUIET": False, "MASTER_ADDR": "mine"}
    env = render_env(ctx(job(role("worker", 3, gpus=1), jobEnvs=envs), TORCH_GANG, "worker", 0))
    assert {k: env[k] for k in ("LR", "EPOCHS", "SCALE", "DEBUG", "QUIET")} == {
        "LR": "0.1",
        "EPOCHS": "10",
        "SCALE": "1.5",
        "DEBUG": "true",
        "QUIET": "false",
    }
    assert env["MASTER_ADDR"] == "10.0.0.1"


@pytest.mark.parametrize(
    ("dirs", "expected"),
    [
        (
            {
                "dataDir": "$PAI_DEFAULT_FS_URI/$PAI_USERNAME/data",
                "codeDir": "${PAI_DEFAULT_FS_URI}/${PAI_USERNAME}/code/$PAI_JOB_NAME",
                "outputDir": "$PAI_DEFAULT_FS_URI/out/${PAI_JOB_NAME}-$PAI_USERNAME",
            },
            Dirs(
                data="hdfs://nn:9000/alice/data",
                code="hdfs://nn:9000/alice/code/j",
                output="hdfs://nn:9000/out/j-alice",
            ),
        ),
        ({}, Dirs(data="", code="", output="/muster/output/j")),
        ({"dataDir": "", "outputDir": ""}, Dirs(data="", code="", output="/muster/output/j")),
        # Only the three platform names expand; anything else is left for the task's shell.
        (
            {"dataDir": "$HOME/d/$PAI_USERNAME_X/$PAI_USERNAME", "codeDir": "${PAI_OTHER}/c"},
            Dirs(data="$HOME/d/$PAI_USERNAME_X/alice", code="${PAI_OTHER}/c", output="/muster/output/j"),
        ),
    ],
)
def test_resolve_dirs(dirs: dict[str, str], expected: Dirs) -> None:
    config = job(role("main", 1), **dirs)
    assert resolve_dirs(config, "alice", "hdfs://nn:9000", "/muster/output") == expected
    env = render_env(
        ctx(config, [ep(config, "main", 0, "a", "h", 1)], "main", 0, default_fs_uri="hdfs://nn:9000")
    )
    assert (env["PAI_DATA_DIR"], env["PAI_CODE_DIR"], env["PAI_OUTPUT_DIR"]) == (
        expected.data,
        expected.code,
        expected.output,
    )
    assert env["PAI_DEFAULT_FS_URI"] == "hdfs://nn:9000"


@pytest.mark.parametrize(
    ("gpus", "cuda", "nvidia"), [([], "", "void"), ([3], "3", "3"), ([0, 2, 5], "0,2,5", "0,2,5")]
)
def test_gpu_visibility(gpus: list[int], cuda: str, nvidia: str) -> None:
    env = render_env(ctx(TORCH_JOB, TORCH_GANG, "worker", 0, gpus=gpus))
    assert (env["CUDA_VISIBLE_DEVICES"], env["NVIDIA_VISIBLE_DEVICES"]) == (cuda, nvidia)


def test_hostfile_merges_tasks_on_one_host() -> None:
    config = job(role("launcher", 1), role("worker", 3, gpus=2), role("cpu", 1))
    gang = [
        ep(config, "launcher", 0, "b", "10.0.0.2", 1),
        ep(config, "worker", 0, "a", "10.0.0.1", 2),
        ep(config, "worker", 1, "b", "10.0.0.2", 3),
        ep(config, "worker", 2, "a", "10.0.0.1", 4),
        ep(config, "cpu", 0, "c", "10.0.0.3", 5),
    ]
    spec = ClusterSpec(job_id="j1", attempt=2, endpoints=gang)
    assert render_hostfile(spec, config) == "10.0.0.2 slots=3\n10.0.0.1 slots=4\n10.0.0.3 slots=1\n"


def test_mpi_variables_only_with_a_hostfile() -> None:
    assert "MUSTER_MPI_HOSTFILE" not in render_env(ctx(TORCH_JOB, TORCH_GANG, "worker", 0))
    env = render_env(ctx(TORCH_JOB, TORCH_GANG, "worker", 0, hostfile_path="/muster/hostfile"))
    assert env["MUSTER_MPI_HOSTFILE"] == env["OMPI_MCA_orte_default_hostfile"] == "/muster/hostfile"


# ------------------------------------------------------------------ a spec that is not the gang


@pytest.mark.parametrize(
    ("endpoints", "message"),
    [
        (TORCH_GANG[:2], "no task worker.2"),
        (TORCH_GANG[1:], "no task worker.0"),
        ([*TORCH_GANG, TORCH_GANG[1]], "twice"),
        ([*TORCH_GANG, ep(TF_EXAMPLE, "ps_server", 0, "a", "h", 1)], "does not have: ps_server.0"),
        ([*TORCH_GANG[:2], TORCH_GANG[2].model_copy(update={"role_no": 1})], "role_no"),
    ],
)
def test_spec_that_is_not_the_gang_raises(endpoints: list[Endpoint], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        render_env(ctx(TORCH_JOB, endpoints, "worker", 0))
    with pytest.raises(ValueError, match=re.escape(message)):
        render_hostfile(ClusterSpec(job_id="j1", attempt=2, endpoints=endpoints), TORCH_JOB)


def test_task_not_in_spec_raises() -> None:
    with pytest.raises(ValueError, match=r"no task worker\.3"):
        render_env(ctx(TORCH_JOB, TORCH_GANG, "worker", 3))
    with pytest.raises(ValueError, match=r"no task chief\.0"):
        render_env(ctx(TORCH_JOB, TORCH_GANG, "chief", 0))


def test_missing_port_label_raises() -> None:
    config = job(role("server", 1, portList=[{"label": "http", "beginAt": 0, "portNumber": 1}]))
    with pytest.raises(ValueError, match="'http'"):
        render_env(ctx(config, [ep(config, "server", 0, "a", "h", 1)], "server", 0))


def test_spec_of_another_attempt_raises() -> None:
    spec = ClusterSpec(job_id="j1", attempt=1, endpoints=TORCH_GANG)
    context = ctx(TORCH_JOB, TORCH_GANG, "worker", 0)
    with pytest.raises(ValueError, match="attempt 1"):
        render_env(TaskContext(**{**context.__dict__, "spec": spec}))


# ------------------------------------------------------------------ the conformance corpus


def synthetic_gang(config: JobConfig) -> list[Endpoint]:
    """Two tasks per node, hosts 198.18.0.x, ports from 5000 (portList ports from 6000)."""
    gang, n = [], 0
    for role_no, r in enumerate(config.taskRoles):
        for index in range(r.taskNumber):
            ports, next_port = {}, 6000 + 100 * n
            for p in r.portList:
                ports[p.label] = list(range(next_port, next_port + p.portNumber))
                next_port += p.portNumber
            host = f"198.18.0.{n // 2 + 1}"
            gang.append(
                Endpoint(
                    role=r.name,
                    role_no=role_no,
                    index=index,
                    node=f"node{n // 2 + 1}",
                    host=host,
                    port=5000 + n,
                    ports=ports,
                )
            )
            n += 1
    return gang


@pytest.mark.parametrize("path", CORPUS_FILES, ids=[p.name for p in CORPUS_FILES])
def test_conformance_commands_find_their_variables(path: Path) -> None:
    config, errors = check_job(loads(path.read_text()))
    assert config is not None, errors
    gang = synthetic_gang(config)
    for ep_ in gang:
        env = render_env(
            ctx(
                config,
                gang,
                ep_.role,
                ep_.index,
                gpus=list(range(config.taskRoles[ep_.role_no].gpuNumber)),
                default_fs_uri="hdfs://10.0.0.1:9000",
                hostfile_path="/muster/hostfile",
            )
        )
        assert all(IDENT.match(k) for k in env), [k for k in env if not IDENT.match(k)]
        assert all(isinstance(v, str) for v in env.values())
        command = config.taskRoles[ep_.role_no].command
        missing = {name for name in PAI_REF.findall(command) if name not in env}
        assert not missing, f"{ep_.role}: {sorted(missing)}"
        for key in ("PAI_DATA_DIR", "PAI_OUTPUT_DIR", "PAI_CODE_DIR"):
            assert "$PAI_" not in env[key] and "${PAI_" not in env[key], (key, env[key])
    assert render_hostfile(ClusterSpec(job_id="j1", attempt=2, endpoints=gang), config).endswith("\n")


def test_corpus_is_there() -> None:
    assert len(CORPUS_FILES) >= 20


# ------------------------------------------------------------------ the shipped examples

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# What a task reads strictly: `$NAME`, `${NAME}`, `os.environ["NAME"]` (`.get` may find nothing).
STRICT_REF = re.compile(r"\$\{?([A-Z][A-Za-z0-9_]*)|environ\[['\"]([A-Za-z_][A-Za-z0-9_]*)")
SHELL_OWN = {"PWD", "HOME", "PATH", "HOSTNAME", "USER"}


def example_configs() -> list[Path]:
    return sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".json", ".yaml", ".yml"))


@pytest.mark.parametrize("path", example_configs(), ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_every_variable_an_example_reads_is_one_its_tasks_get(path: Path) -> None:
    """An example's commands, and the files beside it, read only variables its tasks are given:
    the rendered environment (a share of a GPU as such), its datasets' and synced code's. Most
    examples need a GPU or a dataset to run here, so a misspelt variable would otherwise only
    show on a GPU machine (examples/gpu-sharing read PAI_TASK_INDEX, which nothing sets)."""
    from muster.services.agent.prepare import data_var

    config, errors = check_job(loads(path.read_text()))
    assert config is not None, errors
    folder = [path] if path.parent == EXAMPLES else [p for p in path.parent.rglob("*") if p.is_file()]
    refs = {a or b for p in folder for a, b in STRICT_REF.findall(p.read_text(errors="replace"))}
    given = set(SHELL_OWN) | {data_var(d.split(":")[0]) for d in config.data}
    if config.codeSync is not None:
        given.add("MUSTER_CODE_DIR")
    gang = synthetic_gang(config)
    for ep_ in gang:
        gpus = config.taskRoles[ep_.role_no].gpuNumber
        share = (
            {"gpus": [0], "gpu_milli": round(gpus * 1000)}
            if 0 < gpus < 1
            else {"gpus": list(range(int(gpus)))}
        )
        at = ctx(config, gang, ep_.role, ep_.index, hostfile_path="/muster/hostfile", **share)
        given |= render_env(at).keys()
    assert refs - given == set(), f"{path.name} reads variables no task is given: {sorted(refs - given)}"


def test_two_gpu_tasks_of_a_gang_on_one_node_each_get_local_rank_0():
    """Each task sees only its own GPUs, counted from 0: `torch.cuda.set_device(LOCAL_RANK)` with
    the second task's LOCAL_RANK 1 named a device it does not have ("invalid device ordinal").
    A GPU task's LOCAL_RANK is 0 (torchrun's virtual mode); a task without GPUs keeps its place
    on the node. Its GPU indexes are NVML's, in PCI bus order: CUDA is told to count so."""
    cfg = JobConfig.model_validate(
        {"jobName": "two", "image": "x", "taskRoles": [{**role("worker", 2), "gpuNumber": 1}]}
    )
    eps = [
        Endpoint(role="worker", role_no=0, index=i, node="a", host="10.0.0.1", port=5000 + i)
        for i in range(2)
    ]
    envs = [render_env(ctx(cfg, eps, "worker", i, gpus=[i])) for i in range(2)]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "0"] and envs[1]["LOCAL_WORLD_SIZE"] == "2"
    assert envs[1]["CUDA_VISIBLE_DEVICES"] == "1" and envs[1]["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    cpu = JobConfig.model_validate({"jobName": "two", "image": "x", "taskRoles": [role("worker", 2)]})
    assert [render_env(ctx(cpu, eps, "worker", i))["LOCAL_RANK"] for i in range(2)] == ["0", "1"]
