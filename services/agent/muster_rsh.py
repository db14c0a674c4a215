#!/usr/bin/env python3
"""muster-rsh: Open MPI's plm_rsh_agent in a Muster MPI job (no ssh, no keys).

    muster-rsh HOST COMMAND...

runs COMMAND (an orted line, as `ssh HOST COMMAND...` would) in the job's task HOST names (the
task's host alias in the MPI hostfile, or its address) and exits with its exit code. It asks
this node's agent through the attempt's socket, next to this file (`rsh.sock` in the attempt
directory, which only the attempt's own tasks on this node see); the agent asks the agent of the
task's node over the bus. The standard library only: the agent writes
this file into every MPI attempt's directory, and the task's own python3 runs it, whatever its
version from 3.5 on (MPI images are often old: Horovod's, NGC's): no f-strings, no annotations
evaluated at definition, json given str."""

import json
import os
import socket
import sys

SOCKET = "rsh.sock"


def fail(reason):  # type: (str) -> int
    sys.stderr.write("muster-rsh: %s\n" % reason)
    sys.stderr.flush()
    return 255  # what ssh exits with on its own errors


def detached(reason):  # type: (str) -> int
    """The command goes on without this session (its agent restarts, or lost the peer's):
    exit 0, which mpirun, talking to its daemon directly, takes as nothing after launch."""
    sys.stderr.write("muster-rsh: detached: %s\n" % reason)
    sys.stderr.flush()
    return 0


def main(argv):  # type: (list) -> int
    args = argv[1:]
    while args and args[0].startswith("-"):  # ssh options a caller may add (-x, -n, -T)
        args = args[1:]
    if len(args) < 2:
        return fail("usage: muster-rsh HOST COMMAND...")
    host, command = args[0], " ".join(args[1:])
    here = os.path.dirname(os.path.realpath(__file__))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Through the directory's descriptor: a socket path may not be longer than 107 bytes.
        fd = os.open(here, os.O_RDONLY)
        try:
            sock.connect("/proc/self/fd/%d/%s" % (fd, SOCKET))
        finally:
            os.close(fd)
    except OSError as exc:
        return fail(
            "cannot reach this node's Muster agent at %s/%s: %s" % (here, SOCKET, exc.strerror or exc)
        )
    started = False
    with sock:
        sock.sendall(json.dumps({"host": host, "command": command}).encode() + b"\n")
        for line in sock.makefile("rb"):
            try:
                said = json.loads(line.decode("utf-8", "replace"))
            except ValueError:
                return fail("the agent said something that is not JSON")
            if "started" in said:
                started = True
            elif "out" in said:
                sys.stdout.write(said["out"])
                sys.stdout.flush()
            elif "exit" in said:
                return int(said["exit"])
            elif "detached" in said:
                return detached(str(said["detached"]))
            elif "error" in said:
                return fail(str(said["error"]))
    if started:  # the agent died (it restarts): the command goes on
        return detached("this node's agent went away; the command goes on")
    return fail("the agent closed the connection before the command ended")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
