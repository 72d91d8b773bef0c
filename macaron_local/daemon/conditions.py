"""May learning run now? Every condition is checked and every "no" comes with its reason.

The probes (clock, power, idle time, load, the generating marker) are passed in as a `Probes`
value, so tests drive the real decision below with a machine on battery or a busy machine;
the defaults read the real machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from macaron_local.daemon import locks, probes
from macaron_local.daemon.config import DaemonConfig
from macaron_local.learn.memory_plan import MemoryPlan, machine_memory_plan
from macaron_local.settings import Settings
from macaron_local.store import Store


@dataclass(frozen=True)
class Probes:
    """Where each fact comes from; replace any of them to simulate a machine."""

    now: Callable[[], datetime] = datetime.now
    on_ac: Callable[[], bool | None] = probes.on_ac_power
    user_idle_s: Callable[[], float | None] = probes.user_idle_seconds
    load_per_core: Callable[[int], float | None] = probes.load_per_core
    generating: Callable[[Settings], bool] = locks.chat_generating
    #: The night's memory plan on this machine (None: not needed for this model, or unknown).
    memory_plan: Callable[[Settings], MemoryPlan | None] = machine_memory_plan


@dataclass(frozen=True)
class Check:
    """One condition: `detail` says what was seen (and, when not ok, why that stops learning)."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Verdict:
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def reasons(self) -> list[str]:
        return [c.detail for c in self.checks if not c.ok]


def new_feedback(store: Store) -> int:
    """Feedback rows newer than everything the last learning runs used."""
    used = [i for run in store.learning_runs() for i in run.feedback_ids]
    return len(store.feedback_rows(since_id=max(used, default=0)))


def check(
    settings: Settings,
    config: DaemonConfig,
    store: Store,
    probe: Probes | None = None,
    *,
    skip_window: bool = False,
) -> Verdict:
    """Evaluate every condition (all of them, so the user learns every reason at once)."""
    probe = probe or Probes()
    checks = []
    if skip_window:
        checks.append(Check("window", True, f"window {config.window} not checked (--now)"))
    else:
        now = probe.now()
        inside = config.window.contains(now.time())
        detail = f"{now:%H:%M} is {'inside' if inside else 'outside'} the learning window {config.window}"
        checks.append(Check("window", inside, detail))

    if settings.get("learning_paused"):
        checks.append(Check("paused", False, "learning is paused (resume it in the app's learning panel)"))

    ac = probe.on_ac()
    if ac is False and config.require_ac:
        checks.append(Check("power", False, "on battery power (learning waits for AC power)"))
    else:
        seen = {True: "on AC power", False: "on battery (allowed: require_ac = false)", None: "no battery found"}
        checks.append(Check("power", True, seen[ac]))

    if config.idle_minutes > 0:
        idle = probe.user_idle_s()
        if idle is None:
            checks.append(Check("user idle", True, "keyboard and mouse idle time unknown here (load decides)"))
        elif idle < config.idle_minutes * 60:
            checks.append(
                Check(
                    "user idle",
                    False,
                    f"you were active {idle / 60:.0f} min ago (learning waits for {config.idle_minutes} idle minutes)",
                )
            )
        else:
            checks.append(Check("user idle", True, f"no input for {idle / 60:.0f} min"))

    load = probe.load_per_core(config.idle_minutes)
    window = probes.load_window(config.idle_minutes)
    if load is not None and load > config.max_load:
        busy = f"the machine is busy: load {load:.2f} per core over {window} min (limit {config.max_load})"
        checks.append(Check("load", False, busy))
    else:
        checks.append(Check("load", True, "load unknown" if load is None else f"load {load:.2f} per core"))

    if probe.generating(settings):
        checks.append(Check("chat", False, "a chat reply is being generated"))
    else:
        checks.append(Check("chat", True, "no chat reply being generated"))

    plan = probe.memory_plan(settings)
    if plan is not None:  # an open chat app is never killed: the run waits, or runs the smaller plan
        checks.append(Check("memory", plan.can_run, f"memory plan {plan.mode}: {plan.reason}"))

    pending = new_feedback(store)
    if pending == 0:
        checks.append(Check("feedback", False, "nothing new to learn: no feedback since the last run"))
    elif pending < config.min_feedback:
        few = f"only {pending} new piece(s) of feedback since the last run (needs {config.min_feedback})"
        checks.append(Check("feedback", False, few))
    else:
        checks.append(Check("feedback", True, f"{pending} new piece(s) of feedback"))
    return Verdict(checks)
