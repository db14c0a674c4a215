"""What a node has: CPUs, memory, GPUs (NVML when a driver is present, else declared as
`4xV100,2xT4`), its address, and the pool of ports its tasks get."""

from __future__ import annotations

import itertools
import os
import re
import socket
from typing import Any

import structlog

from muster.shared.messages import MAX_NODE_GPUS, GpuDevice

log = structlog.get_logger(service="agent")

_GPU_SPEC = re.compile(r"^\s*(\d+)\s*[xX×]\s*([A-Za-z0-9_.-]{1,64})(?::(\d{1,9}))?\s*$")


def parse_gpus(spec: str) -> list[GpuDevice]:
    """`8xV100` or `4xV100,2xT4` -> devices indexed 0..n-1 in the order written. "" or "0" -> none.
    `1xH100:81559` also declares each device's memory in MB (NVML reports it where there is a
    driver): what an MPS task's pinned memory limit is a share of (services/agent/gpushare.py)."""
    spec = spec.strip()
    if spec in ("", "0", "none"):
        return []
    devices: list[GpuDevice] = []
    for part in spec.split(","):
        m = _GPU_SPEC.match(part)
        if not m:
            raise ValueError(
                f"GPU spec {part.strip()[:80]!r}: expected COUNTxMODEL, e.g. 4xV100 "
                "(a model of at most 64 letters, digits, '_', '.' and '-'), optionally :MEMORY_MB "
                "(4xV100:16384)"
            )
        if len(devices) + int(m.group(1)) > MAX_NODE_GPUS:
            raise ValueError(f"at most {MAX_NODE_GPUS} GPUs on one node")
        for _ in range(int(m.group(1))):
            devices.append(GpuDevice(index=len(devices), model=m.group(2), memory_mb=int(m.group(3) or 0)))
    return devices


def discover_gpus(nvml: Any = None) -> list[GpuDevice] | None:
    """GPUs through NVML; None when there is no NVIDIA driver (or no nvidia-ml-py). `nvml`: the
    pynvml module, or what stands in for it (a test's fake NVML)."""
    pynvml = nvml if nvml is not None else _import_nvml()
    if pynvml is None:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        devices = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total // (1024 * 1024)
            devices.append(GpuDevice(index=i, model=short_model(name), memory_mb=int(memory)))
        return devices
    finally:
        pynvml.nvmlShutdown()


def _import_nvml() -> Any:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def short_model(name: str) -> str:
    """The word gpuType uses: 'NVIDIA H100 80GB HBM3' -> 'H100', 'Tesla V100-SXM2-16GB' -> 'V100',
    'Tesla T4' -> 'T4', 'NVIDIA GeForce RTX 3090' -> 'RTX3090'."""
    words = re.split(r"[\s-]+", name)
    for word in words:
        if re.match(r"^[A-Z]{1,3}\d{1,4}[A-Za-z]*$", word):
            return word
    for first, second in itertools.pairwise(words):
        if first.isalpha() and first.isupper() and second.isdigit():
            return first + second
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "GPU"


def machine_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def machine_memory_mb() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)


def machine_address() -> str:
    """The address other nodes reach this one at: the source address of the default route."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent for a UDP connect
            address: str = s.getsockname()[0]
            return address
        except OSError:
            return "127.0.0.1"


class PortPool:
    """Ports for tasks from a range; never two live tasks with the same port, and never a port
    something else on the machine is listening on.

    The second is checked by binding the port here, in the agent's network namespace: right when
    the tasks share it (the host network, the process runtime). `probe=False` when they run in
    another namespace (Docker's --docker-network container:NAME), where a bind here tells
    nothing: then only this agent's own tasks are kept apart, and that namespace should hold
    nothing else that listens."""

    def __init__(self, low: int = 5000, high: int = 10000, host: str = "0.0.0.0", probe: bool = True):
        if not 0 < low <= high < 65536:
            raise ValueError(f"bad port range {low}-{high}")
        self.low, self.high, self.host, self.probe = low, high, host, probe
        self.taken: set[int] = set()
        self._next = low

    def take(self, count: int) -> list[int]:
        ports: list[int] = []
        span = self.high - self.low + 1
        for _ in range(span):
            port = self._next
            self._next = self.low + (self._next - self.low + 1) % span
            if port not in self.taken and self._free(port):
                ports.append(port)
                self.taken.add(port)
                if len(ports) == count:
                    return ports
        self.release(ports)
        raise RuntimeError(f"no {count} free ports left in {self.low}-{self.high}")

    def take_range(self, begin: int, count: int) -> list[int]:
        """Exactly begin..begin+count-1 (a portList entry with beginAt > 0)."""
        ports = list(range(begin, begin + count))
        busy = [p for p in ports if p in self.taken or not self._free(p)]
        if busy:
            raise RuntimeError(f"ports {busy} are in use on this node")
        self.taken.update(ports)
        return ports

    def take_exact(self, ports: list[int]) -> None:
        """Mark ports a live task already holds (an adopted task after an agent restart)."""
        self.taken.update(ports)

    def release(self, ports: list[int]) -> None:
        self.taken.difference_update(ports)

    def _free(self, port: int) -> bool:
        return not self.probe or _bindable(self.host, port)


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def parse_port_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    return int(low), int(high or low)
