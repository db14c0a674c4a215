"""Every example under examples/, as shipped, on the embedded mesh: `muster up` started from the
repository root as the README starts it (Docker runtime, `--cpus 8 --overcommit`, everything
else its defaults, on a machine with no GPU), and `muster submit FILE --wait` from the repository root.
Each runs to SUCCEEDED with the image it names, built by the script in deploy/ its comment
names; or is refused saying exactly what to do. A dataset an example mounts is first refused
naming the command that defines it; the command its comment gives is then run as written."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from muster.shared.natsserver import free_port
from tests.conftest import ROOT
from tests.test_mpi import mpi_image  # noqa: F401 - a fixture

EXAMPLES = ROOT / "examples"
TORCH_IMAGE = "muster/torch:bookworm"


@dataclass(frozen=True)
class Expected:
    """What an example does here. `code`: `muster submit --wait`'s exit; `said`: a line its output
    holds; `logs`: a line its tasks' output holds, and how often; `dataset`: the dataset it mounts
    (refused until defined by the command in its comment); `offline`: what it says instead when
    the code it fetches from the internet is out of reach."""

    code: int = 0
    said: str = "SUCCEEDED"
    logs: tuple[str, int] | None = None
    dataset: str | None = None
    offline: str | None = None


EXPECTED = {
    "hello-gang.json": Expected(logs=("workers: ", 1)),
    "ps-worker/job.json": Expected(logs=("every ps agrees the sum is 6", 3)),
    "mpi-allreduce/job.json": Expected(logs=(": sum = 6", 3)),
    "pytorch-allreduce/job.json": Expected(logs=("all_reduce sum 6 ok", 3)),
    "gpu/job.json": Expected(
        code=2, said="can never run on the current nodes: no node has a GPU of type H100"
    ),
    "gpu-sharing/job.json": Expected(
        code=2, said="can never run on the current nodes: task half needs 0.5 of a GPU on one node"
    ),
    "arena-mpijob/job.json": Expected(
        code=2, said="can never run on the current nodes", dataset="user-susan"
    ),
    "data-sync/job.yaml": Expected(
        logs=("job.yaml", 3),  # the dataset (this folder), listed by each task
        dataset="mnist",
        offline="codeSync: cannot fetch https://github.com/pytorch/examples.git (branch main)",
    ),
}


def example_files() -> list[str]:
    return sorted(
        str(p.relative_to(EXAMPLES))
        for p in EXAMPLES.rglob("*")
        if p.is_file() and p.suffix in (".json", ".yaml", ".yml") and p.parent.name != "__pycache__"
    )


def test_every_example_has_an_expected_outcome():
    """A new example is run by the test below only once it says here what it does."""
    assert example_files() == sorted(EXPECTED)


def documented_command(name: str) -> str:
    """The `muster admin dataset set ...` line an example's comment gives."""
    found = re.findall(r"^\s*(?://|#)\s+(muster admin dataset set .+)$", (EXAMPLES / name).read_text(), re.M)
    assert len(found) == 1, f"{name}: its comment gives no (or several) `muster admin dataset set` command"
    return found[0]


@pytest.fixture(scope="session")
def torch_image(base_image: str) -> str:
    """muster/torch:bookworm (deploy/build-torch-image.sh); skips when it cannot be built here."""
    proc = subprocess.run(
        [str(ROOT / "deploy" / "build-torch-image.sh")], capture_output=True, text=True, timeout=900
    )
    if proc.returncode == 2:
        pytest.skip(f"cannot build {TORCH_IMAGE}: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, f"build-torch-image.sh failed:\n{proc.stderr}"
    return TORCH_IMAGE


@pytest.fixture
def up(tmp_path: Path) -> Iterator[dict[str, str]]:
    """`muster up --cpus 8` from the repository root, as the README's first command (Docker when
    an engine answers, the default; no GPU); the environment for the CLI beside it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MUSTER_") or k == "MUSTER_PORT_SLICE"}
    env |= {
        "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
        "XDG_STATE_HOME": str(tmp_path / "state"),  # its own note of the local identity
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
    }
    port = free_port()
    log = tmp_path / "up.log"
    # --overcommit: 8 CPUs on a smaller machine (the Docker runtime refuses more than it has).
    command = ["muster", "up", "--cpus", "8", "--overcommit", "--gpus", "0", "--port", str(port)]
    proc = subprocess.Popen(
        [*command, "--metrics-port", "0", "--data-dir", str(tmp_path / "data")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=open(log, "wb"),  # noqa: SIM115
    )
    try:
        yield env | {"MUSTER_NATS_URL": f"nats://127.0.0.1:{port}", "UP_LOG": str(log)}
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def muster(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["muster", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def github_answers() -> bool:
    probe = subprocess.run(
        ["git", "ls-remote", "--heads", "https://github.com/pytorch/examples.git", "main"],
        capture_output=True,
        env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
        timeout=60,
    )
    return probe.returncode == 0


@pytest.mark.docker
@pytest.mark.timeout(1200)  # the first run builds the images (debootstrap, apt-get, torch)
def test_every_example_runs_as_shipped_or_says_what_to_do(base_image, mpi_image, torch_image, up):  # noqa: F811
    env = up
    # Examples that mount a dataset are refused, naming the command that defines it; the one
    # their comment gives is run as written (from the repository root, as it says).
    for name, expected in EXPECTED.items():
        if expected.dataset is None:
            continue
        refused = muster(env, "submit", f"examples/{name}", "--connect-timeout", "60", timeout=120)
        hint = f"`muster admin dataset set {expected.dataset} --source DIR`"
        assert refused.returncode == 2 and hint in refused.stderr, (name, refused.stdout, refused.stderr)
        defined = subprocess.run(
            ["sh", "-c", documented_command(name)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert defined.returncode == 0, (name, defined.stdout, defined.stderr)
    online = github_answers()
    # Every example at once, as users would: the mesh queues what does not fit yet.
    started = time.monotonic()
    runs = {
        name: subprocess.Popen(
            ["muster", "submit", f"examples/{name}", "--wait", "--timeout", "600", "--connect-timeout", "60"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in EXPECTED
    }
    results = {name: run.communicate(timeout=700) for name, run in runs.items()}
    took = time.monotonic() - started
    up_log = Path(env["UP_LOG"]).read_text()
    assert '"event": "docker.started"' in up_log, up_log[-5000:]  # the tasks ran in containers
    up_log = up_log[-5000:]
    for name, expected in EXPECTED.items():
        (stdout, stderr), code = results[name], runs[name].returncode
        said = stdout + stderr
        if expected.offline is not None and not online:
            assert code == 1 and expected.offline in said, (name, said)
            continue
        assert code == expected.code and expected.said in said, (name, code, said, up_log)
        if expected.logs is not None:
            line, count = expected.logs
            job = stdout.split()[0]
            logs = muster(env, "logs", job).stdout
            assert logs.count(line) == count, (name, logs)
    print(f"{len(EXPECTED)} examples in {took:.0f}s")
