"""The `muster` command: up, submit, status, kill, drain, logs, metrics, validate, admin (init,
user, keys, vc, dataset). This module is its parser and dispatch; the commands live by concern
in jobs.py, admin.py and local.py (with mesh.py), reach the bus through connect.py and format
with render.py.

Exit codes: 0 success; 1 the job did not succeed (`submit --wait`) or an operational failure
(bus unreachable, Muster not set up on it); 2 the config was rejected, the job can never run
(`submit --wait`), or the command line is wrong (a bad argument, no such job or task);
141 the reader of the output went away (`muster status | head`).

Only services (and `muster admin init`) declare streams and buckets; every other command only
looks them up, so one user's environment can never reshape the cluster's settings.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import math
import os
import re
import sys
from typing import Any, NoReturn

import nats.errors

from muster.services.agent.args import add_agent_arguments
from muster.services.cli import admin, jobs, local
from muster.services.cli.console import EXIT_FAIL, EXIT_INVALID, CliError, err
from muster.services.cli.render import FINISHED, LIVE, STATES
from muster.shared import auth


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A bad argument: one line naming it (not the whole usage), exit 2."""
        self.exit(EXIT_INVALID, f"{self.prog}: {message} (see {self.prog} --help)\n")


class Version(argparse.Action):
    """`muster --version`: the installed distribution's version (`muster 0.2.0`), read from its
    metadata only when asked."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> NoReturn:
        try:
            version = importlib.metadata.version("muster")
        except importlib.metadata.PackageNotFoundError:
            parser.exit(EXIT_FAIL, "muster: not installed (no distribution metadata): pip install -e .\n")
        print(f"muster {version}")
        parser.exit(0)


def checked(kind: type, ok: Any, wanted: str) -> Any:
    """An argparse `type=`: `kind(text)`, refused with "`wanted`, got TEXT" unless `ok(value)`."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"{wanted}, got {text!r}")
        return value

    return parse


MAX_GRACE = (
    24 * 3600
)  # muster.shared.shapes.MAX_GRACE: a kill or drain order's longest grace (no model imported)
GRACE = checked(float, lambda v: 0 <= v <= MAX_GRACE, f"must be seconds from 0 to {MAX_GRACE}")
TIMEOUT = checked(float, lambda v: 0 < v < math.inf, "must be seconds > 0")
COUNT = checked(int, lambda v: v >= 1, "must be a whole number ≥ 1")
PORT = checked(int, lambda v: 1 <= v <= 65535, "must be a port, 1-65535")


NAME = checked(str, lambda v: bool(auth.NAME_RE.match(v)), "letters, digits, '_' and '-'")
AGO = {"m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def job_states(text: str) -> list[str]:
    """--state: states by name (any case), comma-separated; `live` and `finished` for their groups."""
    out: list[str] = []
    for word in (w.strip().upper() for w in text.split(",")):
        named = {"LIVE": LIVE, "FINISHED": FINISHED}.get(word, [word] if word in STATES else None)
        if not named:
            raise argparse.ArgumentTypeError(
                f"expected states from {', '.join(s.lower() for s in STATES)}, live, finished; got {text!r}"
            )
        out += [s for s in named if s not in out]
    return out


def since(text: str) -> str:
    """--since: a time ago (30m, 12h, 7d, 2w) or a date/time (local unless it names its zone),
    as an ISO time with its zone."""
    from datetime import UTC, datetime, timedelta

    m = re.fullmatch(r"(\d+(?:\.\d+)?)([mhdw])", text.strip())
    try:
        if m:
            at = datetime.now(UTC) - timedelta(seconds=float(m[1]) * AGO[m[2]])
        else:
            at = datetime.fromisoformat(text.strip())
            at = at if at.tzinfo else at.astimezone()
    except (ValueError, OverflowError):
        raise argparse.ArgumentTypeError(f"expected 30m, 12h, 7d, 2w or a date/time, got {text!r}") from None
    return at.isoformat()


def task_ref(text: str) -> str:
    """--task: ROLE or ROLE.INDEX (never a subject wildcard)."""
    m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9_-]*)(?:\.(\d+))?", text)
    if not m:
        raise argparse.ArgumentTypeError(f"expected ROLE or ROLE.INDEX (e.g. worker.0), got {text!r}")
    return m[1] if m[2] is None else f"{m[1]}.{int(m[2])}"


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="muster", description="Distributed training jobs on your GPU machines.")
    p.add_argument("--version", action=Version, help="print the installed version and exit")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("up", help="start an embedded NATS and every Muster service on this machine")
    s.add_argument("--data-dir", help="where NATS keeps JetStream data (default ~/.local/share/muster)")
    s.add_argument("--port", type=PORT, help="NATS port (default 4222, or a free one if taken)")
    s.add_argument("--no-agent", action="store_true", help="start no local agent")
    s.add_argument(
        "--open",
        action="store_true",
        help="no authentication on the embedded NATS: anyone who reaches its port may do anything",
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve /metrics and /healthz of every service, the local agent and the embedded NATS "
        "here (default $MUSTER_METRICS_PORT, else 9100 or a free one if taken; 0: off)",
    )
    s.add_argument(
        "--portal-port",
        type=int,
        default=None,
        help="serve the web portal on 127.0.0.1 here (default 8480, or a free one if taken; 0: off); "
        "it prints a link that signs you in",
    )
    add_agent_arguments(s)
    s.set_defaults(func=local.cmd_up)

    s = sub.add_parser("ui", help="serve the web portal for you on 127.0.0.1 (prints a sign-in link)")
    s.add_argument("--port", type=int, default=None, help="default 8480, or a free one if taken")
    s.set_defaults(func=lambda a: asyncio.run(local.cmd_ui(a)))

    s = sub.add_parser("submit", help="submit a job config (JSON, JSON with comments, or YAML)")
    s.add_argument("file", help="config file, or - for standard input")
    s.add_argument("--wait", action="store_true", help="follow the job to its final state")
    s.add_argument("--json", action="store_true", help="print the verdict (and final record) as JSON")
    s.add_argument(
        "--timeout",
        type=TIMEOUT,
        help="give up after S seconds in all: waiting for the verdict and, with --wait, for the job (exit 1)",
    )
    s.add_argument(
        "--verdict-timeout", type=TIMEOUT, default=30.0, help="seconds to wait for the validator's verdict"
    )
    s.set_defaults(func=lambda a: asyncio.run(jobs.submit(a)))

    s = sub.add_parser(
        "status",
        help="list jobs, newest first (by default the live ones and the newest finished), "
        "or show one job by id or name",
    )
    s.add_argument("job", nargs="?")
    s.add_argument("--json", action="store_true", help="a list: one line per page, as the gateway answers")
    s.add_argument("--events", action="store_true", help="with JOB: its history, event by event")
    s.add_argument(
        "--state",
        type=job_states,
        help="only jobs in these states, comma-separated (waiting, running, succeeded, failed, stopped; "
        "live, finished)",
    )
    s.add_argument("--all", action="store_true", help="every job still kept, whatever its state")
    s.add_argument("--user", type=NAME, help="only this user's jobs (an admin's view)")
    s.add_argument("--vc", type=NAME, help="only jobs of this virtual cluster")
    s.add_argument("--name", help="only jobs whose name holds this text (any case)")
    s.add_argument(
        "--since", type=since, help="only jobs submitted since: 30m, 12h, 7d, or a date/time (2024-05-01)"
    )
    s.add_argument("--limit", type=COUNT, help="at most this many jobs")
    s.set_defaults(func=lambda a: asyncio.run(jobs.status(a)))

    s = sub.add_parser(
        "vc", help="virtual clusters: quota, what each holds and borrows, jobs running and waiting"
    )
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=lambda a: asyncio.run(jobs.vc_status(a)))

    s = sub.add_parser("kill", help="stop a job: SIGTERM, SIGKILL after the grace; it is not retried")
    s.add_argument("job")
    s.add_argument("--grace", type=GRACE, default=10.0, help="seconds between SIGTERM and SIGKILL")
    s.add_argument("--no-wait", action="store_true", help="do not wait for the tasks to stop")
    s.set_defaults(func=lambda a: asyncio.run(jobs.kill(a)))

    s = sub.add_parser("drain", help="stop every task on a node (retried elsewhere) and keep new work off it")
    s.add_argument("node")
    s.add_argument("--grace", type=GRACE, default=10.0, help="seconds between SIGTERM and SIGKILL")
    s.add_argument("--undo", action="store_true", help="let the node take work again")
    s.set_defaults(func=lambda a: asyncio.run(admin.drain(a)))

    s = sub.add_parser("logs", help="print the output of a job's tasks (kept after they end)")
    s.add_argument("job")
    s.add_argument("--task", type=task_ref, help="one task, as ROLE.INDEX (or ROLE)")
    s.add_argument("--attempt", type=COUNT, help="which attempt (default: the current one)")
    s.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    s.set_defaults(func=lambda a: asyncio.run(jobs.show_logs(a)))

    s = sub.add_parser("metrics", help="print the training metrics a job's tasks printed (its `metrics`)")
    s.add_argument("job")
    s.add_argument("--task", type=task_ref, help="one task, as ROLE.INDEX (or ROLE)")
    s.add_argument("--attempt", type=COUNT, help="which attempt (default: the current one)")
    s.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    s.add_argument("--json", action="store_true", help="one JSON object per point")
    s.set_defaults(func=lambda a: asyncio.run(jobs.show_metrics(a)))

    s = sub.add_parser("validate", help="check a config locally (every rule but name uniqueness)")
    s.add_argument("file")
    s.set_defaults(func=jobs.cmd_validate)

    s = sub.add_parser("admin", help="set up a NATS for Muster; manage who may use it")
    admins = s.add_subparsers(dest="admin_command", metavar="{init,user,keys,vc,dataset}", required=True)
    s = admins.add_parser("init", help="declare or update every stream and bucket from this shell's settings")
    s.set_defaults(func=lambda a: asyncio.run(admin.admin_init(a)))
    s = admins.add_parser("user", help="add, rotate, remove or list identities (then the server reloads)")
    s.add_argument(
        "action",
        choices=("add", "rotate", "login", "remove", "list"),
        help="add (and issue a portal login secret), rotate (new keys and login secret), login (a new "
        "login secret only), remove, list",
    )
    s.add_argument("name", nargs="?")
    s.add_argument("--admin", action="store_true", help="add an admin (sees and kills every job)")
    s.add_argument("--auth-dir", help="default: MUSTER_AUTH_DIR, else the local `muster up`'s")
    s.set_defaults(func=admin.admin_user)
    s = admins.add_parser(
        "keys",
        help="make an auth dir for a deployment (compose, systemd): every service's "
        "identity, one per agent node, an admin; prints the server's auth.conf path",
    )
    s.add_argument("auth_dir")
    s.add_argument("--node", action="append", default=[], help="an agent node (repeat)")
    s.add_argument("--admin-name", default="admin")
    s.add_argument(
        "--sim",
        action="store_true",
        help=f"add {auth.SIM_IDENTITY}, the identity of simulated nodes (benchmarks only: it acts as "
        "any node)",
    )
    s.set_defaults(func=admin.admin_keys)
    s = admins.add_parser("vc", help="set, remove or list virtual clusters: who may submit to them, quotas")
    vc = s.add_subparsers(dest="action", metavar="{set,remove,list}", required=True)
    s = vc.add_parser(
        "set",
        help="write a virtual cluster's whole record (a flag left out takes its default); "
        "applies to the next submission",
    )
    s.add_argument("name", metavar="NAME")
    s.add_argument("--gpus", help="guaranteed GPUs per model, e.g. 4xV100,2xT4 (default: none)")
    s.add_argument("--cpus", type=int, help="guaranteed CPUs (default: not limited by the quota)")
    s.add_argument("--memory-mb", type=int, help="guaranteed memory (default: not limited by the quota)")
    s.add_argument("--users", default="*", help="who may submit to it: alice,bob or '*' (default: everyone)")
    s.add_argument(
        "--max-priority",
        choices=("low", "normal", "high"),
        default="high",
        help="the highest priority its jobs may ask for (default: high)",
    )
    s.add_argument(
        "--no-borrow", action="store_true", help="its jobs never run beyond its quota on idle capacity"
    )
    s = vc.add_parser("remove", help="remove a virtual cluster's record (its jobs go on)")
    s.add_argument("name", metavar="NAME")
    s = vc.add_parser("list", help="a table of the virtual clusters")
    s.add_argument("--json", action="store_true", help="the stored records as JSON")
    for s in vc.choices.values():
        s.set_defaults(func=lambda a: asyncio.run(admin.admin_vc(a)))
    s = admins.add_parser("dataset", help="set, remove or list the datasets jobs may mount (`data`)")
    ds = s.add_subparsers(dest="action", metavar="{set,remove,list}", required=True)
    s = ds.add_parser("set", help="write a dataset's whole record; applies to the next submission")
    s.add_argument("name", metavar="NAME")
    s.add_argument(
        "--source",
        required=True,
        help="a host directory (absolute; under each agent's data roots) or a Docker volume name",
    )
    s.add_argument("--writable", action="store_true", help="jobs may mount it writable (`:rw`)")
    s.add_argument("--users", default="*", help="who may mount it: alice,bob or '*' (default: everyone)")
    s.add_argument("--description", default="", help="a line shown by `muster admin dataset list`")
    s = ds.add_parser("remove", help="remove a dataset's record (running tasks keep their mounts)")
    s.add_argument("name", metavar="NAME")
    s = ds.add_parser("list", help="a table of the datasets")
    s.add_argument("--json", action="store_true", help="the stored records as JSON")
    for s in ds.choices.values():
        s.set_defaults(func=lambda a: asyncio.run(admin.admin_dataset(a)))

    for s in (
        *(sub.choices[n] for n in ("submit", "status", "vc", "logs", "metrics", "kill", "drain", "ui")),
        admins.choices["init"],
        *vc.choices.values(),
        *ds.choices.values(),
    ):
        s.add_argument(
            "--connect-timeout", type=TIMEOUT, default=2.0, help="seconds to keep trying to reach NATS"
        )
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    try:
        code = args.func(args)
    except CliError as exc:
        err(f"muster: {exc}")
        code = exc.code
    except BrokenPipeError:
        # The reader went away (`muster status | head -1`): stop quietly, as other tools do;
        # what is still buffered goes to /dev/null rather than fail again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 141
    except (nats.errors.Error, ConnectionError, TimeoutError) as exc:  # the bus went away mid-command
        err(f"muster: {str(exc) or type(exc).__name__}")
        code = EXIT_FAIL
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
