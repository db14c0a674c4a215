"""The admin commands: `muster admin init|user|keys|vc|dataset`, and `muster drain` (a node's
work stopped and kept off it)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError, NotFoundError

from muster.services.cli.connect import connect, connect_bus, locate
from muster.services.cli.console import EXIT_INVALID, EXIT_OK, CliError, err, out
from muster.services.cli.render import (
    columns,
    dataset_row,
    stream_rows,
    undecodable_row,
    vc_quota_text,
    vc_row,
)
from muster.shared import auth, bus, client, subjects

# The models (pydantic), the mesh (mesh.py: the services) and the agent's modules are imported
# where a command needs them, not here: most commands need few of them, and importing them is
# most of a start-up otherwise (docs/BENCHMARKS.md; tests/test_cli.py checks `submit`).
if TYPE_CHECKING:
    from nats.js.kv import KeyValue

    from muster.shared.messages import VirtualCluster

# ---------------------------------------------------------------- admin init, user, keys


async def admin_init(args: argparse.Namespace) -> int:
    """Declare or update every stream and bucket from this shell's settings (MUSTER_JS_REPLICAS,
    MUSTER_LOGS_MAX_BYTES): the one client path that shapes them; services do it at start."""
    nc, _ = await connect_bus(args.connect_timeout)
    try:
        js, _ = await bus.ensure_jetstream(nc)
        out(columns(stream_rows(info.config for info in await js.streams_info())))
        return EXIT_OK
    finally:
        await nc.close()


def auth_dir_of(args: argparse.Namespace) -> auth.AuthDir:
    """--auth-dir, MUSTER_AUTH_DIR, the auth dir of the mesh this command goes to, or the default
    data dir's."""
    from muster.services.cli.mesh import default_data_dir

    path = args.auth_dir or os.environ.get("MUSTER_AUTH_DIR") or (locate().note or {}).get("auth_dir")
    return auth.AuthDir(path or default_data_dir() / "auth")


def admin_user(args: argparse.Namespace) -> int:
    """Identities in an auth dir; the server of the local `muster up` using it reloads."""
    keys = auth_dir_of(args)
    if args.action == "list":
        rows = [("NAME", "ROLE", "NODE", "PUBLIC KEY")]
        rows += [(i.name, i.role, i.node or "-", i.nkey) for i in keys.identities()]
        out(columns(rows))
        return EXIT_OK
    if not args.name:
        raise CliError(f"admin user {args.action}: name the identity", EXIT_INVALID)
    from muster.shared.logins import Logins

    logins = Logins(keys.path)
    try:
        if args.action == "remove":
            keys.remove(args.name)
            logins.remove(args.name)
            done = f"removed {args.name}"
        elif args.action == "login":
            known = keys.get(args.name)
            if known is None:
                raise auth.AuthError(f"no identity {args.name!r}")
            secret = logins.issue(auth.load_credentials(keys.creds(args.name)))
            out(
                f"{args.name}: web portal login secret (shown once; the one before no longer works): {secret}"
            )
            return EXIT_OK
        else:
            known = keys.get(args.name)
            if args.action == "rotate":
                if known is None:
                    raise auth.AuthError(f"no identity {args.name!r}")
                creds = keys.add(args.name, known.role, known.node, replace=True)
            else:
                creds = keys.add(args.name, "admin" if args.admin else "user")
            path = keys.creds(args.name)
            done = f"{args.name} ({creds.role}): credentials in {path} (use with MUSTER_CREDENTIALS={path})"
            if creds.role in ("user", "admin"):
                secret = logins.issue(creds)
                done += f"\n{args.name}: web portal login secret (shown once): {secret}"
    except auth.AuthError as exc:
        raise CliError(str(exc), EXIT_INVALID) from None
    out(done)
    from muster.services.cli.mesh import running

    here = keys.path.resolve()
    # The local `muster up` whose server uses this auth dir, if any.
    note = next((n for n in running() if n.get("auth_dir") and Path(n["auth_dir"]).resolve() == here), {})
    if note.get("pid"):
        try:
            os.kill(int(note["pid"]), signal.SIGHUP)
            out("the local NATS server reloaded its identities")
        except OSError as exc:
            err(f"could not signal the local NATS server ({exc.strerror}); reload it to apply")
    else:
        out(f"reload every NATS server using {keys.server_config} (nats-server --signal reload) to apply")
    return EXIT_OK


def admin_keys(args: argparse.Namespace) -> int:
    keys = auth.AuthDir(args.auth_dir)
    try:
        keys.ensure_services()
        for node in args.node:
            keys.ensure(auth.agent_name(node), "agent", node)
        if args.sim:
            keys.ensure(auth.SIM_IDENTITY, "sim")
        keys.ensure(args.admin_name, "admin")
        from muster.shared.logins import Logins

        Logins(keys.path).portal_key(create=True)  # the portal replicas' session key
    except auth.AuthError as exc:
        raise CliError(str(exc), EXIT_INVALID) from None
    out(str(keys.server_config))
    return EXIT_OK


# ---------------------------------------------------------------- admin vc


VC_FLAGS = {  # a VirtualCluster field -> the flag that sets it
    "name": "NAME",
    "quota.gpus": "--gpus",
    "quota.cpus": "--cpus",
    "quota.memory_mb": "--memory-mb",
    "users": "--users",
    "max_priority": "--max-priority",
    "borrow": "--no-borrow",
}


def vc_record(args: argparse.Namespace) -> VirtualCluster:
    """The record `muster admin vc set` writes (the whole record: a flag left out takes its
    default); a bad value is a CliError(2) naming its flag."""
    from pydantic import ValidationError

    from muster.services.agent.inventory import parse_gpus
    from muster.shared.jobconfig import _reason, format_path
    from muster.shared.messages import VirtualCluster

    gpus: dict[str, int] = {}
    if args.gpus is not None:
        try:
            devices = parse_gpus(args.gpus)
        except ValueError as exc:
            raise CliError(f"--gpus {args.gpus!r}: {exc}", EXIT_INVALID) from None
        for d in devices:
            gpus[d.model] = gpus.get(d.model, 0) + 1
    users = user_list(args.users)
    quota = {"gpus": gpus, "cpus": args.cpus, "memory_mb": args.memory_mb}
    try:
        return VirtualCluster.model_validate(
            {
                "name": args.name,
                "quota": quota,
                "users": users,
                "max_priority": args.max_priority,
                "borrow": not args.no_borrow,
            }
        )
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = tuple(first["loc"])
        field = format_path(loc[:2] if loc[0] == "quota" else loc[:1])
        raise CliError(f"{VC_FLAGS.get(field, field)}: {_reason(first)}", EXIT_INVALID) from None


async def named_records(kv: Any, model: Any) -> tuple[list[str], dict[str, Any]]:
    """The keys of an admin bucket of named records (virtual clusters, datasets) and each one's
    record, None where it does not decode or names another key; keys removed meanwhile are left out."""
    from muster.shared.store import keys as bucket_keys  # only here: it brings the metrics library

    keys = await bucket_keys(kv)
    found: dict[str, Any] = {}
    for key in keys:
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            continue  # removed in between
        try:
            record = model.model_validate_json(entry.value or b"")
        except ValueError:  # pydantic's ValidationError is one
            record = None
        found[key] = record if record is not None and getattr(record, "name", None) == key else None
    return list(found), found


async def vc_bucket(nc: NATS) -> KeyValue:
    """The VCs bucket, as an admin (the server lets no one else write it)."""
    if client.asker(nc) != subjects.ALL:
        raise CliError("managing virtual clusters takes an admin identity")
    try:
        return await nc.jetstream(timeout=10).key_value(subjects.VCS_BUCKET)
    except NotFoundError:
        raise CliError(
            f"bucket {subjects.VCS_BUCKET} is missing on this NATS: run `muster admin init`"
        ) from None


async def admin_vc(args: argparse.Namespace) -> int:
    """`muster admin vc set|remove|list`: the virtual clusters in bucket muster_vcs. The
    validators watch it: a change applies to the next submission, no restart."""
    from muster.shared.messages import VirtualCluster

    if args.action != "list" and not auth.NAME_RE.match(args.name):  # the same as a VC name's
        raise CliError(
            f"NAME {args.name!r}: a virtual cluster's name starts with a letter or digit and has "
            "only letters, digits, '_' and '-' (64 at most)",
            EXIT_INVALID,
        )
    record = vc_record(args) if args.action == "set" else None  # refused before connecting
    nc = await connect(args.connect_timeout)
    try:
        kv = await vc_bucket(nc)
        if record is not None:
            await kv.put(record.name, record.to_bytes())
            out(
                f"{record.name}: set — quota {vc_quota_text(record)}; users {','.join(record.users)}; "
                f"max priority {record.max_priority}; {'may' if record.borrow else 'may not'} borrow"
            )
            return EXIT_OK
        if args.action == "remove":
            try:
                await kv.get(args.name)
            except KeyNotFoundError:
                raise CliError(f"no virtual cluster {args.name!r}", EXIT_INVALID) from None
            await kv.purge(args.name)
            after = "open to everyone again" if args.name == "default" else "new jobs naming it are refused"
            out(f"{args.name}: removed (its jobs go on; {after})")
            return EXIT_OK
        keys, found = await named_records(kv, VirtualCluster)
        keys.sort(key=lambda k: (k != "default", k))
        records = [found[k] for k in keys if found.get(k)]
        rows: list[tuple[str, ...]] = [("NAME", "QUOTA", "USERS", "MAX PRIORITY", "BORROW")]
        for key in keys:
            vc = found.get(key)
            rows.append(vc_row(vc) if vc else undecodable_row(key))
        if args.json:
            out(json.dumps([vc.model_dump(mode="json") for vc in records], indent=2))
            return EXIT_OK
        if "default" not in keys:
            rows.insert(1, ("default", "what the others leave", "*", "high", "yes"))
        out(columns(rows))
        return EXIT_OK
    finally:
        await nc.close()


# ---------------------------------------------------------------- admin dataset


def user_list(text: str) -> list[str]:
    users = [u.strip() for u in text.split(",") if u.strip()]
    if not users:
        raise CliError(f"--users {text!r}: name at least one user, or '*' for everyone", EXIT_INVALID)
    for u in users:
        if u != "*" and not auth.NAME_RE.match(u):
            raise CliError(
                f"--users {text!r}: {u!r} is not a user name (letters, digits, '_', '-'; "
                "or '*' for everyone)",
                EXIT_INVALID,
            )
    return users


async def admin_dataset(args: argparse.Namespace) -> int:
    """`muster admin dataset set|remove|list`: the datasets jobs may mount (`data`), in bucket
    muster_datasets. Validators watch it; agents read a job's datasets when they start its tasks."""
    from pydantic import ValidationError

    from muster.shared.jobconfig import _reason
    from muster.shared.messages import Dataset

    if args.action != "list" and not auth.NAME_RE.match(args.name):
        raise CliError(
            f"NAME {args.name!r}: a dataset's name starts with a letter or digit and has only "
            "letters, digits, '_' and '-' (64 at most)",
            EXIT_INVALID,
        )
    record = None
    if args.action == "set":
        try:
            record = Dataset.model_validate(
                {
                    "name": args.name,
                    "source": args.source,
                    "writable": args.writable,
                    "users": user_list(args.users),
                    "description": args.description,
                }
            )
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            field = str(first["loc"][0]) if first["loc"] else ""
            raise CliError(f"--{field}: {_reason(first)}", EXIT_INVALID) from None
    nc = await connect(args.connect_timeout)
    try:
        if client.asker(nc) != subjects.ALL:
            raise CliError("managing datasets takes an admin identity")
        try:
            kv = await nc.jetstream(timeout=10).key_value(subjects.DATASETS_BUCKET)
        except NotFoundError:
            raise CliError(
                f"bucket {subjects.DATASETS_BUCKET} is missing on this NATS: run `muster admin init`"
            ) from None
        if record is not None:
            await kv.put(record.name, record.to_bytes())
            kind = "Docker volume" if record.volume else "host directory"
            out(
                f"{record.name}: set — {kind} {record.source}; "
                f"{'writable with :rw' if record.writable else 'read-only'}; users {','.join(record.users)}"
            )
            return EXIT_OK
        if args.action == "remove":
            try:
                await kv.get(args.name)
            except KeyNotFoundError:
                raise CliError(f"no dataset {args.name!r}", EXIT_INVALID) from None
            await kv.purge(args.name)
            out(f"{args.name}: removed (running tasks keep their mounts; new jobs naming it are refused)")
            return EXIT_OK
        keys, found = await named_records(kv, Dataset)
        keys.sort()
        records = [found[k] for k in keys if found.get(k)]
        rows: list[tuple[str, ...]] = [("NAME", "SOURCE", "WRITABLE", "USERS", "DESCRIPTION")]
        for key in keys:
            ds = found.get(key)
            rows.append(undecodable_row(key) if ds is None else dataset_row(ds))
        if args.json:
            out(json.dumps([ds.model_dump(mode="json") for ds in records], indent=2))
            return EXIT_OK
        out(columns(rows))
        return EXIT_OK
    finally:
        await nc.close()


# ---------------------------------------------------------------- drain


def _safe_key(key: str) -> bool:
    return bool(re.fullmatch(r"[-/_=.a-zA-Z0-9]+", key))


async def drain(args: argparse.Namespace) -> int:
    """Stop every task on a node on purpose (they are retried elsewhere) and keep new work off
    it, or with --undo let it take work again; waits until the node's agent has done it."""
    from muster.shared.messages import DrainOrder, NodeInfo

    nc = await connect(args.connect_timeout)
    try:
        if client.asker(nc) != subjects.ALL:
            raise CliError("draining a node takes an admin identity")
        js = nc.jetstream(timeout=10)
        try:
            from muster.shared.store import Store  # only here: it brings the metrics library

            nodes = Store(await js.key_value(subjects.NODES_BUCKET), NodeInfo)
        except NotFoundError:
            raise CliError("no nodes yet") from None
        if not _safe_key(args.node) or await nodes.get(args.node) is None:
            raise CliError(f"no node {args.node!r}", EXIT_INVALID)
        order = DrainOrder(node=args.node, undo=args.undo, grace=args.grace, by=client.submitter(nc))
        await js.publish(subjects.drain(args.node), order.to_bytes())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.grace + 30
        while loop.time() < deadline:
            info = await nodes.get(args.node)
            if info is not None and info.drained == (not args.undo):
                out(f"{args.node}  {'drained' if info.drained else 'takes work again'}")
                return EXIT_OK
            await asyncio.sleep(0.2)
        raise CliError(f"{args.node}: its agent did not answer (is it running?); the order waits for it")
    finally:
        await nc.close()
