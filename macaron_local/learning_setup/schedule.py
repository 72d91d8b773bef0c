"""Install the nightly schedule for the app's first run and `macaron setup`.

The same machinery as `macaron daemon install` (units rendered from `packaging/`, written
atomically, started by `systemctl --user` or `launchctl`), in one of three modes:
- `enable`: write the files and start the schedule (the default);
- `files`: write the files only (a container without a user service manager);
- `dry-run`: render them and write nothing (tests, and a preview).
`MACARON_SCHEDULE_MODE` picks the mode for a whole process (the app has no flags for it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from macaron_local.daemon import service, units
from macaron_local.daemon.config import daemon_config
from macaron_local.errors import InvalidInputError
from macaron_local.settings import Settings

MODES = ("enable", "files", "dry-run")
MODE_ENV = "MACARON_SCHEDULE_MODE"


def default_mode() -> str:
    mode = os.environ.get(MODE_ENV, "enable").strip() or "enable"
    if mode not in MODES:
        raise InvalidInputError(f"{MODE_ENV} must be one of {', '.join(MODES)} (got {mode!r})")
    return mode


@dataclass(frozen=True)
class ScheduleOutcome:
    """What installing did: the files (rendered always), whether they were written and started."""

    mode: str
    files: list[units.UnitFile] = field(default_factory=list)
    written: bool = False
    enabled: bool = False
    message: str = ""  # one line for the user
    problem: str | None = None  # the service manager refused: the one command to run by hand


def install_schedule(settings: Settings, mode: str | None = None) -> ScheduleOutcome:
    mode = mode or default_mode()
    if mode not in MODES:
        raise InvalidInputError(f"unknown schedule mode {mode!r} (use {', '.join(MODES)})")
    config = daemon_config(settings)
    platform = units.current_platform()
    files = units.render(settings, config, platform)
    when = f"every {config.every_minutes} min between {config.window} (local time)"
    kind = "systemd user service and timer" if platform == "linux" else "launchd agent"
    if mode == "dry-run":
        shown = ", ".join(str(f.path) for f in files)
        return ScheduleOutcome(mode, files, message=f"dry run: would write the {kind} {shown}, {when}")
    service.write_files(files)
    if mode == "files":
        return ScheduleOutcome(mode, files, written=True, message=f"wrote the {kind} (not started), {when}")
    try:
        service.enable(platform, files)
    except service.ServiceError as exc:
        return ScheduleOutcome(mode, files, written=True, message=f"wrote the {kind}", problem=str(exc))
    return ScheduleOutcome(mode, files, written=True, enabled=True, message=f"scheduled the {kind}: {when}")
