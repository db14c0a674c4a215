"""How a `muster` command reaches Muster: find the mesh it goes to, connect within its patience,
check that Muster answers there, and ask the gateway."""

from __future__ import annotations

import asyncio
import os
import re
from typing import TYPE_CHECKING, Any

from nats.aio.client import Client as NATS

from muster.services.cli.console import CliError, err
from muster.shared import auth, bus, client, subjects

# The models (pydantic), the mesh (mesh.py: the services) and the agent's modules are imported
# where a command needs them, not here: most commands need few of them, and importing them is
# most of a start-up otherwise (docs/BENCHMARKS.md; tests/test_cli.py checks `submit`).
if TYPE_CHECKING:
    from muster.services.cli.mesh import Found
    from muster.shared.messages import AttemptRecord, JobRecord


def locate() -> Found:
    """The mesh this command goes to (services/cli/mesh.py `find_mesh`): MUSTER_NATS_URL, else
    the `muster up` started in this directory or above it, one starting there, or the only one
    running. Once found, MUSTER_NATS_URL names it for the rest of the command."""
    from muster.services.cli.mesh import MeshError, find_mesh

    try:
        found = find_mesh()
    except MeshError as exc:
        raise CliError(str(exc)) from None
    if found.note is not None and not os.environ.get("MUSTER_NATS_URL"):
        os.environ["MUSTER_NATS_URL"] = str(found.note["url"])
    return found


class Patience:
    """A command's wait for the bus: `timeout` seconds from its start, or from the last moment
    the mesh it goes to was seen starting (a `muster up` beside it), up to mesh.START_WAIT in all
    (or `timeout`, if longer)."""

    def __init__(self, timeout: float):
        from muster.services.cli.mesh import START_WAIT

        self.loop = asyncio.get_running_loop()
        self.timeout = timeout
        self.started = self.loop.time()
        self.deadline = self.started + timeout
        self.cap = self.started + max(timeout, START_WAIT)
        self.starting: str | None = None  # the last mesh seen starting, for messages
        self.told = False

    def left(self, found: Found) -> float:
        now = self.loop.time()
        if found.starting:
            self.starting = found.starting
            self.deadline = max(self.deadline, min(self.cap, now + self.timeout))
            if not self.told and now - self.started > 2.0:
                err(f"muster: waiting for {found.starting} (up to {self.cap - self.started:.0f}s)")
                self.told = True
        return self.deadline - now

    def waited(self) -> str:
        return f"{self.loop.time() - self.started:.1f}s"


def _real_wait(text: str, waited: str) -> str:
    """bus.connect's words with the whole wait instead of its last try's bound."""
    return re.sub(r" within [0-9.e+-]+s", f" within {waited}", text, count=1)


async def connect_bus(timeout: float) -> tuple[NATS, Patience]:
    """Connect to the mesh this command goes to (`locate`) as MUSTER_CREDENTIALS or that mesh's
    local admin identity, within `timeout` seconds (more while that mesh is starting)."""
    wait = Patience(timeout)
    while True:
        found = locate()
        left = wait.left(found)
        url = found.url
        if url is None:  # a `muster up` here that has not said where it listens yet
            if left <= 0:
                raise CliError(f"{found.starting} has not said where it listens within {wait.waited()}")
            await asyncio.sleep(0.1)
            continue
        creds = found.credentials()
        try_for = max(0.1, left)
        if found.starting or (creds is None and not os.environ.get(auth.CREDENTIALS_ENV)):
            try_for = min(try_for, 1.0)  # look at the notes again soon
        try:
            nc = await bus.connect("muster-cli", url, connect_timeout=try_for, quiet=True, credentials=creds)
            return nc, wait
        except ConnectionError as exc:
            if wait.left(found) > 0.1:
                await asyncio.sleep(0.1)
                continue
            why = _real_wait(str(exc), wait.waited())
            if wait.starting and not found.starting:
                why += f"; {wait.starting} stopped (see its output)"
            raise CliError(f"{why} (is `muster up` running? set MUSTER_NATS_URL to join another)") from None


async def connect(timeout: float) -> NATS:
    """`connect_bus`, then check that Muster answers there, within the same wait in all (a
    `muster up` started a moment ago gets until it is ready, up to mesh.START_WAIT)."""
    nc, wait = await connect_bus(timeout)
    while True:
        try:
            await client.ask(nc, "ping", timeout=max(0.5, min(2.0, wait.left(locate()))))
            return nc
        except client.Refused as exc:
            await nc.close()
            raise CliError(str(exc)) from None
        except TimeoutError as exc:
            if wait.left(locate()) <= 0:
                why = f"Muster does not answer on {bus.shown(bus.nats_url())} within {wait.waited()}"
                if "no gateway answers" in str(exc):
                    why += f": {exc}"
                if client.asker(nc) == subjects.ALL:  # may look: say what is missing, if anything
                    try:
                        await bus.open_jetstream(nc)
                    except bus.NotSetUp as missing:
                        why = str(missing)
                    except Exception:
                        pass
                await nc.close()
                raise CliError(why) from None
            await asyncio.sleep(0.25)


async def ask(nc: NATS, verb: str, **request: Any) -> dict[str, Any]:
    try:
        return await client.ask(nc, verb, request)
    except client.Refused as exc:
        raise CliError(str(exc), exc.code) from None


async def resolve(nc: NATS, ref: str) -> JobRecord:
    """A job by id, else by name (the most recent job holding that name), that we may see."""
    from muster.shared.messages import JobRecord

    return JobRecord.model_validate((await ask(nc, "job", ref=ref))["job"])


async def job_and_attempts(nc: NATS, ref: str) -> tuple[JobRecord, list[AttemptRecord]]:
    return job_of(await ask(nc, "job", ref=ref))


def job_of(answer: dict[str, Any]) -> tuple[JobRecord, list[AttemptRecord]]:
    from muster.shared.messages import AttemptRecord, JobRecord

    return JobRecord.model_validate(answer["job"]), [
        AttemptRecord.model_validate(a) for a in answer["attempts"]
    ]
