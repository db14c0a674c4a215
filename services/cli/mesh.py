"""`muster up`: the embedded mesh — a nats-server with JetStream (unless joining one) and every
service built so far, each supervised in this process: a service that fails is logged and
restarted with backoff, so nothing dies silently. Ctrl-C stops everything it started.

The embedded server requires authentication (shared/auth.py): `muster up` keeps an auth
directory in its data dir with an identity per service, one for the local agent, and an admin
identity named after this machine's user. Its data dir is never one git would add (a
`.gitignore` of `*` in it, and in the auth dir).

Where it is: from its first moment, `muster up` leaves a note (JSON: its URL, state `starting`
then `ready` once the gateway answers, its pid, the directory it runs in, its data dir, the admin
credentials file) in the user's runtime dir (`$XDG_RUNTIME_DIR/muster/`, else
`$XDG_STATE_HOME/muster/up/`, one file per `muster up`) and in its data dir (`up.json`), and
removes both when it stops. The CLI (`find_mesh`) goes, when MUSTER_NATS_URL is unset, to the
mesh on the data dir MUSTER_DATA_DIR names; else to the mesh started in the directory it runs in
or the nearest one above it; else to a `muster up`
starting there, once it has noted; else to the only mesh running; with several elsewhere it
names them and asks. So a second mesh of the same user never gets the first one's commands."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
import os
import signal
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from nats.aio.client import Client as NATS

from muster.shared import auth, bus, settings
from muster.shared.natsserver import NatsServer, free_port
from muster.shared.service import Service, run_service, serve_health

if TYPE_CHECKING:
    from aiohttp import web

log = structlog.get_logger(service="mesh")

Builder = Callable[[NATS], Awaitable[Service]]


PORT_TRIES = 3  # starts of the embedded nats-server when a port it was given is taken meanwhile


def _port_taken(log_file: Path) -> bool:
    """Whether nats-server's log says it could not bind a port (its last lines)."""
    try:
        return "address already in use" in log_file.read_text(errors="replace")[-2000:]
    except OSError:
        return False


def builders() -> dict[str, Builder]:
    """Every service of the mesh (auth.SERVICES), imported only here: the CLI reads this module's
    notes (`local_identity`) on every command, and must not pay for the services' imports."""
    from muster.services.gateway.service import Gateway
    from muster.services.registry.service import Registry
    from muster.services.scheduler.service import Scheduler
    from muster.services.supervisor.service import Supervisor
    from muster.services.validator.service import Validator

    return {
        "validator": Validator.build,
        "scheduler": Scheduler.build,
        "registry": Registry.build,
        "supervisor": Supervisor.build,
        "gateway": Gateway.build,
    }


START_WAIT = 60.0  # seconds the CLI waits for a `muster up` that is starting
NOTE = "up.json"  # the note in the data dir


def _state_dir(env: Mapping[str, str] = os.environ) -> Path:
    home = env.get("HOME") or os.path.expanduser("~")
    return Path(env.get("XDG_STATE_HOME") or os.path.join(home, ".local", "state")) / "muster" / "up"


def notes_dir(env: Mapping[str, str] = os.environ) -> Path:
    """Where `muster up` notes where it is, for the CLI of the same user: the user's runtime dir,
    else the state dir (one note per `muster up`, named by its pid)."""
    runtime = env.get("XDG_RUNTIME_DIR")
    return Path(runtime) / "muster" if runtime else _state_dir(env)


def _alive(pid: object) -> bool:
    """Whether `pid` is a running `muster up` (a SIGKILLed one's pid may have been reused)."""
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        return _is_up(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"))
    except FileNotFoundError:
        return not Path("/proc/self").exists()  # no /proc here: the pid is all there is to go by
    except OSError:
        return True


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def running() -> list[dict[str, Any]]:
    """The notes of this user's `muster up`s that still run (a note whose process is gone, as
    after a SIGKILL, is removed)."""
    found = []
    try:
        paths = sorted(notes_dir().glob("up-*.json"))
    except OSError:
        return []
    for path in paths:
        doc = _read(path)
        if _alive(doc.get("up_pid")) and isinstance(doc.get("url"), str):
            found.append(doc)
        elif doc:
            with contextlib.suppress(OSError):
                path.unlink()
    return found


def _same_url(a: str, b: str) -> bool:
    def key(url: str) -> tuple[str, int]:
        u = urllib.parse.urlsplit(url.split(",")[0].strip())
        return (u.hostname or "127.0.0.1", u.port or 4222)

    return key(a) == key(b)


def local_note(url: str | None = None) -> dict[str, Any]:
    """What the `muster up` serving `url` (default MUSTER_NATS_URL) noted: its admin credentials,
    auth dir, server pid, state; {} when no running `muster up` of this user serves it."""
    url = url or bus.nats_url()
    notes = [n for n in running() if _same_url(n["url"], url)]
    notes.sort(key=lambda n: n.get("credentials") is None)  # an embedded server's note first
    return notes[0] if notes else {}


def local_identity(url: str | None = None) -> auth.Credentials | None:
    """The local admin identity of the `muster up` serving `url` (default MUSTER_NATS_URL)."""
    path = local_note(url).get("credentials")
    if not isinstance(path, str):
        return None
    try:
        return auth.load_credentials(path)
    except (OSError, ValueError, auth.AuthError):
        return None


def _contains(parent: object, child: str) -> bool:
    if not isinstance(parent, str) or not parent:
        return False
    return child == parent or child.startswith(parent.rstrip("/") + "/")


def _is_up(argv: list[bytes]) -> bool:
    """Whether a command line is `muster up ...` (the console script, or
    python -m muster.services.cli.main)."""
    for i, arg in enumerate(argv[:4]):  # python [-u] [-m muster.services.cli.main | muster] up
        if arg == b"muster.services.cli.main" or os.path.basename(arg) == b"muster":
            return argv[i + 1 : i + 2] == [b"up"]
    return False


def starting(noted: set[int]) -> list[tuple[int, str]]:
    """This user's `muster up` processes that note where this CLI reads (notes_dir of their
    environment) and have noted nothing yet (not in `noted`), with the directory each runs in: a
    mesh that is starting (read from /proc; [] where there is none)."""
    mine, found = notes_dir(), []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []
    for pid in pids:
        if pid in noted or pid == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != os.getuid():
                continue
            if not _is_up(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")):
                continue
            env = dict(
                item.decode(errors="replace").split("=", 1)
                for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                if b"=" in item
            )
            if notes_dir(env) == mine:
                found.append((pid, os.readlink(f"/proc/{pid}/cwd")))
        except OSError:
            continue  # ended meanwhile, or not ours to read
    return found


class MeshError(Exception):
    """No one mesh to go to: several run and none was started here or above."""


@dataclass
class Found:
    """The mesh a command goes to: its note (None: MUSTER_NATS_URL or the default URL, unless
    `waiting`), or a `muster up` starting that has not said where yet (`waiting`: pid, dir)."""

    note: dict[str, Any] | None = None
    waiting: tuple[int, str] | None = None
    others: list[dict[str, Any]] = field(default_factory=list)

    @property
    def url(self) -> str | None:
        if self.note is not None:
            return str(self.note["url"])
        return None if self.waiting else bus.nats_url()

    @property
    def starting(self) -> str | None:
        """What is starting (for messages), while the mesh has not said it is ready."""
        if self.waiting is not None:
            return f"the `muster up` starting in {self.waiting[1]} (pid {self.waiting[0]})"
        if self.note is not None and self.note.get("state") != "ready":
            return f"the `muster up` starting in {self.note.get('cwd')} (pid {self.note.get('up_pid')})"
        return None

    def credentials(self) -> auth.Credentials | None:
        path = (self.note or {}).get("credentials")
        if not isinstance(path, str) or os.environ.get(auth.CREDENTIALS_ENV):
            return None  # bus.connect reads MUSTER_CREDENTIALS
        try:
            return auth.load_credentials(path)
        except (OSError, ValueError, auth.AuthError):
            return None


def describe(note: dict[str, Any]) -> str:
    return f"{bus.shown(str(note.get('url')))} (started in {note.get('cwd')}, pid {note.get('up_pid')})"


def find_mesh(cwd: str | None = None) -> Found:
    """Where a command run in `cwd` (default: here) goes. MUSTER_NATS_URL set: there (with the
    note of a local `muster up` serving it, for its identity). Else: the mesh running on the data
    dir MUSTER_DATA_DIR names (its note there); the mesh started in `cwd` or the nearest
    directory above it; else a `muster up` starting there (wait for its note);
    else the only mesh running; else none noted (the default URL). Raises MeshError when several
    run elsewhere."""
    if os.environ.get("MUSTER_NATS_URL"):
        return Found(local_note() or None)
    if os.environ.get("MUSTER_DATA_DIR"):  # the mesh of that data dir, if one runs on it
        noted = _read(Path(os.environ["MUSTER_DATA_DIR"]) / NOTE)
        if _alive(noted.get("up_pid")) and isinstance(noted.get("url"), str):
            return Found(noted)
    cwd = cwd or os.getcwd()
    notes = running()
    here = [n for n in notes if _contains(n.get("cwd"), cwd)]
    if here:
        return Found(max(here, key=lambda n: len(str(n.get("cwd")))), others=notes)
    soon = [(pid, d) for pid, d in starting({n["up_pid"] for n in notes}) if _contains(d, cwd)]
    if soon:
        return Found(waiting=max(soon, key=lambda s: len(s[1])), others=notes)
    if len(notes) == 1:
        return Found(notes[0], others=notes)
    if notes:
        listed = "; ".join(describe(n) for n in notes)
        raise MeshError(
            f"{len(notes)} meshes (`muster up`) run on this machine, none started in {cwd} or above it: "
            f"{listed}; run the command in the directory of the one you mean, or set MUSTER_NATS_URL"
        )
    return Found()


class Notes:
    """A `muster up`'s notes (in notes_dir and its data dir), written whole each time (to a
    temporary file, then renamed: a reader never sees half a note), removed when it stops."""

    def __init__(self, data_dir: Path, doc: dict[str, Any]):
        self.doc = {"up_pid": os.getpid(), "cwd": os.getcwd(), "data_dir": str(data_dir.absolute()), **doc}
        self.paths = [notes_dir() / f"up-{os.getpid()}.json", data_dir / NOTE]

    def write(self, **changes: Any) -> None:
        self.doc.update(changes)
        text = json.dumps(self.doc)
        for path in self.paths:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)

    def remove(self) -> None:
        """Removes the notes that are still this process's (a later `muster up` on the same data
        dir may have written its own)."""
        for path in self.paths:
            if _read(path).get("up_pid") == os.getpid():
                with contextlib.suppress(OSError):
                    path.unlink()


def ignored_by_git(directory: Path) -> None:
    """A `.gitignore` of `*` in `directory` (as a virtualenv has), unless it has one: what is in
    it (credential seeds, JetStream data) is never in a folder git would add."""
    directory.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(directory / ".gitignore", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as f:
            f.write("# by `muster up`: nothing here belongs in git (credential seeds, JetStream data)\n*\n")


def local_user() -> str:
    try:
        name = getpass.getuser()
    except Exception:
        name = "admin"
    return name if auth.NAME_RE.match(name) and name not in auth.SERVICES else "admin"


def default_data_dir() -> Path:
    base = os.environ.get("MUSTER_DATA_DIR") or os.path.join(
        os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share"), "muster"
    )
    return Path(base)


async def supervise(
    name: str, build: Builder, url: str, stop: asyncio.Event, credentials: auth.Credentials | None = None
) -> None:
    delay = 0.5
    while not stop.is_set():
        try:
            await run_service(name, build, url=url, stop=stop, credentials=credentials)
            delay = 0.5
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.error("service.crashed", name=name, error=str(exc) or type(exc).__name__, exc_info=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, 10.0)


async def up(
    data_dir: Path,
    port: int | None,
    announce: Callable[[str], None],
    agent: Callable[[int | None], Builder] | None = None,
    node: str | None = None,
    open_bus: bool = False,
    sim: bool = False,
    metrics_port: int | None = None,
    portal_port: int | None = None,
) -> int:
    """Run the mesh until SIGTERM/SIGINT. `node`: the local agent's node name (its identity);
    `sim`: the agent is a process of simulated nodes, as the one sim identity (it can act as any
    node: a benchmark's, see shared/auth.py); `open_bus`: an embedded server without
    authentication (anyone who reaches it may do anything). `metrics_port`: /metrics and /healthz
    of everything in this process, and of the embedded server (read from its monitoring port);
    None: MUSTER_METRICS_PORT, else 9100 or a free port; 0: off. `portal_port`: the web portal
    on 127.0.0.1 (None: MUSTER_PORTAL_PORT, else 8480 or a free port; 0: off), where this
    machine's person signs in with the link announced, and users added with a login secret."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    server = None
    creds: dict[str, auth.Credentials | None] = {}
    ignored_by_git(data_dir)  # before anything is written in it
    url = os.environ.get("MUSTER_NATS_URL")
    if url:
        announce(f"joining NATS at {bus.shown(url)}")
        auth_dir = os.environ.get("MUSTER_AUTH_DIR")
        notes = Notes(data_dir, {"url": url, "state": "starting", "credentials": None, "auth_dir": auth_dir})
        notes.write()
        if auth_dir:  # an auth dir made for that bus: each service as itself
            keys = auth.AuthDir(auth_dir)
            creds = {n: auth.load_credentials(keys.creds(n)) for n in auth.SERVICES}
            if node is not None:
                name = auth.SIM_IDENTITY if sim else auth.agent_name(node)
                creds["agent"] = auth.load_credentials(keys.creds(name))
    else:
        keys = auth.AuthDir(data_dir / "auth")
        ignored_by_git(keys.path)  # the credential seeds, wherever the data dir is
        admin = None
        if not open_bus:
            creds = dict(keys.ensure_services())
            if sim:
                creds["agent"] = keys.ensure(auth.SIM_IDENTITY, "sim")
            elif node is not None:
                creds["agent"] = keys.ensure(auth.agent_name(node), "agent", node)
            admin = keys.ensure(local_user(), "admin")
        cert, key = os.environ.get("MUSTER_TLS_SERVER_CERT"), os.environ.get("MUSTER_TLS_SERVER_KEY")
        for tries_left in reversed(range(PORT_TRIES)):
            server = NatsServer(
                data_dir / "nats",
                port=port or free_port(4222),
                auth_config=None if open_bus else keys.server_config,
                tls={"cert_file": cert, "key_file": key} if cert and key else None,
                monitor_port=free_port(8222),
            )
            url = server.url
            # Noted before the server starts: the CLI beside us waits for this mesh from now on.
            notes = Notes(
                data_dir,
                {
                    "url": url,
                    "state": "starting",
                    "credentials": str(keys.creds(admin.name)) if admin else None,
                    "auth_dir": None if open_bus else str(keys.path),
                },
            )
            notes.write()
            try:
                server.start()  # from the main thread: the server dies with us (see NatsServer)
                break
            except BaseException as exc:
                notes.remove()
                # A port found free was taken before the server bound it (another `muster up`
                # starting beside this one): free ones are looked for again.
                if tries_left and isinstance(exc, RuntimeError) and _port_taken(server.log_file):
                    continue
                raise
        assert server is not None and server.proc is not None and url is not None
        notes.write(pid=server.proc.pid)  # `muster admin user` signals it to reload
        announce(f"NATS: {url} (JetStream data in {server.data_dir})")
        if port is None and server.port != 4222:
            announce(f"4222 was busy; `muster` commands run in {os.getcwd()} (or below) find it")
        if admin is not None:
            announce(
                f"NATS requires credentials: the CLI on this machine acts as admin {admin.name!r} "
                f"({keys.creds(admin.name)}); add a user with `muster admin user add NAME` and "
                "give them the file it writes (MUSTER_CREDENTIALS=FILE)"
            )
        creds["muster-up"] = admin
    if metrics_port is None:
        metrics_port = settings.number("MUSTER_METRICS_PORT", -1, int, low=0, high=65535)  # unset: -1
        if metrics_port < 0:
            metrics_port = free_port(9100, "0.0.0.0")
    health, poll, nc, portal = None, None, None, None
    auth_dir_of_mesh = notes.doc.get("auth_dir")
    try:
        # Fail fast on a bad URL or an unusable JetStream, before starting the services.
        nc = await bus.connect("muster-up", url, connect_timeout=15, credentials=creds.get("muster-up"))
        await bus.ensure_jetstream(nc)
        if metrics_port:  # the connection stays open: /healthz says whether it is up
            health = await serve_health("muster-up", nc, metrics_port)
            announce(f"metrics: http://127.0.0.1:{metrics_port}/metrics")
            if server is not None and server.monitor_port:
                poll = _nats_metrics(server, stop)
        services = builders()
        if agent is not None:
            services["agent"] = agent(metrics_port or None)  # its node record tells the port
        tasks = [asyncio.create_task(supervise(n, b, url, stop, creds.get(n))) for n, b in services.items()]
        announce(f"services: {', '.join(services)} — Ctrl-C to stop")
        portal = await _portal(url, creds.get("muster-up"), auth_dir_of_mesh, portal_port, announce, open_bus)
        watch = asyncio.create_task(_watch_server(server, stop))
        ready = asyncio.create_task(_ready(nc, notes, stop, keep=bool(metrics_port)))
        await stop.wait()
        ready.cancel()
        announce("stopping")
        _, pending = await asyncio.wait(tasks, timeout=10)
        for t in pending:
            t.cancel()
        watch.cancel()
        if poll is not None:
            poll.cancel()
        if server and server.proc and server.proc.returncode not in (None, 0):
            return 1
        return 0
    finally:
        if portal is not None:
            with contextlib.suppress(Exception):
                await portal.cleanup()
        if health is not None:
            health.close()
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 5)
        notes.remove()
        if server:
            await asyncio.to_thread(server.stop)


async def _portal(
    url: str,
    local: auth.Credentials | None,
    auth_dir: str | None,
    port: int | None,
    announce: Callable[[str], None],
    open_bus: bool,
) -> web.AppRunner | None:
    """The web portal of `muster up` (services/portal/), or None when off or its port is taken."""
    from muster.services.portal.app import serve
    from muster.services.portal.service import DEFAULT_PORT, local_portal
    from muster.shared.logins import Logins

    if port is None:
        port = settings.number("MUSTER_PORTAL_PORT", -1, int, low=0, high=65535)
        port = free_port(DEFAULT_PORT) if port < 0 else port
    if port == 0 or (local is None and not open_bus):
        return None
    portal, token = local_portal(url, local, Logins(auth_dir) if auth_dir else None)
    try:
        runner = await serve(portal, "127.0.0.1", port)
    except OSError as exc:
        announce(f"no web portal: 127.0.0.1:{port}: {exc.strerror or exc}")
        return None
    announce(
        f"web portal: http://127.0.0.1:{port}/jobs?token={token} "
        "(signs you in once; `muster ui` prints another link)"
    )
    return runner


async def _ready(nc: NATS, notes: Notes, stop: asyncio.Event, keep: bool) -> None:
    """Notes the mesh `ready` once the gateway answers it (the CLI beside it waits until then);
    the connection is closed after unless `keep` (it serves /healthz)."""
    from muster.shared import client

    try:
        while not stop.is_set():
            try:
                await client.ask(nc, "ping", timeout=2.0)
                break
            except client.Refused:
                break  # it answers, though not to us (a bus joined without an admin identity)
            except TimeoutError:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)
        if not stop.is_set():
            await asyncio.to_thread(notes.write, state="ready")
            log.info("mesh.ready", url=bus.shown(str(notes.doc["url"])))
    finally:
        if not keep:
            await nc.close()


def _nats_metrics(server: NatsServer, stop: asyncio.Event) -> asyncio.Task[None]:
    """The embedded server's metrics (shared/natsmetrics.py) on this process's /metrics."""
    import prometheus_client

    from muster.shared.natsmetrics import NatsCollector

    collector = NatsCollector([f"http://{server.host}:{server.monitor_port}"])
    prometheus_client.REGISTRY.register(collector)  # type: ignore[arg-type]

    async def poll() -> None:
        try:
            await collector.poll(stop)
        finally:
            prometheus_client.REGISTRY.unregister(collector)  # type: ignore[arg-type]

    return asyncio.create_task(poll())


async def _watch_server(server: NatsServer | None, stop: asyncio.Event) -> None:
    """If the embedded nats-server dies, everything stops with an error instead of hanging."""
    if server is None or server.proc is None:
        return
    await asyncio.to_thread(server.proc.wait)
    log.error("nats_server.exited", code=server.proc.returncode, log=str(server.log_file))
    stop.set()
