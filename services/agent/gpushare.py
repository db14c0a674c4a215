"""Tasks that hold part of one GPU (a fractional gpuNumber, TaskSpec.gpu_milli) on this node:
what they see in their environment, and, in MPS mode, the NVIDIA MPS control daemon of each
shared GPU (docs/gpus.md).

- Time-slicing (the default): every task of a shared GPU gets that device; the driver
  time-slices them. Nothing is isolated: a task can take all the memory, or crash the others.
- MPS (`--gpu-sharing mps`): one control daemon per shared GPU, started when the first shared
  task lands on it and told to quit after the last one leaves (and when the agent stops, unless
  it leaves its tasks running for the next agent, which then uses the daemon it finds). Each
  task gets its share as CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and, where the device's memory is
  known, as CUDA_MPS_PINNED_DEVICE_MEM_LIMIT.

A fatal fault of one MPS client can take the other clients of its GPU down. Such a failure of a
neighbour is the platform's, not its own: `MpsDaemons.judge` tells the agent which failures to
report as PLATFORM (uncharged).

The daemon is driven through `MpsControl`; `NvidiaMps` is the real one (the
nvidia-cuda-mps-control binary on PATH: tests put a fake of that binary there)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from muster.shared.jobconfig import WHOLE_GPU, JobConfig
from muster.shared.messages import GpuSharing, TaskSpec

MPS_CONTROL = "nvidia-cuda-mps-control"
CONTROL_TIMEOUT = 10.0  # seconds for one call of the control binary (it must never hang the agent)
# Seconds after a GPU's MPS fault in which its other tasks' failures are taken as caused by it.
FAULT_WINDOW = 60.0
# What an MPS server log line says when a client's fault took the server (and its clients) down.
FAULT_LINE = re.compile(r"fatal|exception|xid|fault", re.IGNORECASE)


def share_milli(config: JobConfig, spec: TaskSpec) -> int | None:
    """The task's share of its one GPU in thousandths, or None (whole GPUs, or none). The spec
    says it; a spec rebuilt from an attempt record that lacks it (an adopted task) takes its
    role's, which the scheduler placed it by."""
    if spec.gpu_milli is not None:
        return spec.gpu_milli
    role = config.role(spec.role)
    return role.gpu_milli if role.shares_gpu and spec.gpus else None


def share_text(milli: int) -> str:
    """500 -> '0.5', 250 -> '0.25' (as gpuNumber is written)."""
    return f"{milli / WHOLE_GPU:g}"


def mps_dirs(work_root: str, gpu: int) -> tuple[Path, Path]:
    """The pipe and log directories of GPU `gpu`'s MPS daemon, under the agent's work root."""
    base = Path(work_root) / "mps" / str(gpu)
    return base / "pipe", base / "log"


def share_env(
    gpus: list[int], milli: int, sharing: GpuSharing, pipe_dir: str | None = None, memory_mb: int = 0
) -> dict[str, str]:
    """The GPU variables of a task holding `milli` thousandths of GPU gpus[0], shared `sharing`.

    MPS: the daemon of the GPU is started with CUDA_VISIBLE_DEVICES=<index>, so its server
    shows its clients that one device as ordinal 0 (NVIDIA's MPS docs: a client keeping the
    host index would see no device); the pinned limit names ordinal 0 likewise. `memory_mb`: the
    device's memory (NVML's, or declared); 0: unknown, no memory limit is set."""
    index = ",".join(map(str, gpus))
    env = {
        "CUDA_VISIBLE_DEVICES": index,
        "NVIDIA_VISIBLE_DEVICES": index,
        "MUSTER_GPU_SHARE": share_text(milli),
        "MUSTER_GPU_SHARING": str(sharing),
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # NVML's numbering, as the index is (environment._gpus)
    }
    if sharing is GpuSharing.MPS:
        env["CUDA_VISIBLE_DEVICES"] = "0"
        if pipe_dir is not None:
            env["CUDA_MPS_PIPE_DIRECTORY"] = pipe_dir
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(max(1, round(milli / 10)))
        if memory_mb > 0:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={max(1, memory_mb * milli // WHOLE_GPU)}M"
    return env


# ------------------------------------------------------------------ the MPS control daemon


class MpsError(Exception):
    """The MPS control daemon could not be started (the message says why)."""


class MpsControl(Protocol):
    """The calls the agent makes of NVIDIA MPS: the seam tests replace."""

    async def start(self, gpu: int, pipe_dir: Path, log_dir: Path) -> None:
        """Start the control daemon of GPU `gpu`; raises MpsError."""
        ...

    async def quit(self, pipe_dir: Path) -> None:
        """Tell the daemon of `pipe_dir` to quit (nothing when none runs)."""
        ...

    async def running(self, pipe_dir: Path) -> bool:
        """Whether a control daemon answers at `pipe_dir`."""
        ...


def mps_available(binary: str = MPS_CONTROL) -> str | None:
    """Why MPS cannot be used on this machine, or None."""
    if shutil.which(binary) is None:
        return (
            f"{binary} is not on PATH: install the NVIDIA driver's MPS tools (nvidia-utils), "
            "or run the agent with --gpu-sharing timeslice"
        )
    return None


class NvidiaMps:
    """The real control: NVIDIA's nvidia-cuda-mps-control (`-d` starts a daemon; `quit` and
    `get_server_list` on its standard input talk to the daemon of CUDA_MPS_PIPE_DIRECTORY)."""

    def __init__(self, binary: str = MPS_CONTROL, timeout: float = CONTROL_TIMEOUT) -> None:
        self.binary, self.timeout = binary, timeout

    async def _call(self, args: list[str], env: Mapping[str, str], stdin: bytes | None) -> tuple[int, str]:
        try:
            proc = await asyncio.create_subprocess_exec(
                self.binary,
                *args,
                env={**os.environ, **env},
                stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # a daemon it forks is not in the agent's process group
            )
        except OSError as exc:
            return 127, f"cannot run {self.binary}: {exc.strerror or exc}"
        try:
            out, _ = await asyncio.wait_for(proc.communicate(stdin), self.timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return 124, f"{self.binary} {' '.join(args)} did not answer within {self.timeout:g} s"
        return proc.returncode or 0, out.decode("utf-8", "replace").strip()

    async def start(self, gpu: int, pipe_dir: Path, log_dir: Path) -> None:
        env = {
            "CUDA_VISIBLE_DEVICES": str(gpu),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",  # `gpu` is NVML's index
            "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir),
            "CUDA_MPS_LOG_DIRECTORY": str(log_dir),
        }
        # The daemon it forks may keep what was its stdout open: that is a file, not a pipe
        # this would wait on for ever.
        out_path = log_dir / "start.out"
        try:
            with out_path.open("wb") as out_file:
                proc = await asyncio.create_subprocess_exec(
                    self.binary,
                    "-d",
                    env={**os.environ, **env},
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out_file,
                    stderr=asyncio.subprocess.STDOUT,
                    start_new_session=True,
                )
        except OSError as exc:
            raise MpsError(f"cannot run {self.binary}: {exc.strerror or exc}") from None
        try:
            code = await asyncio.wait_for(proc.wait(), self.timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            why = f"{self.binary} -d for GPU {gpu} did not return within {self.timeout:g} s"
            raise MpsError(why) from None
        out = out_path.read_text(errors="replace").strip()
        if code != 0:
            raise MpsError(f"{self.binary} -d for GPU {gpu} failed ({code}): {out[:300]}")

    async def quit(self, pipe_dir: Path) -> None:
        await self._call([], {"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}, b"quit\n")

    async def running(self, pipe_dir: Path) -> bool:
        code, out = await self._call([], {"CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}, b"get_server_list\n")
        return code == 0 and "cannot find" not in out.lower()


@dataclass
class _Fault:
    at: float  # time.time() of the first failure seen after it
    why: str
    first: str  # the task whose failure revealed it (charged: its own fault, presumably)


@dataclass
class _Gpu:
    users: set[str] = field(default_factory=set)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    log_offset: int = 0  # how far its server log has been read for faults
    fault: _Fault | None = None


class MpsDaemons:
    """One MPS control daemon per shared GPU of this node, counted by the tasks using it."""

    def __init__(self, work_root: str, control: MpsControl | None = None) -> None:
        self.work_root = work_root
        self.control: MpsControl = control or NvidiaMps()
        self.gpus: dict[int, _Gpu] = {}

    def _gpu(self, gpu: int) -> _Gpu:
        return self.gpus.setdefault(gpu, _Gpu())

    def dirs(self, gpu: int) -> tuple[Path, Path]:
        return mps_dirs(self.work_root, gpu)

    async def acquire(self, gpu: int, user: str) -> Path:
        """`user` runs on GPU `gpu`: its daemon is started if none answers (one an earlier agent
        left running is used as it is). Returns the pipe directory; raises MpsError."""
        state = self._gpu(gpu)
        async with state.lock:
            pipe, logs = self.dirs(gpu)
            if not state.users and not await self.control.running(pipe):
                # What a daemon that died left in its pipe directory is not to be found by the new one.
                shutil.rmtree(pipe, ignore_errors=True)
                pipe.mkdir(parents=True, exist_ok=True)
                logs.mkdir(parents=True, exist_ok=True)
                # Tasks of another user (a container's) reach the daemon's pipes through it.
                os.chmod(pipe, 0o755)
                state.log_offset = _size(logs / "server.log")
                state.fault = None
                await self.control.start(gpu, pipe, logs)
            state.users.add(user)
            return pipe

    def adopt(self, gpu: int, user: str) -> None:
        """A task an earlier agent started on GPU `gpu` (its daemon, left running, is its own)."""
        state = self._gpu(gpu)
        if not state.users:
            state.log_offset = _size(self.dirs(gpu)[1] / "server.log")
        state.users.add(user)

    async def release(self, gpu: int, user: str) -> None:
        """`user` left GPU `gpu`: its daemon quits after the last one."""
        state = self.gpus.get(gpu)
        if state is None:
            return
        async with state.lock:
            if user not in state.users:
                return
            state.users.discard(user)
            if not state.users:
                await self.control.quit(self.dirs(gpu)[0])

    async def sweep(self) -> list[int]:
        """Quit the daemons nothing here uses (left by an earlier agent whose tasks are gone).
        Returns the GPUs whose daemon was told to quit."""
        root = Path(self.work_root) / "mps"
        quit_ = []
        for entry in sorted(root.iterdir()) if root.is_dir() else []:
            if not entry.name.isdigit() or self._gpu(int(entry.name)).users:
                continue
            pipe = entry / "pipe"
            if await self.control.running(pipe):
                await self.control.quit(pipe)
                quit_.append(int(entry.name))
        return quit_

    async def close(self) -> None:
        """The agent stops and its tasks with it: every daemon quits."""
        for gpu, state in self.gpus.items():
            state.users.clear()
            with contextlib.suppress(Exception):
                await self.control.quit(self.dirs(gpu)[0])

    async def judge(self, gpu: int, user: str) -> str | None:
        """`user`'s task on GPU `gpu` failed. None: its own failure (reported, and charged, as
        usual). Else why the platform failed it: the GPU's MPS daemon is gone, or its server
        logged a fatal fault and `user` is not the first task of the GPU to fail after it.

        The first to fail is taken as the one whose fault it was: a client's fatal fault ends
        its own process at once, the others when they next touch the GPU. A neighbour that
        fails first (it was already ending) is charged instead; see docs/gpus.md."""
        state = self._gpu(gpu)
        async with state.lock:
            fault = state.fault
            at = time.time()
            if fault is not None and at - fault.at <= FAULT_WINDOW:
                if fault.first == user:
                    return None
                if not fault.first:
                    return fault.why
                return f"{fault.why}, after {fault.first} failed: a neighbour's fault, not this task's"
            pipe, logs = self.dirs(gpu)
            if not await self.control.running(pipe):
                why = f"the MPS daemon of GPU {gpu} is gone"
                state.fault = _Fault(at=at, why=why, first="")  # nobody's: all are the platform's
                return why
            line = self._new_fault_line(state, logs / "server.log")
            if line is None:
                return None
            state.fault = _Fault(at=at, why=f"the MPS server of GPU {gpu} faulted ({line[:160]})", first=user)
            return None

    @staticmethod
    def _new_fault_line(state: _Gpu, log: Path) -> str | None:
        """The first fault line the server log gained since it was last read."""
        try:
            with log.open("rb") as f:
                f.seek(state.log_offset)
                text = f.read(1 << 20)
        except OSError:
            return None
        state.log_offset += len(text)
        for line in text.decode("utf-8", "replace").splitlines():
            if FAULT_LINE.search(line):
                return line.strip()
        return None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
