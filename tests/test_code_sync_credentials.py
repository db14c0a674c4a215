"""codeSync credentials (issue 24.3): the user info of an http(s) git URL reaches the git server,
but never a command line, which every local user can read (`ps`, /proc/PID/cmdline).

A real git smart-HTTP server (`git http-backend` behind http.server) that requires Basic
authentication: while it serves each request, the agent's git is waiting on it, so the server
records every process's command line at that moment."""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from muster.services.agent.prepare import CREDENTIAL_HELPER, _credentials, fetch_code
from muster.services.agent.runtime import LaunchError
from muster.shared.jobconfig import CodeSync
from muster.shared.messages import TaskCause
from tests.test_contract import git

TOKEN = "tok-Zq81xk3P0w7"  # what must never be on a command line


def command_lines() -> list[str]:
    """Every process's command line, as any local user can read it."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            with contextlib.suppress(OSError):  # ended meanwhile
                line = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                found.append(line.decode(errors="replace"))
    return found


class GitServer(ThreadingHTTPServer):
    """Serves the repositories under `root` over git's smart HTTP to `user`:`password` only."""

    def __init__(self, root: Path, user: str, password: str):
        super().__init__(("127.0.0.1", 0), GitHandler)
        self.root, self.user = root, user
        self.expected = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.seen: list[str] = []  # command lines while a request was being served
        self.authorized = 0

    @property
    def port(self) -> int:
        return int(self.server_address[1])


class GitHandler(BaseHTTPRequestHandler):
    server: GitServer

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.serve()

    def do_POST(self) -> None:
        self.serve()

    def serve(self) -> None:
        self.server.seen += command_lines()  # the client's git waits on this answer now
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.headers.get("Authorization") != self.server.expected:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.server.authorized += 1
        path, _, query = self.path.partition("?")
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_PROJECT_ROOT": str(self.server.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "PATH_INFO": urllib.parse.unquote(path),
            "QUERY_STRING": query,
            "REQUEST_METHOD": self.command,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "HTTP_CONTENT_ENCODING": self.headers.get("Content-Encoding", ""),
            "GIT_PROTOCOL": self.headers.get("Git-Protocol", ""),
            "REMOTE_USER": self.server.user,
            "REMOTE_ADDR": "127.0.0.1",
        }
        out = subprocess.run(
            ["git", "http-backend"], input=body, env=env, capture_output=True, check=True
        ).stdout
        sep = b"\r\n\r\n" if b"\r\n\r\n" in out else b"\n\n"
        head, _, payload = out.partition(sep)
        status, headers = 200, []
        for line in head.decode().splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A bare repository `team/code.git` (main: train.py) under a server root; (root, its commit)."""
    work = tmp_path / "work"
    work.mkdir()
    git("init", "-q", "-b", "main", ".", cwd=work)
    (work / "train.py").write_text("print('trained')\n")
    git("add", "train.py", cwd=work)
    git("commit", "-qm", "v1", cwd=work)
    root = tmp_path / "srv"
    (root / "team").mkdir(parents=True)
    git("clone", "-q", "--bare", str(work), str(root / "team" / "code.git"), cwd=tmp_path)
    yield root, git("rev-parse", "main", cwd=work)


@contextlib.contextmanager
def git_server(root: Path, user: str, password: str) -> Iterator[GitServer]:
    server = GitServer(root, user, password)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    "user, password, written",
    [
        ("bot", TOKEN, f"bot:{TOKEN}"),
        (TOKEN, "", TOKEN),  # a token as the user name (GitHub's form): an empty password
        ("bot", TOKEN + "/:@%", f"bot:{urllib.parse.quote(TOKEN + '/:@%', safe='')}"),  # percent-encoded
    ],
)
async def test_the_credentials_reach_the_server_and_no_command_line(
    served, tmp_path, user, password, written
):
    root, commit = served
    with git_server(root, user, password) as server:
        url = f"http://{written}@127.0.0.1:{server.port}/team/code.git"
        target = tmp_path / "code"
        assert await fetch_code(CodeSync(git=url, branch="main"), str(target), False, timeout=60) == commit
        assert (target / "train.py").read_text() == "print('trained')\n"
        assert server.authorized > 0
        # The snapshots were taken while the agent's git ran (it waited on the server then)...
        assert any("git" in line and "fetch" in line for line in server.seen), server.seen
        # ...and no command line held the credentials, nor the URL's user info.
        leaked = [line for line in server.seen if TOKEN in line or written in line]
        assert leaked == []
    # Nothing of them was written where the task (which sees the checkout) could read it.
    stored = "".join(p.read_text(errors="replace") for p in (target / ".git").rglob("*") if p.is_file())
    assert TOKEN not in stored


async def test_wrong_credentials_fail_as_a_configuration_error_naming_no_secret(served, tmp_path):
    root, _ = served
    with git_server(root, "bot", "the-right-one") as server:
        url = f"http://bot:{TOKEN}@127.0.0.1:{server.port}/team/code.git"
        with pytest.raises(LaunchError) as refused:
            await fetch_code(CodeSync(git=url, branch="main"), str(tmp_path / "code"), False, timeout=60)
        assert server.authorized == 0
    assert refused.value.cause == TaskCause.CONFIG
    assert str(refused.value).startswith(
        f"codeSync: cannot fetch http://***@127.0.0.1:{server.port}/team/code.git"
    )
    assert TOKEN not in str(refused.value)


async def test_credentials_go_only_to_the_urls_own_host(served, tmp_path):
    """The helper answers only for the URL's protocol and host: a server elsewhere (a redirect,
    a submodule) that asks gets nothing."""
    root, _ = served
    with git_server(root, "bot", TOKEN) as server:
        url = f"http://bot:{TOKEN}@localhost:{server.port}/team/code.git"
        env = {"MUSTER_GIT_PROTOCOL": "http", "MUSTER_GIT_HOST": f"localhost:{server.port}"}
        env |= {"MUSTER_GIT_USERNAME": "bot", "MUSTER_GIT_PASSWORD": TOKEN, "PATH": os.environ["PATH"]}

        def ask(host: str, action: str = "get") -> str:
            return subprocess.run(
                ["sh", "-c", CREDENTIAL_HELPER[1:] + f" {action}"],
                input=f"protocol=http\nhost={host}\n\n",
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout

        assert ask(f"localhost:{server.port}") == f"username=bot\npassword={TOKEN}\n"
        assert ask(f"127.0.0.1:{server.port}") == ask("evil.example.com") == ""
        assert ask(f"localhost:{server.port}", "store") == ask(f"localhost:{server.port}", "erase") == ""
        assert await fetch_code(CodeSync(git=url), str(tmp_path / "code"), False, timeout=60)


def test_user_info_that_no_environment_can_carry_is_refused_naming_the_field():
    with pytest.raises(
        LaunchError, match=r"codeSync.git http://\*\*\*@h/x: its user info holds a line break"
    ):
        _credentials("http://bot:a%0Ab@h/x")
    assert _credentials("ssh://git:pw@h/x") == ("ssh://git@h/x", {})  # ssh cannot use a password
