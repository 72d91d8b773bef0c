"""Set learning up with the user's consent: the schedule, then (when none is present) a trainer.

One object for the session, the app's first run and learning panel, and `macaron setup`. What
it runs is settable, so tests and previews never touch the OS or the network: `schedule_mode`
("enable", "files", "dry-run"), `pip` (the command that runs pip) and `plan` (what to install).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from macaron_local.errors import MacaronError
from macaron_local.learning_setup import choice as choices
from macaron_local.learning_setup.install import (
    InstallProgress,
    Machine,
    TrainerPlan,
    failure_line,
    plan_for,
    run_plan,
    this_machine,
)
from macaron_local.learning_setup.schedule import ScheduleOutcome, install_schedule
from macaron_local.learning_setup.status import Readiness, readiness
from macaron_local.learning_setup.trainer import Trainer, TrainerDevice, find_trainer, probe_device
from macaron_local.settings import Settings
from macaron_local.store import Store


@dataclass(frozen=True)
class SetupOutcome:
    schedule: ScheduleOutcome
    trainer: Trainer
    installed_trainer: bool  # a pip install ran and succeeded


class LearningSetup:
    def __init__(
        self,
        settings: Settings,
        *,
        schedule_mode: str | None = None,
        pip: Sequence[str] | None = None,
        plan: TrainerPlan | None = None,
        machine: Machine | None = None,
    ) -> None:
        self.settings = settings
        self.schedule_mode = schedule_mode  # None: MACARON_SCHEDULE_MODE, else "enable"
        self.pip = list(pip) if pip else None  # None: this Python's `-m pip`
        self.plan_override = plan
        self.machine = machine
        self._plan: TrainerPlan | None = None

    # ----------------------------------------------------------------- what is here
    def trainer(self) -> Trainer:
        return find_trainer(self.settings)

    def plan(self) -> TrainerPlan:
        """What setting up would install for this machine (nvidia-smi is asked once)."""
        if self.plan_override is not None:
            return self.plan_override
        if self._plan is None:
            self._plan = plan_for(self.machine or this_machine())
        return self._plan

    def device(self) -> TrainerDevice | None:
        """Import the trainer in a child process and report its device (seconds: call from a worker)."""
        backend = self.trainer().backend
        return probe_device(backend) if backend else None

    def choice(self) -> str | None:
        return choices.current_choice(self.settings)

    def readiness(self, store: Store, **options) -> Readiness:
        trainer = options.pop("trainer", None) or self.trainer()
        plan = self.plan() if trainer.backend is None else None
        return readiness(self.settings, store, trainer=trainer, plan=plan, **options)

    # ----------------------------------------------------------------- the user's answer
    def decline(self) -> None:
        """Remember "not now": the first run stops asking; the learning panel can still set it up."""
        choices.remember(self.settings, choices.DECLINED)

    def install_schedule(self) -> ScheduleOutcome:
        return install_schedule(self.settings, self.schedule_mode)

    def install_trainer(
        self,
        on_progress: Callable[[InstallProgress], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Trainer:
        """Run the plan's pip install in this app's environment; the trainer found afterwards."""
        result = run_plan(self.plan(), on_progress, pip=self.pip, cancel=cancel)
        if not result.ok:
            raise MacaronError(failure_line(result))
        found = self.trainer()
        if found.backend is None:
            missing = ", ".join(found.missing) or "the trainer"
            raise MacaronError(f"pip finished but {missing} still cannot be found in {self.plan().prefix}")
        return found

    def accept(
        self,
        *,
        with_trainer: bool = True,
        on_progress: Callable[[InstallProgress], None] | None = None,
        cancel: threading.Event | None = None,
        remember: bool = True,
    ) -> SetupOutcome:
        """Set learning up: remember the consent, install the schedule, then the trainer if none
        is importable (and `with_trainer`). The schedule goes first: it takes a moment, and a
        trainer download that fails or is cancelled leaves it in place, reported as such."""
        if remember:
            choices.remember(self.settings, choices.ACCEPTED)
        schedule = self.install_schedule()
        trainer = self.trainer()
        if trainer.backend is not None or not with_trainer or not self.plan().available:
            return SetupOutcome(schedule, trainer, False)
        return SetupOutcome(schedule, self.install_trainer(on_progress, cancel), True)
