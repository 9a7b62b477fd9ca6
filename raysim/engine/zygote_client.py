"""Start a Ray worker as a fork of the run's zygote: ``python -I -S zygote_client.py ADDRESS
COMMAND...`` (``zygote.py`` says why).

The raylet starts this in place of the worker's own command. It hands its standard streams, its
arguments, environment, working directory, CPU priority and OOM score to the zygote, which forks
the worker with torch and raysim already imported, and then waits for that worker and leaves with
its exit status: the raylet keeps a child to watch, and killing this kills the worker (the zygote
sees the connection close). Where there is no zygote, or it declines the command, the command
replaces this process as the raylet would have run it. Only the standard library is used, and
``-I -S`` skip ``site``, so it costs a few milliseconds.
"""

import json
import os
import signal
import socket
import struct
import sys

HEADER = struct.Struct("!Q")
STATUS = struct.Struct("!i")


def _oom_score_adj() -> str | None:
    try:
        with open("/proc/self/oom_score_adj") as f:
            return f.read().strip()
    except OSError:
        return None


def request(command: list[str]) -> bytes:
    return json.dumps(
        {
            "argv": command,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "oom_score_adj": _oom_score_adj(),
        }
    ).encode()


def receive(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from ``sock``, or fewer if it closes first."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            break
        data += chunk
    return data


def main(argv: list[str]) -> None:
    address, command = argv[0], argv[1:]
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect("\0" + address)
        body = request(command)
        socket.send_fds(sock, [HEADER.pack(len(body))], [0, 1, 2])
        sock.sendall(body)
        forked = receive(sock, 1) == b"1"  # b"0": declined; b"": the zygote is gone
    except (OSError, ValueError):  # (ValueError: an environment that is not UTF-8)
        forked = False
    if not forked:
        os.execv(command[0], command)
    reply = receive(sock, STATUS.size)
    code = STATUS.unpack(reply)[0] if len(reply) == STATUS.size else 1
    if code < 0:  # the worker was killed by a signal: so is this
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code & 0xFF)


if __name__ == "__main__":
    main(sys.argv[1:])
