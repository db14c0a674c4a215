"""The sim runtime: a task "runs" for a set time and exits with a chosen code, with no process,
container or thread behind it (one asyncio timer). It exists for benchmarks and scale tests of
the control plane (scheduler, registry, supervisor, the bus) with thousands of nodes on one
machine; it never does real work: the image, command, mounts and limits are ignored.

What a task does comes from its job's `extras.sim` (all optional):

    "extras": {"sim": {"seconds": 2.5, "exitCode": 0,
                       "roles": {"worker": {"exitCode": 1}},
                       "tasks": {"worker.3": {"seconds": 10}}}}

A role's entry overrides the job's values, a task's (`ROLE.INDEX`) its role's; defaults 0 s and
exit 0, so any job runs (and succeeds) on sim nodes as it is. A value that is not valid is a
configuration error naming the field: the task is not started, and the supervisor does not
retry it elsewhere (it would fail the same way on every node). A trace replayer sets these
per job (bench/).

`stop(grace)` ends a task at once with 143, as a process that honours SIGTERM would. Nothing
survives the agent: there is nothing to adopt, find or reap, and no fence."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from muster.services.agent.runtime import (
    LABEL_INDEX,
    LABEL_ROLE,
    ExecOutput,
    FoundTask,
    LaunchError,
    OutputSink,
    TaskLaunch,
)
from muster.shared.messages import TaskCause

STOPPED = 143  # 128 + SIGTERM: what a stopped task exits with
FIELDS = ("seconds", "exitCode")


@dataclass(frozen=True)
class SimPlan:
    """What one simulated task does: run `seconds`, then exit with `exit_code`."""

    seconds: float = 0.0
    exit_code: int = 0


def sim_plan(extras: Mapping[str, Any], role: str, index: int) -> SimPlan:
    """The plan of task `role`.`index` from a job's `extras` (pure). Raises `LaunchError`
    (CONFIG) naming the first bad field, e.g. `extras.sim.roles.worker.exitCode`."""
    sim = extras.get("sim")
    if sim is None:
        return SimPlan()
    where = "extras.sim"
    _check_object(sim, where, (*FIELDS, "roles", "tasks"))
    values = _values(sim, where, {"seconds": 0.0, "exitCode": 0})
    for group, key in (("roles", role), ("tasks", f"{role}.{index}")):
        entries = sim.get(group)
        if entries is None:
            continue
        _check_object(entries, f"{where}.{group}", None)
        for name, entry in entries.items():  # all checked: a bad entry fails every task alike
            _check_object(entry, f"{where}.{group}.{name}", FIELDS)
            checked = _values(entry, f"{where}.{group}.{name}", {})
            if name == key:
                values.update(checked)
    return SimPlan(seconds=float(values["seconds"]), exit_code=int(values["exitCode"]))


def _check_object(value: Any, where: str, allowed: tuple[str, ...] | None) -> None:
    if not isinstance(value, dict):
        raise LaunchError(f"{where}: must be an object, got {_kind(value)}", TaskCause.CONFIG)
    if allowed is not None:
        unknown = sorted(k for k in value if k not in allowed)
        if unknown:
            raise LaunchError(
                f"{where}.{unknown[0]}: unknown field (expected {', '.join(allowed)})", TaskCause.CONFIG
            )


def _values(entry: dict[str, Any], where: str, into: dict[str, float | int]) -> dict[str, float | int]:
    """`seconds` and `exitCode` of one entry, checked, over `into`."""
    out = dict(into)
    if "seconds" in entry:
        seconds = entry["seconds"]
        if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds):
            raise LaunchError(
                f"{where}.seconds: must be a finite number ≥ 0, got {_kind(seconds)}", TaskCause.CONFIG
            )
        if seconds < 0:
            raise LaunchError(f"{where}.seconds: must be ≥ 0, got {seconds}", TaskCause.CONFIG)
        out["seconds"] = float(seconds)
    if "exitCode" in entry:
        code = entry["exitCode"]
        if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255:
            raise LaunchError(
                f"{where}.exitCode: must be an integer 0-255, got {_kind(code)}", TaskCause.CONFIG
            )
        out["exitCode"] = code
    return out


def _kind(value: Any) -> str:
    if isinstance(value, bool | int | float) or value is None:
        return repr(value)
    if isinstance(value, str):
        return repr(value[:40])
    if isinstance(value, dict | list):
        return "an object" if isinstance(value, dict) else "a list"
    return type(value).__name__


class SimTask:
    """A timer standing in for a task: `wait` returns its exit code when the time is up, or
    STOPPED as soon as it is stopped."""

    def __init__(self, name: str, plan: SimPlan, output: OutputSink) -> None:
        self.name, self.plan, self._output = name, plan, output
        loop = asyncio.get_running_loop()
        self._ended: asyncio.Future[int] = loop.create_future()
        self._timer = loop.call_later(plan.seconds, self._end, plan.exit_code)

    def _end(self, code: int) -> None:
        if self._ended.done():
            return
        self._timer.cancel()
        self._output(f"sim: exit {code}" + (" (stopped)" if code == STOPPED else ""))
        self._ended.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._ended)

    async def stop(self, grace: float) -> None:
        self._end(STOPPED)
        await asyncio.shield(self._ended)

    async def signal(self, sig: int) -> None:
        if not self._ended.done():
            self._output(f"sim: signal {sig}")

    oom_killed = False  # a timer uses no memory
    vanished = False
    can_exec = False  # nothing runs in a simulated task

    async def exec(self, command: str, output: ExecOutput) -> int:
        raise NotImplementedError("the sim runtime cannot run commands in a task")

    async def remove(self) -> None:
        """Nothing is left of it."""


class SimRuntime:
    name = "sim"
    can_adopt = False
    # A simulated task listens on nothing: its ports are only counted, never probed by a bind
    # (a socket per port, thousands per gang in a sim process).
    tasks_in_agent_network = False

    async def start(self, launch: TaskLaunch, output: OutputSink) -> SimTask:
        role, index = launch.labels.get(LABEL_ROLE, ""), int(launch.labels.get(LABEL_INDEX, "0"))
        plan = sim_plan(launch.extras, role, index)
        output(f"sim: running {plan.seconds:g} s, then exit {plan.exit_code}")
        return SimTask(launch.name, plan, output)

    async def find(self, labels: dict[str, str]) -> list[FoundTask]:
        """Nothing outlives the agent that ran it."""
        return []

    async def attach(
        self, name: str, output: OutputSink | None = None, since: float | None = None
    ) -> SimTask:
        raise LaunchError(f"the sim runtime cannot adopt {name}")

    async def reap(self, found: FoundTask) -> None:
        return None

    def start_fence(self, home: str, pidfile: str, wait: float, bus_url: str = "") -> None:
        """No fence: a simulated task cannot outlive the process that times it."""

    def detach(self) -> None:
        return None

    async def capacity(self) -> tuple[int, int] | None:
        """None: any declaration is honoured (nothing is used)."""
        return None

    async def close(self) -> None:
        return None
