"""A distributed job with nothing but the standard library: parameter servers and workers find
each other through the environment Muster gives every task, exchange values over TCP, and check
the result. Run by examples/ps-worker/job.json."""

import json
import os
import socket
import sys
import time


def hosts(role: str) -> list[tuple[str, int]]:
    out = []
    for item in os.environ[f"PAI_TASK_ROLE_{role}_HOST_LIST"].split(","):
        host, port = item.rsplit(":", 1)
        out.append((host, int(port)))
    return out


def serve_ps() -> None:
    """Collect one value from every worker, answer each with the sum."""
    workers = len(hosts("worker"))
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", int(os.environ["PAI_CURRENT_CONTAINER_PORT"])))
        server.listen()
        conns, total = [], 0
        while len(conns) < workers:
            conn, _ = server.accept()
            total += json.loads(conn.makefile().readline())["value"]
            conns.append(conn)
        for conn in conns:
            conn.sendall((json.dumps({"sum": total}) + "\n").encode())
            conn.close()
    print(f"ps {os.environ['PAI_TASK_ROLE_INDEX']}: sum of {workers} workers = {total}")


def connect(addr: tuple[str, int], deadline: float) -> socket.socket:
    while True:
        try:
            return socket.create_connection(addr, timeout=30)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def work() -> None:
    """Send this worker's value to every ps; every ps must answer with the sum of all workers."""
    index, workers = int(os.environ["PAI_TASK_ROLE_INDEX"]), len(hosts("worker"))
    value = index + 1
    expected = workers * (workers + 1) // 2
    deadline = time.monotonic() + 60
    for addr in hosts("ps"):
        with connect(addr, deadline) as conn:
            conn.sendall((json.dumps({"value": value}) + "\n").encode())
            got = json.loads(conn.makefile().readline())["sum"]
        if got != expected:
            sys.exit(f"worker {index}: ps {addr} says {got}, expected {expected}")
    print(f"worker {index}: every ps agrees the sum is {expected}")


if __name__ == "__main__":
    serve_ps() if os.environ["PAI_TASK_ROLE_NAME"] == "ps" else work()
