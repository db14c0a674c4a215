"""Issue 11, the seeds' remaining shapes: per-role images (seed 004), OpenPAI's documentation
forms accepted with warnings (beginAt as a string, PAI_ names in jobEnvs), operator-defined
datasets mounted by `data` (seed 001), and code fetched from git once per attempt (`codeSync`).
Real things throughout: a real nats-server and validator, the real Docker engine, real git."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from muster.services.agent.launch import Where, build_launch, read_auth_file
from muster.services.agent.prepare import CodeSyncs, Prepared, data_var, fetch_code, resolve_datasets
from muster.services.agent.runtime import LaunchError
from muster.services.validator.service import Validator
from muster.shared import bus, client, subjects
from muster.shared.jobconfig import CodeSync, check_job, job_warnings
from muster.shared.messages import Assignment, ClusterSpec, Dataset, Endpoint, TaskCause, TaskSpec, Verdict
from tests.test_cli import mesh

__all__ = ["mesh"]  # a fixture: `muster up --no-agent` (authenticated) on a free port

PASSWORD = "s3cr3t-t0ken-never-shown"


def job(**extra: Any) -> dict[str, Any]:
    return {
        "jobName": f"c{uuid.uuid4().hex[:8]}",
        "image": "muster/base:bookworm",
        "taskRoles": [
            {
                "name": "master",
                "taskNumber": 1,
                "cpuNumber": 1,
                "memoryMB": 128,
                "gpuNumber": 0,
                "command": "true",
            },
            {
                "name": "worker",
                "taskNumber": 2,
                "cpuNumber": 1,
                "memoryMB": 128,
                "gpuNumber": 0,
                "command": "true",
                "image": "registry.example.com:5000/team/worker:2",
            },
        ],
        **extra,
    }


def assignment(config: dict[str, Any], user: str = "alice") -> Assignment:
    checked, errors = check_job(config)
    assert checked is not None, errors
    gang = [
        TaskSpec(role=r.name, role_no=i, index=k, node="n1")
        for i, r in enumerate(checked.taskRoles)
        for k in range(r.taskNumber)
    ]
    return Assignment(
        job_id=f"j{uuid.uuid4().hex[:8]}", attempt=1, user=user, config=checked, gang=gang, node="n1"
    )


def where(tmp: Path, containers: bool = True) -> Where:
    return Where(
        node="n1",
        work_root=str(tmp / "work"),
        output_root=str(tmp / "output"),
        default_fs_uri="",
        gpu_devices=False,
        data_roots=(str(tmp / "users" / "{user}"), str(tmp / "shared")),
        containers=containers,
    )


def launches(tmp: Path, a: Assignment, prepared: Prepared | None = None, containers: bool = True):
    cluster = ClusterSpec(
        job_id=a.job_id,
        attempt=1,
        endpoints=[
            Endpoint(
                role=s.role, role_no=s.role_no, index=s.index, node="n1", host="127.0.0.1", port=5000 + n
            )
            for n, s in enumerate(a.gang)
        ],
    )
    return [
        build_launch(a, s, [5000 + n], cluster, where(tmp, containers), prepared)
        for n, s in enumerate(a.gang)
    ]


@pytest.fixture
def roots(tmp_path: Path) -> Path:
    (tmp_path / "users" / "alice").mkdir(parents=True)
    (tmp_path / "shared" / "imagenet").mkdir(parents=True)
    (tmp_path / "shared" / "imagenet" / "labels.txt").write_text("cat\ndog\n")
    (tmp_path / "outside").mkdir()
    return tmp_path


# ---------------------------------------------------------------- 1. per-role images


def test_a_roles_image_overrides_the_jobs_for_its_tasks_only(roots):
    a = assignment(job())
    images = {(lt.labels["muster.role"], lt.image) for lt in launches(roots, a)}
    assert images == {
        ("master", "muster/base:bookworm"),
        ("worker", "registry.example.com:5000/team/worker:2"),
    }
    assert a.config.images == ["muster/base:bookworm", "registry.example.com:5000/team/worker:2"]


def test_a_bad_role_image_is_refused_naming_the_role():
    config = job()
    config["taskRoles"][1]["image"] = "Not An Image"
    assert check_job(config)[0] is None
    assert [e.path for e in check_job(config)[1]] == ["taskRoles[1].image"]


def test_an_auth_file_goes_only_to_its_own_registry_among_the_roles_images(roots):
    r = [str(roots / "users" / "{user}")]
    path = roots / "users" / "alice" / "auth"
    path.write_text(f"registry.example.com:5000\nalice\n{PASSWORD}\n")
    images = ["muster/base:bookworm", "registry.example.com:5000/team/worker:2"]
    worker = read_auth_file(str(path), r, "alice", images[1], images)
    assert worker is not None and worker.password == PASSWORD
    assert read_auth_file(str(path), r, "alice", images[0], images) is None  # Docker Hub: anonymous
    with pytest.raises(LaunchError) as refused:  # a registry none of the job's images is on
        read_auth_file(str(path), r, "alice", "ubuntu", ["ubuntu", "debian"])
    assert refused.value.cause == TaskCause.CONFIG and PASSWORD not in str(refused.value)


# ---------------------------------------------------------------- 2. OpenPAI's forms, with warnings


def openpai_doc_config() -> dict[str, Any]:
    config = job()
    config["taskRoles"][0]["portList"] = [{"label": "http", "beginAt": "0", "portNumber": 1}]
    config["jobEnvs"] = {
        "PAI_USER_NAME": "alice",
        "PAI_URL": "http://pai",
        "PAI_JOB_NAME": "mine",
        "EPOCHS": 3,
    }
    return config


def test_beginat_as_a_string_and_pai_jobenvs_pass_with_a_warning_each():
    config, errors = check_job(openpai_doc_config())
    assert config is not None, errors
    assert config.taskRoles[0].portList[0].beginAt == 0
    warned = {w.path: w.reason for w in job_warnings(openpai_doc_config())}
    assert set(warned) == {
        "taskRoles[0].portList[0].beginAt",
        "jobEnvs.PAI_USER_NAME",
        "jobEnvs.PAI_URL",
        "jobEnvs.PAI_JOB_NAME",
    }
    assert "OpenPAI" in warned["taskRoles[0].portList[0].beginAt"]
    assert "wins" in warned["jobEnvs.PAI_URL"]


@pytest.mark.parametrize("value", ["zero", "", "-1", "1e3", "0x10"])
def test_a_beginat_string_that_is_no_number_is_refused_naming_the_field(value):
    config = job()
    config["taskRoles"][1]["portList"] = [{"label": "http", "beginAt": value, "portNumber": 1}]
    checked, errors = check_job(config)
    assert checked is None
    assert [e.path for e in errors] == ["taskRoles[1].portList[0].beginAt"], errors
    assert "must be an integer" in errors[0].reason


def test_muster_names_in_jobenvs_stay_refused():
    checked, errors = check_job(job(jobEnvs={"MUSTER_JOB_ID": "x"}))
    assert checked is None and [e.path for e in errors] == ["jobEnvs.MUSTER_JOB_ID"]


def test_the_platforms_pai_values_win_over_the_jobs(roots):
    config = openpai_doc_config()
    del config["taskRoles"][0]["portList"]
    a = assignment(config)
    env = launches(roots, a)[0].env
    assert env["PAI_JOB_NAME"] == a.config.jobName  # the platform sets it: its value
    assert env["PAI_USERNAME"] == "alice"
    assert env["PAI_URL"] == "http://pai" and env["PAI_USER_NAME"] == "alice"  # not the platform's
    assert env["EPOCHS"] == "3"


def test_muster_validate_prints_the_warnings_on_stderr(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(openpai_doc_config()))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "muster.services.cli.main", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "valid" in done.stdout
    assert f"{path}: warning: taskRoles[0].portList[0].beginAt: a number written as a string" in done.stderr
    assert f"{path}: warning: jobEnvs.PAI_URL:" in done.stderr


# ---------------------------------------------------------------- the validator (real NATS)


@pytest.fixture
async def nc(nats_url: str):
    conn = await bus.connect("test", nats_url)
    yield conn
    await conn.close()


@contextlib.asynccontextmanager
async def running(nc, *records: Dataset) -> AsyncIterator[tuple[Validator, Any]]:
    js, buckets = await bus.ensure_jetstream(nc)
    kv = buckets[subjects.DATASETS_BUCKET]
    for ds in records:
        await kv.put(ds.name, ds.to_bytes())
    v = Validator(nc, js, buckets)
    stop = asyncio.Event()
    task = asyncio.create_task(v.run(stop))
    try:
        yield v, kv
        assert not task.done(), "the validator stopped"
    finally:
        stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 30)


async def until(cond: Callable[[], bool], timeout: float = 20) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def submit(nc, config: dict[str, Any], user: str = "alice") -> Verdict:
    _, verdict = await client.submit(nc, json.dumps(config).encode(), user=user, timeout=30)
    assert verdict is not None, "no verdict"
    return verdict


IMAGENET = Dataset(name="imagenet", source="/srv/imagenet", users=["alice"])
SCRATCH = Dataset(name="scratch", source="scratch-volume", writable=True)


async def test_the_verdict_carries_the_warnings_of_an_accepted_config(nc):
    async with running(nc):
        verdict = await submit(nc, openpai_doc_config())
    assert verdict.accepted, verdict.errors
    assert {w.path for w in verdict.warnings} >= {"taskRoles[0].portList[0].beginAt", "jobEnvs.PAI_URL"}
    plain = job()
    async with running(nc):
        assert (await submit(nc, plain)).warnings == []


async def test_data_names_operator_datasets_the_user_may_mount(nc):
    async with running(nc, IMAGENET, SCRATCH) as (v, kv):
        ok = await submit(nc, job(data=["imagenet:/data/imagenet", "scratch:/scratch:rw"]))
        assert ok.accepted, ok.errors
        bob = await submit(nc, job(data=["scratch:/scratch", "imagenet:/data"]), user="bob")
        assert [(e.path, e.reason) for e in bob.errors] == [
            ("data[1]", "user 'bob' may not mount dataset 'imagenet'")
        ]
        # The contract's refusals come first; the datasets' only once the config is well formed.
        refused = await submit(nc, job(data=["nope:/x", "imagenet:/d:rw", "scratch:/d", "bad"]))
        assert [e.path for e in refused.errors] == ["data[3]", "data[2]"]
        assert refused.errors[1].reason == "/d is already mounted by data[1]"
        refused = await submit(nc, job(data=["nope:/x", "imagenet:/d:rw"]))
        assert [(e.path, e.reason) for e in refused.errors] == [
            (
                "data[0]",
                "no dataset 'nope'; yours to mount: imagenet, scratch; an admin defines it with "
                "`muster admin dataset set nope --source DIR` (docs/data.md)",
            ),
            ("data[1]", "dataset 'imagenet' is read-only: drop ':rw'"),
        ]
        # Changes apply without a restart; a record that does not decode is skipped, not fatal.
        await kv.put("tmp", Dataset(name="tmp", source="/srv/tmp").to_bytes())
        await kv.put("broken", b"not a dataset")
        await kv.put("mislabeled", Dataset(name="other", source="/srv/x").to_bytes())
        await until(lambda: "tmp" in v.datasets)
        assert "broken" not in v.datasets and "mislabeled" not in v.datasets
        assert (await submit(nc, job(data=["tmp:/tmp-data"]))).accepted
        await kv.purge("tmp")
        await until(lambda: "tmp" not in v.datasets)
        assert not (await submit(nc, job(data=["tmp:/tmp-data"]))).accepted


# ---------------------------------------------------------------- 3. datasets at the agent


async def records(*found: Dataset):
    known = {d.name: d for d in found}

    async def lookup(name: str) -> Dataset | None:
        return known.get(name)

    return lookup


async def test_datasets_resolve_under_the_roots_read_only_unless_rw_and_writable(roots):
    shared = roots / "shared"
    ro = Dataset(name="imagenet", source=str(shared / "imagenet"))
    rw = Dataset(name="out-set", source=str(shared / "imagenet"), writable=True)
    a = assignment(job(data=["imagenet:/data/in", "out-set:/data/out:rw"]))
    mounts, env = await resolve_datasets(
        a.config, "alice", await records(ro, rw), list(where(roots).data_roots), True
    )
    assert [(m.host, m.container, m.read_only, m.kind) for m in mounts] == [
        (str(shared / "imagenet"), "/data/in", True, "bind"),
        (str(shared / "imagenet"), "/data/out", False, "bind"),
    ]
    assert env == {"MUSTER_DATA_IMAGENET": "/data/in", "MUSTER_DATA_OUT_SET": "/data/out"}
    # :rw of a dataset made read-only since: mounted read-only.
    mounts, _ = await resolve_datasets(
        a.config,
        "alice",
        await records(ro, rw.model_copy(update={"writable": False})),
        list(where(roots).data_roots),
        True,
    )
    assert [m.read_only for m in mounts] == [True, True]
    # The process runtime mounts nothing: the task is told the host directory.
    _, env = await resolve_datasets(
        a.config, "alice", await records(ro, rw), list(where(roots).data_roots), False
    )
    assert env[data_var("imagenet")] == str(shared / "imagenet")
    launch = launches(roots, a, Prepared(mounts=mounts, env=env))[0]
    assert launch.env["MUSTER_DATA_IMAGENET"] == str(shared / "imagenet")


@pytest.mark.parametrize(
    "record, why",
    [
        (None, "no dataset 'imagenet'"),
        ("outside", "not under the allowed roots"),
        ("link-out", "outside the allowed roots"),
        ("bob-only", "may not mount"),
        ("volume", "this node's runtime mounts none"),
        ("missing-dir", "is not a directory"),
    ],
)
async def test_a_dataset_the_node_cannot_mount_is_a_configuration_error(roots, record, why):
    source = str(roots / "shared" / "imagenet")
    found: list[Dataset] = []
    if record == "outside":
        found = [Dataset(name="imagenet", source=str(roots / "outside"))]
    elif record == "link-out":
        os.symlink(roots / "outside", roots / "shared" / "link")
        found = [Dataset(name="imagenet", source=str(roots / "shared" / "link"))]
    elif record == "bob-only":
        found = [Dataset(name="imagenet", source=source, users=["bob"])]
    elif record == "volume":
        found = [Dataset(name="imagenet", source="imagenet-volume")]
    elif record == "missing-dir":
        found = [Dataset(name="imagenet", source=str(roots / "shared" / "gone"))]
    a = assignment(job(data=["imagenet:/data"]))
    with pytest.raises(LaunchError, match=why) as refused:
        await resolve_datasets(a.config, "alice", await records(*found), list(where(roots).data_roots), False)
    assert refused.value.cause == TaskCause.CONFIG
    assert "data[0]" in str(refused.value)


# ---------------------------------------------------------------- 4. code sync


def git(*args: str, cwd: Path) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def repo(roots: Path) -> Path:
    """A git repository under the data roots: main has train.py printing v1, then v2."""
    path = roots / "shared" / "repo"
    path.mkdir()
    git("init", "-q", "-b", "main", ".", cwd=path)
    (path / "train.py").write_text("print('v1')\n")
    git("add", "train.py", cwd=path)
    git("commit", "-qm", "v1", cwd=path)
    git("branch", "v1", cwd=path)
    (path / "train.py").write_text("print('v2')\n")
    git("commit", "-qam", "v2", cwd=path)
    return path


async def test_code_is_fetched_by_branch_or_commit_shallow_where_possible(repo, tmp_path):
    first = git("rev-parse", "v1", cwd=repo)
    cases = [
        (CodeSync(git=f"file://{repo}", branch="main"), "v2"),
        (CodeSync(git=str(repo), branch="v1"), "v1"),
        (CodeSync(git=str(repo), commit=first), "v1"),
        (CodeSync(git=str(repo), commit=first[:10]), "v1"),
        (CodeSync(git=str(repo)), "v2"),
    ]
    for n, (sync, printed) in enumerate(cases):
        target = tmp_path / f"code{n}"
        commit = await fetch_code(sync, str(target), False, timeout=60)
        assert (target / "train.py").read_text() == f"print('{printed}')\n", sync
        assert commit == git("rev-parse", printed if printed == "v1" else "main", cwd=repo)


async def test_one_fetch_per_attempt_on_a_node_shared_by_its_tasks(repo, tmp_path):
    syncs = CodeSyncs(timeout=60)
    sync = CodeSync(git=str(repo), branch="main")
    attempt_dir = tmp_path / "attempt1"
    attempt_dir.mkdir()
    mark = attempt_dir / ".muster-code-sync"
    target = str(attempt_dir / "code")
    results = await asyncio.gather(*(syncs.sync("j1", 1, sync, target, False, mark) for _ in range(4)))
    assert len(set(results)) == 1 and mark.read_text().strip() == results[0]
    # The repository moves on: the attempt keeps what it fetched; the next attempt fetches anew.
    (repo / "train.py").write_text("print('v3')\n")
    git("commit", "-qam", "v3", cwd=repo)
    assert await syncs.sync("j1", 1, sync, target, False, mark) == results[0]
    assert (Path(target) / "train.py").read_text() == "print('v2')\n"
    attempt2 = tmp_path / "attempt2"
    attempt2.mkdir()
    again = await syncs.sync("j1", 2, sync, str(attempt2 / "code"), False, attempt2 / ".muster-code-sync")
    assert again != results[0] and (attempt2 / "code" / "train.py").read_text() == "print('v3')\n"
    # An agent restarted mid-attempt finds the attempt's fetch done.
    assert await CodeSyncs().sync("j1", 1, sync, target, False, mark) == results[0]


@pytest.mark.parametrize(
    "url, said",
    [
        (f"https://alice:{PASSWORD}@127.0.0.1:1/team/code.git", "https://***@127.0.0.1:1/team/code.git"),
        ("{repo}-missing", "-missing"),
    ],
)
async def test_a_failed_fetch_is_a_configuration_error_without_credentials(repo, tmp_path, url, said):
    sync = CodeSync(git=url.format(repo=repo), branch="main")
    with pytest.raises(LaunchError) as refused:
        await fetch_code(sync, str(tmp_path / "code"), False, timeout=60)
    assert refused.value.cause == TaskCause.CONFIG
    assert said in str(refused.value) and PASSWORD not in str(refused.value)
    assert str(refused.value).startswith("codeSync: cannot fetch")


async def test_a_fetch_into_a_full_disk_is_the_nodes_failure_not_the_jobs(repo, tmp_path, monkeypatch):
    """git's fetch ran out of space on this node: that was a configuration error, never retried
    (the job failed for good as one that "would fail on any node"). It is the node's: the gang
    runs again, elsewhere or once space is freed, uncharged."""
    from muster.services.agent import prepare

    real = prepare._git

    async def full(args, *rest, **kw):
        if args[0] == "fetch":
            return 128, "error: unable to write file .git/objects/pack/tmp_pack: No space left on device"
        return await real(args, *rest, **kw)

    monkeypatch.setattr(prepare, "_git", full)  # no test can fill a disk on demand
    with pytest.raises(LaunchError) as refused:
        await fetch_code(CodeSync(git=str(repo), branch="main"), str(tmp_path / "code"), False, timeout=60)
    assert refused.value.cause == TaskCause.PLATFORM, refused.value
    assert "disk is full" in str(refused.value)


async def test_a_fetch_that_takes_too_long_is_stopped_at_its_bound(tmp_path):
    import socket

    server = socket.socket()  # accepts, never answers: git waits until it is killed
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(LaunchError, match="not done within 2s") as refused:
            await fetch_code(
                CodeSync(git=f"git://127.0.0.1:{port}/x"), str(tmp_path / "code"), False, timeout=2
            )
        assert loop.time() - started < 30
        assert refused.value.cause == TaskCause.CONFIG
    finally:
        server.close()


def test_code_sync_urls_that_could_run_commands_are_refused():
    for url in ("ext::sh -c touch% /tmp/pwned", "-uhelp", "fd::3", "relative/path", "ftp://x/y"):
        checked, errors = check_job(job(codeSync={"git": url}))
        assert checked is None and [e.path for e in errors] == ["codeSync.git"], (url, errors)
    checked, errors = check_job(job(codeSync={"git": "/r", "branch": "main", "commit": "abcdef0"}))
    assert checked is None and [e.path for e in errors] == ["codeSync.commit"]
    checked, errors = check_job(job(codeSync={"git": "/r", "branch": "--upload-pack=x"}))
    assert checked is None and [e.path for e in errors] == ["codeSync.branch"]
    config = job(codeSync={"git": f"https://u:{PASSWORD}@h/x.git"})
    assert check_job(config)[0] is not None
    assert [w.path for w in job_warnings(config)] == ["codeSync.git"]
    assert PASSWORD not in json.dumps([w.model_dump() for w in job_warnings(config)])


# ---------------------------------------------------------------- the CLI (authenticated `muster up`)


async def test_admin_dataset_set_list_remove_round_trip_through_the_cli(mesh, tmp_path):
    from tests.test_cli import muster, write

    _, env = mesh
    r = muster(
        "admin", "dataset", "set", "imagenet", "--source", "/srv/imagenet", "--users", "alice,bob",
        "--description", "ILSVRC 2012", env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("imagenet: set — host directory /srv/imagenet; read-only")
    r = muster("admin", "dataset", "set", "scratch", "--source", "scratch-vol", "--writable", env=env)
    assert r.returncode == 0 and "Docker volume scratch-vol; writable" in r.stdout, r.stderr
    r = muster("admin", "dataset", "list", "--json", env=env)
    assert [Dataset.model_validate(x) for x in json.loads(r.stdout)] == [
        Dataset(name="imagenet", source="/srv/imagenet", users=["alice", "bob"], description="ILSVRC 2012"),
        Dataset(name="scratch", source="scratch-vol", writable=True),
    ]
    r = muster("admin", "dataset", "list", env=env)
    assert r.stdout.splitlines()[0].split() == ["NAME", "SOURCE", "WRITABLE", "USERS", "DESCRIPTION"]

    # The validator (under its own identity) applies it to the next submission.
    config = write(tmp_path, "d.json", json.dumps(job(data=["scratch:/scratch:rw", "imagenet:/in"])))
    r = muster("submit", config, env=env)
    assert (
        r.returncode == 2 and "data[1]: user" in r.stderr and "may not mount dataset 'imagenet'" in r.stderr
    )
    warned = write(
        tmp_path, "w.json", json.dumps(job(data=["scratch:/scratch:rw"], jobEnvs={"PAI_URL": "u"}))
    )
    r = muster("submit", warned, env=env)
    assert r.returncode == 0 and "accepted" in r.stdout, r.stderr
    assert "warning: jobEnvs.PAI_URL:" in r.stderr

    for args, named in (
        (("--source", "relative/dir"), "--source"),
        (("--source", "/x", "--users", "a b"), "--users"),
    ):
        r = muster("admin", "dataset", "set", "bad", *args, env=env)
        assert r.returncode == 2 and named in r.stderr, (args, r.stderr)
    r = muster("admin", "dataset", "remove", "imagenet", env=env)
    assert r.returncode == 0, r.stderr
    r = muster("admin", "dataset", "remove", "imagenet", env=env)
    assert r.returncode == 2 and "no dataset 'imagenet'" in r.stderr
    r = muster("admin", "dataset", "list", "--json", env=env)
    assert [x["name"] for x in json.loads(r.stdout)] == ["scratch"]


# ---------------------------------------------------------------- end to end (process runtime)


async def test_a_job_mounts_its_dataset_and_runs_the_synced_code_once_per_attempt(cluster, nc, repo, roots):
    from tests.test_jobs import attempt, run_job

    _, buckets = await bus.ensure_jetstream(nc)
    source = roots / "shared" / "imagenet"
    await buckets[subjects.DATASETS_BUCKET].put(
        "imagenet", Dataset(name="imagenet", source=str(source)).to_bytes()
    )
    (repo / "train.py").write_text(
        "import os, sys\n"
        "labels = open(os.path.join(os.environ['MUSTER_DATA_IMAGENET'], 'labels.txt')).read().split()\n"
        "assert labels == ['cat', 'dog'], labels\n"
        "assert os.getcwd() == os.environ['MUSTER_CODE_DIR'] == os.environ['PAI_CODE_DIR'], os.getcwd()\n"
        "print('trained', os.environ['PAI_TASK_ROLE_NAME'])\n"
    )
    git("commit", "-qam", "train", cwd=repo)
    cluster.core()
    cluster.agent("node-a", "--cpus", "4", "--data-roots", f"{roots}/users/{{user}},{roots}/shared")
    config = job(data=["imagenet:/data/imagenet"], codeSync={"git": f"file://{repo}", "branch": "main"})
    for r in config["taskRoles"]:
        r["command"] = f"{sys.executable} train.py"
    record = await run_job(nc, config, timeout=120)
    assert record.state.value == "SUCCEEDED", (record.reason, cluster.logs())
    assert len((await attempt(nc, record.job_id)).tasks) == 3
    work = cluster.log_dir / "work" / "node-a" / record.job_id / "1"
    assert (work / ".muster-code-sync").read_text().strip() == git("rev-parse", "main", cwd=repo)
    logs = "".join(p.read_text() for p in cluster.log_dir.glob("agent-*.log"))
    assert logs.count("agent.code_synced") == 1  # three tasks on the node, one fetch


async def test_a_fetch_that_fails_fails_the_job_at_once_without_showing_credentials(cluster, nc, roots):
    from tests.test_jobs import attempt, run_job

    await bus.ensure_jetstream(nc)
    cluster.core()
    cluster.agent("node-a", "--cpus", "4", "--data-roots", f"{roots}/users/{{user}},{roots}/shared")
    config = job(codeSync={"git": f"https://alice:{PASSWORD}@127.0.0.1:1/team/code.git"}, retryCount=3)
    record = await run_job(nc, config, timeout=120)
    assert record.state.value == "FAILED", (record.reason, cluster.logs())
    assert record.attempt == 1 and record.retries == 0  # a configuration error: never retried
    assert "https://***@127.0.0.1:1/team/code.git" in record.reason
    tasks = (await attempt(nc, record.job_id)).tasks
    assert any("codeSync: cannot fetch https://***@127.0.0.1:1/team/code.git" in t.reason for t in tasks)
    every_log = "".join(p.read_text() for p in cluster.log_dir.glob("*.log"))
    assert PASSWORD not in every_log
    assert PASSWORD not in json.dumps([t.model_dump(mode="json") for t in tasks])


# ---------------------------------------------------------------- in Docker (real engine)


@pytest.fixture
def engine():
    import docker

    client = docker.from_env()
    yield client
    client.close()


@pytest.fixture
def role_image(base_image: str, engine) -> Any:
    """An image of its own for the worker role: the base with a file saying so."""
    import io

    tag = f"muster/contract-worker:{uuid.uuid4().hex[:8]}"
    dockerfile = f"FROM {base_image}\nRUN echo worker-image > /role-image\n"
    engine.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True)
    yield tag
    with contextlib.suppress(Exception):
        engine.images.remove(tag, force=True)


@pytest.mark.docker
async def test_in_docker_each_role_runs_its_image_with_the_datasets_mounted_as_declared(
    base_image, role_image, engine, roots
):
    from muster.services.agent.docker_runtime import DockerRuntime

    shared = roots / "shared"
    (shared / "results").mkdir()
    os.chmod(shared / "results", 0o777)  # the task runs as a non-root user
    volume = engine.volumes.create(f"muster-contract-{uuid.uuid4().hex[:8]}")
    found = await records(
        Dataset(name="imagenet", source=str(shared / "imagenet")),
        Dataset(name="results", source=str(shared / "results"), writable=True),
        Dataset(name="vol", source=volume.name, writable=True),
    )
    config = job(data=["imagenet:/data/in:rw", "results:/data/out:rw", "vol:/vol"])
    config["image"] = base_image
    config["taskRoles"][1]["image"] = role_image
    probe = (
        "cat /role-image 2>/dev/null || echo job-image; cat $MUSTER_DATA_IMAGENET/labels.txt; "
        "touch /data/in/x 2>/dev/null && echo in-writable || echo in-read-only; "
        "touch /data/out/y && echo out-writable; "
        "grep ' /vol ' /proc/mounts | grep -q ' ro,' && echo vol-read-only"
    )
    for r in config["taskRoles"]:
        r["command"] = probe
    a = assignment(config)
    mounts, env = await resolve_datasets(a.config, "alice", found, list(where(roots).data_roots), True)
    runtime = DockerRuntime(pids_limit=64)
    seen: dict[str, list[str]] = {}
    try:
        for launch in launches(roots, a, Prepared(mounts=mounts, env=env)):
            if launch.labels["muster.index"] != "0":
                continue
            lines: list[str] = []
            task = await runtime.start(launch, lines.append)
            try:
                assert await asyncio.wait_for(task.wait(), 120) == 0, lines
                await asyncio.sleep(0.2)
            finally:
                with contextlib.suppress(Exception):
                    engine.api.remove_container(launch.name, force=True)
            seen[launch.labels["muster.role"]] = lines
    finally:
        await runtime.close()
        with contextlib.suppress(Exception):
            volume.remove(force=True)
    expected = ["cat", "dog", "in-read-only", "out-writable", "vol-read-only"]
    assert seen["master"] == ["job-image", *expected]
    assert seen["worker"] == ["worker-image", *expected]
    assert (shared / "results" / "y").exists() and not (shared / "imagenet" / "x").exists()


@pytest.mark.docker
async def test_in_docker_a_dataset_volume_that_does_not_exist_is_a_configuration_error(base_image, roots):
    from muster.services.agent.docker_runtime import DockerRuntime

    found = await records(Dataset(name="vol", source=f"muster-missing-{uuid.uuid4().hex[:8]}"))
    config = job(data=["vol:/vol"])
    config["taskRoles"][1].pop("image")
    a = assignment(config)
    mounts, env = await resolve_datasets(a.config, "alice", found, list(where(roots).data_roots), True)
    runtime = DockerRuntime(pids_limit=64)
    try:
        with pytest.raises(LaunchError, match="does not exist on this node") as refused:
            await runtime.start(launches(roots, a, Prepared(mounts=mounts, env=env))[0], lambda _: None)
        assert refused.value.cause == TaskCause.CONFIG
    finally:
        await runtime.close()


def test_a_local_code_sync_repository_outside_the_roots_is_refused_at_validation(roots):
    from muster.shared import hostpaths

    allowed = [str(roots / "users" / "{user}"), str(roots / "shared")]
    for url, refused in (
        (f"{roots}/shared/repo", False),
        (f"file://{roots}/users/alice/repo", False),
        ("/etc", True),
        (f"file://{roots}/users/bob/repo", True),
        ("https://h/r.git", False),
    ):
        config, errors = check_job(job(codeSync={"git": url}))
        assert config is not None, errors
        found = hostpaths.check_dirs(config, "alice", allowed)
        assert [e.path for e in found] == (["codeSync.git"] if refused else []), (url, found)


def test_an_elastic_jobs_env_file_carries_the_platforms_pai_values(roots):
    config = job(jobEnvs={"PAI_JOB_NAME": "mine", "PAI_URL": "http://pai", "TOKEN_SECRET": "hidden"})
    config["taskRoles"] = [
        {
            "name": "worker",
            "taskNumber": 2,
            "minTaskNumber": 1,
            "maxTaskNumber": 3,
            "cpuNumber": 1,
            "memoryMB": 128,
            "gpuNumber": 0,
            "command": "true",
        }
    ]
    a = assignment(config)
    launch = launches(roots, a)[0]
    text = Path(launch.env["MUSTER_ENV_FILE"]).read_text()
    assert f"export PAI_JOB_NAME={a.config.jobName}\n" in text  # the platform's value, which won
    assert "PAI_URL" not in text and "hidden" not in text  # the job's own values stay out of files


def test_seed_001s_arena_shape_is_a_muster_config():
    """Arena's MPIJob step (seed 001), as examples/arena-mpijob/job.json writes it: an MPI job of
    workers with GPUs, CPU/memory limits, a data volume, env, git-synced code and a metric read
    from stdout. Every part of it is understood, not only accepted."""
    from muster.shared import mpi
    from muster.shared.loader import loads

    path = Path(__file__).resolve().parents[1] / "examples" / "arena-mpijob" / "job.json"
    config = loads(path.read_text(), str(path))
    checked, errors = check_job(config)
    assert checked is not None, errors
    assert job_warnings(config) == []
    assert [(m.name, m.path, m.rw) for m in checked.mounts] == [("user-susan", "/training", False)]
    assert checked.codeSync is not None and checked.codeSync.branch == "cnn_tf_v1.9_compatible"
    assert checked.jobEnvs == {"NCCL_DEBUG": "INFO", "GIT_SYNC_BRANCH": "cnn_tf_v1.9_compatible"}
    assert [(m.name, m.format) for m in checked.metric_specs] == [("images/sec", "RAW")]
    (role,) = checked.taskRoles
    assert (role.taskNumber, role.gpuNumber, role.cpuNumber, role.memoryMB) == (2, 1, 2, 10240)
    assert mpi.shape(checked) == mpi.MpiShape(launcher="worker", workers="worker")


@pytest.mark.docker
async def test_in_docker_the_synced_code_is_where_the_task_starts(base_image, engine, repo, roots):
    from muster.services.agent.docker_runtime import DockerRuntime

    config = job(codeSync={"git": str(repo), "branch": "main"})
    config["taskRoles"] = config["taskRoles"][:1]
    config["taskRoles"][0]["command"] = 'pwd; test "$PWD" = "$MUSTER_CODE_DIR" && cat train.py'
    a = assignment(config)
    attempt_dir = roots / "work" / a.job_id / "1"
    attempt_dir.mkdir(parents=True)
    code = str(attempt_dir / "code")
    await CodeSyncs(timeout=60).sync(
        a.job_id, 1, a.config.codeSync, code, False, attempt_dir / ".muster-code-sync"
    )
    launch = launches(roots, a, Prepared(code_dir=code))[0]
    runtime = DockerRuntime(pids_limit=64)
    lines: list[str] = []
    try:
        task = await runtime.start(launch, lines.append)
        assert await asyncio.wait_for(task.wait(), 120) == 0, lines
        await asyncio.sleep(0.2)
    finally:
        with contextlib.suppress(Exception):
            engine.api.remove_container(launch.name, force=True)
        await runtime.close()
    assert lines == [code, "print('v2')"]


def test_the_published_schema_admits_openpais_forms_and_the_new_fields():
    from tests.test_proto import _errors, _load

    schema = _load("jobconfig.schema.json")
    config = openpai_doc_config() | {"data": ["imagenet:/in"], "codeSync": {"git": "/r", "branch": "main"}}
    assert _errors(schema, schema, config) == []
    config["taskRoles"][0]["portList"][0]["beginAt"] = "zero"
    assert _errors(schema, schema, config) == ["$.taskRoles[0].portList[0].beginAt: matches no anyOf branch"]
