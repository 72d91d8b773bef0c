"""Reading the machine's state for the daemon: power source, user idle time, load.

No third-party package is needed: Linux exposes power in sysfs and the user's idle hint through
logind (`loginctl`), macOS through `pmset` and `ioreg`. Every probe answers None when it cannot
tell (a desktop has no battery, a headless box no input devices); the conditions decide what an
unknown means. Parsing is split from reading so the formats are tested on real samples.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

SYSFS_POWER = Path("/sys/class/power_supply")
PROBE_TIMEOUT_S = 5


def _run(*argv: str) -> str | None:
    """stdout of a short system command, or None if it is missing or fails."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


# ----------------------------------------------------------------- power
def linux_on_ac(root: Path = SYSFS_POWER) -> bool | None:
    """True on mains power, False on battery, None when sysfs cannot tell.

    A discharging battery means battery, whatever else is plugged in; an online mains/USB
    adapter means AC; a machine with no battery (a desktop, a VM) can only be on AC; an adapter
    that is present but offline means battery; a battery charging or full means AC.
    """
    if not root.is_dir():
        return None
    batteries: list[str | None] = []
    adapters: list[bool] = []
    for supply in sorted(root.iterdir()):
        kind = _read(supply / "type")
        if kind == "Battery":
            if _read(supply / "scope") == "Device":  # a wireless mouse's battery, not the machine's
                continue
            batteries.append(_read(supply / "status"))
        elif kind in ("Mains", "USB", "USB_C", "USB_PD"):
            adapters.append(_read(supply / "online") == "1")
    if "Discharging" in batteries:
        return False
    if any(adapters) or not batteries:
        return True
    if adapters:
        return False
    return True if all(s in ("Charging", "Full", "Not charging") for s in batteries) else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        return None


def parse_pmset(output: str) -> bool | None:
    """`pmset -g batt`: "Now drawing from 'AC Power'" or "'Battery Power'"."""
    match = re.search(r"drawing from '([^']+)'", output)
    if not match:
        return None
    return match.group(1) != "Battery Power"


def on_ac_power() -> bool | None:
    if sys.platform == "darwin":
        output = _run("pmset", "-g", "batt")
        return parse_pmset(output) if output is not None else None
    if sys.platform.startswith("linux"):
        return linux_on_ac()
    return None


# ----------------------------------------------------------------- user idle
def parse_ioreg_idle(output: str) -> float | None:
    """`ioreg -c IOHIDSystem`: "HIDIdleTime" = nanoseconds since the last keyboard/mouse input."""
    match = re.search(r'"HIDIdleTime"\s*=\s*(\d+)', output)
    return int(match.group(1)) / 1e9 if match else None


def parse_loginctl_user(output: str, now_s: float) -> float | None:
    """`loginctl show-user UID -p IdleHint -p IdleSinceHint -p Display`.

    logind's idle hint is only meaningful for a graphical session (its desktop sets it), so with
    no `Display` session the answer is unknown (None). Otherwise: 0 when active, else the
    seconds since `IdleSinceHint` (microseconds since the epoch).
    """
    values = dict(line.split("=", 1) for line in output.splitlines() if "=" in line)
    if not values.get("Display"):
        return None
    if values.get("IdleHint") != "yes":
        return 0.0
    try:
        since_us = int(values.get("IdleSinceHint", ""))
    except ValueError:
        return None
    return max(0.0, now_s - since_us / 1e6) if since_us else None


def user_idle_seconds() -> float | None:
    """Seconds since the user last touched the keyboard or mouse; None when unknowable."""
    if sys.platform == "darwin":
        output = _run("ioreg", "-c", "IOHIDSystem", "-d", "4")
        return parse_ioreg_idle(output) if output is not None else None
    if sys.platform.startswith("linux"):
        fields = ("-p", "IdleHint", "-p", "IdleSinceHint", "-p", "Display")
        output = _run("loginctl", "show-user", str(os.getuid()), *fields)
        return parse_loginctl_user(output, time.time()) if output is not None else None
    return None


# ----------------------------------------------------------------- load
def load_per_core(minutes: int) -> float | None:
    """The load average per CPU core over the kernel's window closest to `minutes` (1, 5 or 15)."""
    try:
        averages = os.getloadavg()
    except (OSError, AttributeError):
        return None
    index = 0 if minutes <= 1 else 1 if minutes <= 5 else 2
    return averages[index] / (os.cpu_count() or 1)


def load_window(minutes: int) -> int:
    """The kernel load-average window (minutes) that `load_per_core(minutes)` reads."""
    return 1 if minutes <= 1 else 5 if minutes <= 5 else 15
