"""Tasks holding part of one GPU on a node (docs/gpus.md): the same device for all of them,
marked shared in env and status; with --gpu-sharing mps, one MPS control daemon per shared GPU
(started once, quit after the last task), each task's thread percentage and pinned memory limit,
and a neighbour's MPS fault reported as a platform failure (uncharged).

No GPU here: GPUs are declared (with their memory), and `nvidia-cuda-mps-control` is a fake on
PATH that records what it is asked and keeps a daemon's state in its pipe directory. The
agent's daemon lifecycle, the environment and the classification run for real."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from muster.services.agent import gpushare
from muster.services.agent.docker_runtime import DockerRuntime
from muster.services.agent.inventory import discover_gpus, parse_gpus
from muster.services.agent.runtime import TaskLaunch
from muster.services.cli.render import task_gpus
from muster.shared import bus
from muster.shared.jobconfig import JobConfig
from muster.shared.messages import FailureKind, GpuSharing, JobState, TaskCause, TaskStatus
from tests.test_agent import _wait_node
from tests.test_jobs import attempt, role, run_job

FAKE_MPS = """#!{python}
# A stand-in for NVIDIA's nvidia-cuda-mps-control: `-d` "starts" the daemon of
# CUDA_MPS_PIPE_DIRECTORY (a file in it says it runs), `quit` on stdin stops it, any other
# command answers only while it runs. Every start and quit is recorded beside this script.
import os, sys
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
alive = os.path.join(pipe, "fake-daemon")
def note(text):
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "record"), "a") as f:
        f.write(text + "\\n")
if sys.argv[1:] == ["-d"]:
    os.makedirs(pipe, exist_ok=True)
    with open(alive, "w") as f:
        f.write(str(os.getpid()))
    note("start " + os.environ.get("CUDA_VISIBLE_DEVICES", "?") + " " + pipe)
    sys.exit(0)
command = sys.stdin.read().strip()
if not os.path.exists(alive):
    print("Cannot find MPS control daemon process")
    sys.exit(1)
if command == "quit":
    os.unlink(alive)
    note("quit " + pipe)
sys.exit(0)
"""


@pytest.fixture
def fake_mps(tmp_path, monkeypatch) -> Path:
    """A fake nvidia-cuda-mps-control first on PATH; returns the file it records to."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    script = bin_dir / gpushare.MPS_CONTROL
    script.write_text(FAKE_MPS.replace("{python}", sys.executable))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    return bin_dir / "record"


def records(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# ------------------------------------------------------------------ the pure parts


def test_share_env_time_slicing_and_mps():
    assert gpushare.share_env([3], 500, GpuSharing.TIMESLICE) == {
        "CUDA_VISIBLE_DEVICES": "3",
        "NVIDIA_VISIBLE_DEVICES": "3",
        "MUSTER_GPU_SHARE": "0.5",
        "MUSTER_GPU_SHARING": "timeslice",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # the index is NVML's
    }
    env = gpushare.share_env([3], 250, GpuSharing.MPS, "/w/mps/3/pipe", memory_mb=81559)
    assert env == {
        "CUDA_VISIBLE_DEVICES": "0",  # the daemon of GPU 3 shows its clients that one device as 0
        "NVIDIA_VISIBLE_DEVICES": "3",
        "MUSTER_GPU_SHARE": "0.25",
        "MUSTER_GPU_SHARING": "mps",
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_MPS_PIPE_DIRECTORY": "/w/mps/3/pipe",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20389M",
    }
    # A device whose memory is unknown (declared without it): no memory limit, said nowhere else.
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in gpushare.share_env([0], 10, GpuSharing.MPS, "/p")


def test_declared_gpus_may_say_their_memory_and_nvml_reports_it():
    assert [(g.model, g.memory_mb) for g in parse_gpus("2xH100:81559,1xT4")] == [
        ("H100", 81559),
        ("H100", 81559),
        ("T4", 0),
    ]

    class FakeNvml:  # the calls discover_gpus makes of pynvml
        def __init__(self) -> None:
            self.calls: list[str] = []

        def nvmlInit(self):
            self.calls.append("init")

        def nvmlShutdown(self):
            self.calls.append("shutdown")

        def nvmlDeviceGetCount(self):
            return 1

        def nvmlDeviceGetHandleByIndex(self, i):
            return i

        def nvmlDeviceGetName(self, handle):
            return b"NVIDIA H100 80GB HBM3"

        def nvmlDeviceGetMemoryInfo(self, handle):
            return type("Memory", (), {"total": 81559 * 1024 * 1024})()

    nvml = FakeNvml()
    gpus = discover_gpus(nvml)
    assert gpus is not None and [(g.index, g.model, g.memory_mb) for g in gpus] == [(0, "H100", 81559)]
    assert nvml.calls == ["init", "shutdown"]


def test_docker_runs_an_mps_client_in_the_host_ipc_namespace():
    launch = TaskLaunch(
        name="t",
        image="img",
        command="true",
        env={"CUDA_VISIBLE_DEVICES": "0", "CUDA_MPS_PIPE_DIRECTORY": "/w/mps/3/pipe"},
        cpus=1,
        memory_mb=128,
        gpus=[3],
        ipc_host=True,
    )
    kwargs = DockerRuntime._create_kwargs(launch)
    assert kwargs["ipc_mode"] == "host"
    assert kwargs["environment"]["NVIDIA_VISIBLE_DEVICES"] == "3"
    assert kwargs["environment"]["CUDA_VISIBLE_DEVICES"] == "0"
    assert kwargs["device_requests"][0]["DeviceIDs"] == ["3"]
    launch.ipc_host = False
    assert "ipc_mode" not in DockerRuntime._create_kwargs(launch)


def test_the_cli_shows_a_shared_gpu_and_how_it_is_shared():
    config = JobConfig.model_validate(
        {"jobName": "j", "image": "img", "taskRoles": [role("t", 1, "true", gpu=0.5)]}
    )
    status = TaskStatus(role="t", role_no=0, index=0, node="n", gpus=[3])
    assert task_gpus(status, config) == "0.5 of 3"
    status.gpu_sharing = GpuSharing.TIMESLICE
    assert task_gpus(status, config) == "0.5 of 3, shared, time-sliced, not isolated"
    status.gpu_sharing = GpuSharing.MPS
    assert task_gpus(status, config) == "0.5 of 3, shared, MPS"


# ------------------------------------------------------------------ the daemons, through the fake binary


async def test_one_daemon_per_gpu_started_once_and_quit_after_the_last_task(fake_mps, tmp_path):
    daemons = gpushare.MpsDaemons(str(tmp_path / "work"))
    pipe0 = await daemons.acquire(0, "a")
    assert await daemons.acquire(0, "b") == pipe0
    pipe1 = await daemons.acquire(1, "c")
    assert records(fake_mps) == [f"start 0 {pipe0}", f"start 1 {pipe1}"]
    await daemons.release(0, "a")
    assert records(fake_mps)[2:] == []  # b still runs on GPU 0
    await daemons.release(0, "b")
    await daemons.release(0, "b")  # a repeated release changes nothing
    assert records(fake_mps)[2:] == [f"quit {pipe0}"]
    # A restarted agent: GPU 1's daemon was left running. It uses it for an adopted task and
    # starts none; a daemon nothing uses is told to quit.
    again = gpushare.MpsDaemons(str(tmp_path / "work"))
    await again.acquire(0, "d")
    assert records(fake_mps)[3:] == [f"start 0 {pipe0}"]
    await again.release(0, "d")
    assert await again.sweep() == [1]
    assert records(fake_mps)[-1] == f"quit {pipe1}"


async def test_a_neighbours_mps_fault_is_the_platforms_and_the_first_failure_its_cause(fake_mps, tmp_path):
    daemons = gpushare.MpsDaemons(str(tmp_path / "work"))
    for user in ("culprit", "victim", "bystander"):
        await daemons.acquire(0, user)
    # A task failing with nothing wrong with the server: its own failure.
    assert await daemons.judge(0, "bystander") is None
    _, logs = daemons.dirs(0)
    with (logs / "server.log").open("a") as f:
        f.write("[2026-11-26 13:00:00.000 Other 42] Client 4242 encountered a fatal GPU exception\n")
    assert await daemons.judge(0, "culprit") is None  # the first to fail after the fault: charged
    why = await daemons.judge(0, "victim")
    assert why is not None and "fatal GPU exception" in why and "culprit" in why
    # The daemon itself gone: nobody's fault, every failure on that GPU is the platform's.
    other = gpushare.MpsDaemons(str(tmp_path / "work2"))
    await other.acquire(2, "x")
    (other.dirs(2)[0] / "fake-daemon").unlink()
    why = await other.judge(2, "x")
    assert why is not None and "MPS daemon of GPU 2 is gone" in why


async def test_a_daemon_that_cannot_start_refuses_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert "nvidia-cuda-mps-control is not on PATH" in (gpushare.mps_available() or "")
    daemons = gpushare.MpsDaemons(str(tmp_path / "work"))
    with pytest.raises(gpushare.MpsError, match="cannot run nvidia-cuda-mps-control"):
        await daemons.acquire(0, "a")


def test_mps_mode_without_the_binary_refuses_to_start_in_one_line(tmp_path):
    env = {**os.environ, "PATH": str(Path(sys.executable).parent) + ":/nonexistent"}
    proc = subprocess.run(
        [sys.executable, "-m", "muster.services.agent", "--gpus", "1xH100", "--runtime", "process"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **env,
            "MUSTER_AGENT_GPU_SHARING": "mps",
            "MUSTER_DATA_DIR": str(tmp_path),
            "MUSTER_NATS_URL": "nats://127.0.0.1:1",
        },
    )
    assert proc.returncode != 0
    assert "--gpu-sharing mps: nvidia-cuda-mps-control is not on PATH" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------ on a real bus, with agents

# Each task writes its GPU variables, then waits (bounded) until its sibling has written too: both
# ran on the device at once.
SHOW = (
    'env | grep -E "^(CUDA_|NVIDIA_VISIBLE|MUSTER_GPU_|PAI_TASK_GPU_NUM)" '
    "| sort > {out}/$PAI_TASK_ROLE_INDEX; "
    "i=0; while [ $(ls {out} | wc -l) -lt 2 ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; "
    "test $(ls {out} | wc -l) -ge 2"
)


def _env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


@pytest.mark.parametrize("mode", ["timeslice", "mps"])
async def test_two_half_gpu_tasks_share_one_declared_gpu(mode, cluster, nats_url, tmp_path, fake_mps):
    cluster.core()
    cluster.agent(
        "gpu", "--gpus", "1xH100:81559", "--cpus", "4", "--address", "127.0.0.1", "--gpu-sharing", mode
    )
    nc = await bus.connect("test", nats_url)
    try:
        assert (await _wait_node(nc, "gpu", timeout=30)).gpu_sharing == mode
        out = tmp_path / "envs"
        out.mkdir()
        job = {
            "jobName": "halves",
            "image": "img",
            "taskRoles": [role("t", 2, SHOW.format(out=out), gpu=0.5)],
        }
        record = await run_job(nc, job)
        assert record.state == JobState.SUCCEEDED, record.reason
        envs = [_env(out / str(i)) for i in range(2)]
        tasks = (await attempt(nc, record.job_id)).tasks
        assert [t.gpus for t in tasks] == [[0], [0]]
        assert [t.gpu_sharing for t in tasks] == [GpuSharing(mode)] * 2
        work = tmp_path / "work" / "gpu"
        for env in envs:
            assert env["MUSTER_GPU_SHARE"] == "0.5" and env["PAI_TASK_GPU_NUM"] == "0.5"
            assert env["MUSTER_GPU_SHARING"] == mode and env["NVIDIA_VISIBLE_DEVICES"] == "0"
            assert env["CUDA_VISIBLE_DEVICES"] == "0"
        if mode == "timeslice":
            assert not any(k.startswith("CUDA_MPS_") for env in envs for k in env)
            assert records(fake_mps) == []
            return
        pipe = str(work / "mps" / "0" / "pipe")
        for env in envs:
            assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe
            assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
            assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40779M"
        # One daemon for the GPU, told to quit once both tasks had ended (bounded wait: the
        # agent quits it as it reports the last end).
        deadline = time.monotonic() + 20
        while records(fake_mps)[-1:] != [f"quit {pipe}"] and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert records(fake_mps) == [f"start 0 {pipe}", f"quit {pipe}"]
    finally:
        await nc.close()


# The culprit writes a fault into its GPU's MPS server log (as a real server logs a client's
# fatal fault) and fails; the victim, another job on the same GPU, fails once the culprit has
# ended; run again (attempt 2) it succeeds.
CULPRIT = (
    'echo $$ > {tmp}/culprit.pid; log=$(dirname "$CUDA_MPS_PIPE_DIRECTORY")/log/server.log; '
    "i=0; while [ ! -e {tmp}/victim.up ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; "
    'echo "[2026-11-26] Client $$ encountered a fatal GPU exception" >> $log; exit 3'
)
VICTIM = (
    "test $MUSTER_ATTEMPT -gt 1 && exit 0; touch {tmp}/victim.up; "
    "i=0; while [ ! -s {tmp}/culprit.pid ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; "
    # until the agent has reported the culprit's end (its first task to end): a real victim
    # fails when it next touches the GPU, after the culprit
    "while ! cat {tmp}/agent-*.log | grep -q agent.task_ended && [ $i -lt 1200 ]; do sleep 0.1; "
    "i=$((i+1)); done; exit 1"
)


async def test_an_mps_fault_fails_the_neighbour_as_the_platform_uncharged(
    cluster, nats_url, tmp_path, fake_mps
):
    cluster.core()
    cluster.agent(
        "gpu", "--gpus", "1xH100:81559", "--cpus", "4", "--address", "127.0.0.1", "--gpu-sharing", "mps"
    )
    nc = await bus.connect("test", nats_url)
    try:
        victim = {
            "jobName": "victim",
            "image": "img",
            "retryCount": 0,
            "taskRoles": [role("t", 1, VICTIM.format(tmp=tmp_path), gpu=0.5)],
        }
        culprit = {
            "jobName": "culprit",
            "image": "img",
            "retryCount": 0,
            "taskRoles": [role("t", 1, CULPRIT.format(tmp=tmp_path), gpu=0.5)],
        }
        records_ = await asyncio.gather(run_job(nc, victim), run_job(nc, culprit))
        victim_record, culprit_record = records_
        # The culprit's own failure: a user failure, and with retryCount 0 the job fails.
        assert culprit_record.state == JobState.FAILED
        first = await attempt(nc, culprit_record.job_id)
        assert first.failure is not None and first.failure.kind == FailureKind.USER
        assert first.tasks[0].cause == TaskCause.EXITED and first.tasks[0].exit_code == 3
        # The victim's: the platform's, not charged; its next attempt ran and succeeded.
        hit = await attempt(nc, victim_record.job_id)
        assert hit.tasks[0].cause == TaskCause.PLATFORM, hit.tasks[0]
        assert "fatal GPU exception" in hit.tasks[0].reason
        assert f"muster-{culprit_record.job_id}-1-t-0" in hit.tasks[0].reason
        assert hit.failure is not None and hit.failure.kind == FailureKind.PLATFORM and hit.charged is False
        assert victim_record.state == JobState.SUCCEEDED and victim_record.retries == 0
    finally:
        await nc.close()
