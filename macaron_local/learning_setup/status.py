"""Will the feedback just given be learned from, when, and if not, why not and what fixes it.

`readiness` is the one place that answers; the app's notices, its learning panel, `macaron
setup` and `macaron doctor` all print what it returns. It reads the machine each time: is a
trainer importable, is the schedule installed (and started, when the OS can say), is learning
paused, how much feedback waits against the daemon's `min_feedback`, and when the next
scheduled start is. The first thing missing decides the message, with the one action that
fixes it; a setup that is complete names the next window.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta

from macaron_local.daemon import probes, service, units
from macaron_local.daemon.conditions import new_feedback
from macaron_local.daemon.config import DaemonConfig, daemon_config
from macaron_local.daemon.locks import daemon_running
from macaron_local.errors import InvalidInputError
from macaron_local.learning_setup import choice as choices
from macaron_local.learning_setup.install import TrainerPlan, plan_for, this_machine
from macaron_local.learning_setup.trainer import LABELS, Trainer, find_trainer
from macaron_local.settings import Settings
from macaron_local.store import Store

#: States, in the order they are looked for.
STATES = (
    "unsupported",  # no scheduler on this OS
    "settings_error",  # a broken [daemon] table
    "not_set_up",  # neither a trainer nor the schedule
    "no_trainer",
    "no_schedule",
    "schedule_stopped",  # files written, the service manager has not started them
    "paused",
    "needs_feedback",  # fewer than min_feedback new pieces since the last run
    "ready",
)
SETUP_APP = "Ctrl+L, then Set up learning"
SETUP_CLI = "`macaron setup`"


@dataclass(frozen=True)
class Readiness:
    state: str
    will_learn: bool  # the nightly run will learn from what is waiting, at `next_start`
    reason: str  # a clause: why not, or when
    action_app: str | None  # the one action that fixes it, worded for the app
    action_cli: str | None  # ... and for a terminal
    trainer: str | None  # torch | mlx | None
    trainer_missing: tuple[str, ...]
    trainer_plan: str | None  # what setting up would install, when no trainer is present
    schedule_installed: bool
    schedule_state: str  # from the service manager: active | inactive | loaded | unknown | not installed
    schedule_files: list[str] = field(default_factory=list)
    window: str = "?"
    next_start: str | None = None  # local time, ISO
    next_start_text: str | None = None  # "tonight at 02:00"
    pending_feedback: int = 0
    min_feedback: int = 0
    paused: bool = False
    choice: str | None = None  # accepted | declined | None (never asked)
    running: bool = False

    def sentence(self, subject: str = "your feedback") -> str:
        """ "macaron will learn from your feedback tonight at 02:00 ..." or why it will not."""
        if self.will_learn or self.state == "needs_feedback":
            return f"macaron will learn from {subject} {self.reason}."
        return f"macaron will not learn from {subject}, because {self.reason}."

    def notice(self, saved: str = "Correction saved.", subject: str = "it", where: str = "app") -> str:
        """The message shown after feedback is stored: what happens next, and the fix if any."""
        action = self.action_app if where == "app" else self.action_cli
        return " ".join(part for part in (saved, self.sentence(subject), action) if part)

    def as_dict(self) -> dict:
        data = asdict(self)
        data["trainer_missing"] = list(self.trainer_missing)
        data["summary"] = self.sentence()
        return data


def next_start(config: DaemonConfig, now: datetime) -> datetime:
    """The first scheduled start after `now` (local time, naive)."""
    today = now.replace(second=0, microsecond=0)
    candidates = []
    for days in (0, 1):
        for hour, minute in config.fire_times():
            moment = today.replace(hour=hour, minute=minute) + timedelta(days=days)
            if moment > now:
                candidates.append(moment)
    return min(candidates)


def describe_when(now: datetime, start: datetime) -> str:
    """ "tonight at 02:00", "today at 14:00", "tomorrow at 14:00"."""
    clock = f"{start:%H:%M}"
    night = start.hour >= 18 or start.hour < 6
    if night and start - now < timedelta(hours=24):
        return f"tonight at {clock}"
    if start.date() == now.date():
        return f"today at {clock}"
    if start.date() == now.date() + timedelta(days=1):
        return f"tomorrow at {clock}"
    return f"on {start:%a %d %b} at {clock}"


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def readiness(
    settings: Settings,
    store: Store,
    *,
    trainer: Trainer | None = None,
    plan: TrainerPlan | None = None,
    now: datetime | None = None,
    ask_os: bool = True,
) -> Readiness:
    """What will happen to the feedback waiting now (see the module's docstring)."""
    trainer = trainer or find_trainer(settings)
    now = now or datetime.now()
    chosen = choices.current_choice(settings)
    paused = bool(settings.get("learning_paused"))
    pending = new_feedback(store)
    common = {
        "trainer": trainer.backend,
        "trainer_missing": trainer.missing,
        "pending_feedback": pending,
        "paused": paused,
        "choice": chosen,
        "running": daemon_running(settings),
    }
    try:
        platform = units.current_platform()
    except InvalidInputError as exc:
        rest = {k: v for k, v in common.items() if k not in ("trainer", "trainer_missing")}
        return Readiness("unsupported", False, str(exc), None, None, None, (), None, False, "not installed", **rest)
    files = service.installed_files(platform)
    state = "not installed" if not files else (service.schedule_state(platform) if ask_os else "unknown")
    installed = bool(files)
    schedule = {"schedule_installed": installed, "schedule_state": state, "schedule_files": files}
    if trainer.backend is None:
        plan = plan or plan_for(this_machine())
        plan_text = plan.summary()
    else:
        plan_text = None

    def result(name: str, will: bool, reason: str, app: str | None, cli: str | None, **more) -> Readiness:
        return Readiness(name, will, reason, app, cli, trainer_plan=plan_text, **schedule, **common, **more)

    try:
        config = daemon_config(settings)
    except InvalidInputError as exc:
        return result("settings_error", False, f"the [daemon] settings are broken ({exc})", None, None)
    start = next_start(config, now)
    timing = {
        "window": str(config.window),
        "next_start": start.isoformat(timespec="minutes"),
        "next_start_text": describe_when(now, start),
        "min_feedback": config.min_feedback,
    }
    declined = "you chose not to set up learning" if chosen == choices.DECLINED else ""
    fix_app, fix_cli = f"Set it up: {SETUP_APP}.", f"Set it up: {SETUP_CLI}."
    if trainer.backend is None:
        missing_trainer = "no trainer (PyTorch or MLX) is installed"
        if plan is not None and not plan.available:
            why = f"{missing_trainer}, and {plan.blocked}"
            return result("no_trainer", False, why, None, None, **timing)
        if not installed:
            what = "there is no trainer (PyTorch or MLX) and no nightly schedule"
            why = f"{declined}, so {what}" if declined else f"learning is not set up on this computer: {what}"
            return result("not_set_up", False, why, fix_app, fix_cli, **timing)
        why = f"{declined}, so {missing_trainer}" if declined else missing_trainer
        app, cli = f"Install one: {SETUP_APP}.", f"Install one: {SETUP_CLI}."
        return result("no_trainer", False, why, app, cli, **timing)
    label = LABELS[trainer.backend]
    if not installed:
        what = f"the nightly schedule is not installed ({label} is ready)"
        why = f"{declined}, so {what}" if declined else what
        app, cli = f"Install it: {SETUP_APP}.", f"Install it: {SETUP_CLI}."
        return result("no_schedule", False, why, app, cli, **timing)
    manager = "systemd" if platform == "linux" else "launchd"
    # launchctl answers "unknown" when the agent is not loaded; systemctl when it cannot be reached.
    not_loaded = platform == "macos" and state == "unknown" and ask_os
    if state in ("inactive", "failed") or not_loaded:
        seen = "has not loaded it" if not_loaded else f"reports it {state}"
        why = f"the nightly schedule is installed but {manager} {seen}"
        command = (
            f"systemctl --user enable --now {units.TIMER_NAME}"
            if platform == "linux"
            else f"launchctl bootstrap gui/$(id -u) {files[0]}"
        )
        return result("schedule_stopped", False, why, f"Start it: `{command}`.", f"Start it: `{command}`.", **timing)
    unasked = f"; {manager} could not be asked whether the schedule runs" if state == "unknown" and ask_os else ""
    if paused:
        app, cli = "Resume it: Ctrl+L, then p.", "Resume it in the app's learning panel (Ctrl+L, then p)."
        return result("paused", False, "learning is paused", app, cli, **timing)
    if pending < config.min_feedback:
        more = config.min_feedback - pending
        needed = (
            "1 more correction, rating or regeneration is"
            if more == 1
            else f"{more} more corrections, ratings or regenerations are"
        )
        waits = f"the nightly run waits for {config.min_feedback} new pieces of feedback; there are {pending}"
        why = f"once {needed} given ({waits})"
        return result("needs_feedback", False, why + unasked, None, None, **timing)
    conditions = f"once the computer has been idle {config.idle_minutes} min" if config.idle_minutes else ""
    if config.require_ac and probes.on_ac_power() is not None:
        conditions += " and is on AC power" if conditions else "once the computer is on AC power"
    when = f"{timing['next_start_text']} (window {config.window}{', ' + conditions if conditions else ''})"
    if common["running"]:
        when = f"in the next run, {when}; a learning run is in progress now"
    return result("ready", True, when + unasked, None, None, **timing)
