"""Install and remove the scheduler's files, and ask the OS whether the schedule is active.

Files are written atomically; enabling goes through the OS's own tool (`systemctl --user`,
`launchctl`). When that tool is missing or refuses (a container without a user bus), the files
stay written and the error says the one command to run by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from macaron_local.daemon.units import LAUNCHD_LABEL, TIMER_NAME, UnitFile, launchd_dir, systemd_dir
from macaron_local.errors import MacaronError
from macaron_local.settings import write_private_atomic

TOOL_TIMEOUT_S = 30


class ServiceError(MacaronError):
    """The files were handled but the OS's service manager could not be told."""


@dataclass(frozen=True)
class ToolResult:
    ok: bool
    output: str


def _tool(*argv: str) -> ToolResult:
    if shutil.which(argv[0]) is None:
        return ToolResult(False, f"{argv[0]} not found")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT_S, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return ToolResult(False, str(exc))
    text = (done.stdout + done.stderr).strip()
    return ToolResult(done.returncode == 0, " ".join(text.split()))


def write_files(files: list[UnitFile]) -> None:
    for unit in files:
        unit.path.parent.mkdir(parents=True, exist_ok=True)
        write_private_atomic(unit.path, unit.content.encode("utf-8"))


def enable(platform: str, files: list[UnitFile]) -> None:
    """Tell the service manager about freshly written files and start the schedule."""
    if platform == "linux":
        manual = f"run: systemctl --user daemon-reload && systemctl --user enable --now {TIMER_NAME}"
        for argv in (("systemctl", "--user", "daemon-reload"), ("systemctl", "--user", "enable", "--now", TIMER_NAME)):
            result = _tool(*argv)
            if not result.ok:
                raise ServiceError(f"the files are written but systemd refused them ({result.output}); {manual}")
        return
    plist = str(files[0].path)
    domain = f"gui/{os.getuid()}"
    _tool("launchctl", "bootout", f"{domain}/{LAUNCHD_LABEL}")  # an older copy, if loaded
    result = _tool("launchctl", "bootstrap", domain, plist)
    if not result.ok:
        legacy = _tool("launchctl", "load", "-w", plist)
        if not legacy.ok:
            manual = f"run: launchctl bootstrap {domain} {plist}"
            raise ServiceError(f"the agent is written but launchd refused it ({result.output}); {manual}")


def disable(platform: str) -> list[str]:
    """Stop the schedule (best effort: the files are removed either way); returns notes."""
    notes = []
    if platform == "linux":
        result = _tool("systemctl", "--user", "disable", "--now", TIMER_NAME)
        if not result.ok:
            notes.append(f"systemctl: {result.output}")
    else:
        result = _tool("launchctl", "bootout", f"gui/{os.getuid()}/{LAUNCHD_LABEL}")
        if not result.ok:
            notes.append(f"launchctl: {result.output}")
    return notes


def reload_after_removal(platform: str) -> None:
    if platform == "linux":
        _tool("systemctl", "--user", "daemon-reload")


def installed_files(platform: str) -> list[str]:
    """Which of the daemon's files exist where the OS looks for them."""
    if platform == "linux":
        candidates = [systemd_dir() / "macaron-learn.service", systemd_dir() / TIMER_NAME]
    else:
        candidates = [launchd_dir() / f"{LAUNCHD_LABEL}.plist"]
    return [str(path) for path in candidates if path.exists()]


def schedule_state(platform: str) -> str:
    """The schedule as the service manager reports it (active, inactive, loaded), or unknown."""
    if platform == "linux":
        result = _tool("systemctl", "--user", "is-active", TIMER_NAME)
        return result.output if result.output in ("active", "inactive", "failed", "activating") else "unknown"
    result = _tool("launchctl", "print", f"gui/{os.getuid()}/{LAUNCHD_LABEL}")
    return "loaded" if result.ok else "unknown"


def remove_files(platform: str) -> list[str]:
    """Delete the daemon's files; returns the paths removed."""
    removed = installed_files(platform)
    for path in removed:
        os.unlink(path)
    return removed
