"""Lowest CPU and IO priority for the learning process, so a run never slows the user down.

Without psutil: `os.nice`, `os.sched_setscheduler(SCHED_IDLE)` and the `ioprio_set` system
call on Linux; `setiopolicy_np` (IO throttling) on macOS. Each step is best effort (a kernel
may refuse one); `current_priority` reports what took effect, for `daemon status` and tests.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import platform
import sys
from dataclasses import dataclass

# Linux ioprio: class in the top bits, IOPRIO_WHO_PROCESS, class 3 = idle.
IOPRIO_CLASS_SHIFT = 13
IOPRIO_CLASS_IDLE = 3
IOPRIO_WHO_PROCESS = 1
_IOPRIO_SYSCALLS = {"x86_64": (251, 252), "aarch64": (30, 31), "arm64": (30, 31)}  # (set, get)
# macOS: setiopolicy_np(IOPOL_TYPE_DISK, IOPOL_SCOPE_PROCESS, IOPOL_THROTTLE)
IOPOL_TYPE_DISK, IOPOL_SCOPE_PROCESS, IOPOL_THROTTLE = 0, 0, 3


@dataclass(frozen=True)
class Priority:
    nice: int
    cpu_idle_class: bool | None  # Linux SCHED_IDLE; None where there is no such thing
    io_idle_class: bool | None  # Linux idle IO class / macOS throttled IO; None when unknown


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name, use_errno=True) if name else ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _ioprio_syscalls() -> tuple[int, int] | None:
    return _IOPRIO_SYSCALLS.get(platform.machine()) if sys.platform.startswith("linux") else None


def lowest_priority() -> Priority:
    """Nice 19, the idle CPU scheduling class and the idle IO class, as far as the OS allows."""
    with contextlib.suppress(OSError):
        os.nice(19 - os.getpriority(os.PRIO_PROCESS, 0))
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    libc = _libc()
    calls = _ioprio_syscalls()
    if libc is not None and calls is not None:
        libc.syscall(calls[0], IOPRIO_WHO_PROCESS, 0, IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT)
    elif libc is not None and sys.platform == "darwin" and hasattr(libc, "setiopolicy_np"):
        libc.setiopolicy_np(IOPOL_TYPE_DISK, IOPOL_SCOPE_PROCESS, IOPOL_THROTTLE)
    return current_priority()


def current_priority() -> Priority:
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    cpu_idle = None
    if hasattr(os, "sched_getscheduler") and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            cpu_idle = os.sched_getscheduler(0) == os.SCHED_IDLE
    io_idle = None
    libc = _libc()
    calls = _ioprio_syscalls()
    if libc is not None and calls is not None:
        value = libc.syscall(calls[1], IOPRIO_WHO_PROCESS, 0)
        io_idle = value >= 0 and (value >> IOPRIO_CLASS_SHIFT) == IOPRIO_CLASS_IDLE
    elif libc is not None and sys.platform == "darwin" and hasattr(libc, "getiopolicy_np"):
        io_idle = libc.getiopolicy_np(IOPOL_TYPE_DISK, IOPOL_SCOPE_PROCESS) == IOPOL_THROTTLE
    return Priority(nice, cpu_idle, io_idle)
