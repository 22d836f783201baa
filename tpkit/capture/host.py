"""What the host is: its CPU's name and the cores this process may use."""

from __future__ import annotations

import os
import platform


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or what ``platform`` says where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: a container's or ``taskset``'s
    limit), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity call (macOS, Windows)
        return os.cpu_count() or 1
