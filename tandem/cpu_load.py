"""How much CPU other processes take: a timing measured while they compute measures them too.

Linux's /proc/stat counts the machine's busy time; less this process's own CPU time, what is
left is everyone else's. Timings that choose something for the lifetime of a process (the CPU
kernels of tandem.models.linear) are taken again while it is high. /proc/stat counts in clock
ticks per CPU (`resolution_s`), so over a short window the figure is coarse; in a container
without lxcfs it is the host's, other tenants included.
"""

import os
import time
from collections.abc import Callable

BusyClock = Callable[[], float | None]


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has been busy since boot (all cores; idle and I/O wait
    excluded), or None where /proc/stat is not there."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def resolution_s() -> float:
    """How far a difference of two machine_busy_s readings can be off: a tick on every CPU."""
    return (os.cpu_count() or 1) / os.sysconf("SC_CLK_TCK")


def others_busy_s() -> float | None:
    """A clock of the CPU seconds every other process has taken (the machine's busy time less
    this process's); differences of two readings are what the others took in between."""
    busy = machine_busy_s()
    return None if busy is None else busy - time.process_time()
