"""What `macaron daemon status` and the app's learning panel show about the daemon.

One read-only snapshot: is the schedule installed (and active, when asked), the window, whether
a run holds the lock now, the last daemon runs (including the nights it did not learn, and
why), the store's learning runs, and where the log is. A broken `[daemon]` table is reported
in the snapshot rather than raised, so the status of a misconfigured daemon can still be read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from macaron_local.daemon import history, service, units
from macaron_local.daemon.conditions import Check, Probes, check
from macaron_local.daemon.config import daemon_config
from macaron_local.daemon.history import DaemonRun
from macaron_local.daemon.locks import daemon_running
from macaron_local.daemon.logs import log_path
from macaron_local.errors import InvalidInputError
from macaron_local.settings import Settings
from macaron_local.store import LearningRun, Store

RECENT = 10


@dataclass(frozen=True)
class DaemonStatus:
    platform: str | None
    installed: list[str]
    schedule: str  # active | inactive | loaded | unknown | not installed (from the service manager)
    window: str
    every_minutes: int | None
    running: bool
    log_file: str
    recent: list[DaemonRun] = field(default_factory=list)  # newest first
    learning_runs: list[LearningRun] = field(default_factory=list)  # newest first
    conditions: list[Check] = field(default_factory=list)
    config_error: str | None = None

    def summary(self) -> str:
        """One line for the app: installed or not, the window, and the last outcome."""
        where = "installed" if self.installed else "not installed (run `macaron daemon install`)"
        line = f"Nightly learning is {where}; window {self.window}."
        if self.running:
            line += " A learning run is in progress now."
        if self.recent:
            last = self.recent[0]
            line += f" Last run {last.started_at[:16].replace('T', ' ')} UTC: {last.outcome} ({last.summary})."
        if self.config_error:
            line += f" Settings problem: {self.config_error}"
        return line


def daemon_status(
    settings: Settings, store: Store, *, ask_os: bool = True, conditions: bool = False, probe: Probes | None = None
) -> DaemonStatus:
    """The snapshot; `ask_os` queries systemctl/launchctl, `conditions` evaluates them now."""
    try:
        platform: str | None = units.current_platform()
    except InvalidInputError:
        platform = None
    installed = service.installed_files(platform) if platform else []
    if not installed:
        schedule = "not installed"
    else:
        schedule = service.schedule_state(platform) if ask_os and platform else "unknown"
    config_error, window, every, checks = None, "?", None, []
    try:
        config = daemon_config(settings)
        window, every = str(config.window), config.every_minutes
        if conditions:
            checks = check(settings, config, store, probe).checks
    except InvalidInputError as exc:
        config_error = str(exc)
    return DaemonStatus(
        platform=platform,
        installed=installed,
        schedule=schedule,
        window=window,
        every_minutes=every,
        running=daemon_running(settings),
        log_file=str(log_path(settings)),
        recent=history.read_history(settings)[::-1][:RECENT],
        learning_runs=store.learning_runs()[::-1][:RECENT],
        conditions=checks,
        config_error=config_error,
    )
