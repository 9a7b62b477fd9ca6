"""Run a command at idle CPU priority: ``python -I -S idle_priority.py PROGRAM [ARG...]``.

A local run starts Ray's two agents through this (``local_ray.background_agents``): the priority
is set here and the program replaces this process (``execv``: the same PID, which the raylet
watches). ``SCHED_IDLE`` is the kernel's lowest class: the agents run on what the processes a
run waits for leave idle. Only the standard library is used, and ``-I -S`` skip ``site``, so
it costs a few milliseconds.
"""

import os
import sys


def main(argv: list[str]) -> None:
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:  # no SCHED_IDLE (not Linux): the lowest nice value is the nearest thing
        os.nice(19)
    os.execv(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
