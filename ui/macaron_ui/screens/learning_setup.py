"""Set nightly learning up, with consent: shown once on the first run (after the model is
chosen) and from the learning panel whenever something is missing.

It says what is here and what setting up does: the schedule (its window), and where no trainer
is importable, the trainer this machine gets with its download size. "Set up learning" installs
them in a worker (the pip download with a progress bar; Esc cancels it); "Not now" is
remembered and can be undone from the learning panel. Every decision and install is the
session's (`session.learning_setup`); this screen only shows them.
"""

from __future__ import annotations

import threading

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, ProgressBar, Static

from macaron_local.errors import MacaronError
from macaron_local.learning_setup.install import InstallProgress, human_bytes
from macaron_local.learning_setup.setup import SetupOutcome
from macaron_local.session import Session


class LearningSetupScreen(ModalScreen[str | None]):
    """Dismisses with "accepted", "declined", or None (closed while nothing was decided)."""

    BINDINGS = [Binding("escape", "not_now", "Not now")]

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session
        self.setup = session.learning_setup
        self.cancel = threading.Event()
        self.installing = False
        self.outcome: SetupOutcome | None = None  # what the last "Set up learning" did (tests read it)

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide", id="learning-setup"):
            yield Label("Learn from your corrections, every night, on this computer?", classes="dialog-title")
            yield Static(self.plan_text(), id="setup-plan")
            with Horizontal(id="setup-buttons"):
                yield Button("Set up learning", id="setup-accept", variant="primary")
                yield Button("Not now (Esc)", id="setup-decline")
            yield Label("", id="setup-status")
            yield ProgressBar(id="setup-progress", show_eta=True)
            yield Static("", id="setup-result")
            yield Button("Done", id="setup-done", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#setup-progress").display = False
        self.query_one("#setup-done").display = False
        self.query_one("#setup-accept", Button).focus()

    def plan_text(self) -> str:
        """What setting up does here, and what happens to feedback at this moment."""
        status = self.session.learning_readiness()
        trainer = self.setup.trainer()
        lines = ["Setting up learning does this, and nothing leaves the computer:", ""]
        if trainer.backend:
            lines.append(f"• Trainer: {trainer.label} is installed already.")
        else:
            lines.append(f"• Trainer: none is installed. Installs {self.setup.plan().summary()}.")
        if status.schedule_installed:
            lines.append("• Schedule: the nightly run is installed already.")
        else:
            lines.append(
                f"• Schedule: starts a learning run in the window {status.window} (local time), "
                "only when the computer is idle (and on AC power, if it has a battery); a new version is "
                "deployed only if it does better."
            )
        lines += ["", f"[dim]Now: {status.sentence()}[/dim]"]
        if status.choice == "declined":
            lines.append("[dim]You chose “not now” before; you can change your mind here.[/dim]")
        return "\n".join(lines)

    # ----------------------------------------------------------------- answers
    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "setup-accept" and not self.installing:
            self.start_setup()
        elif event.button.id == "setup-decline":
            self.action_not_now()
        elif event.button.id == "setup-done":
            self.dismiss("accepted")

    def action_not_now(self) -> None:
        if self.installing:
            self.cancel.set()
            self.query_one("#setup-status", Label).update("Cancelling the download…")
            return
        if self.outcome is not None:
            self.dismiss("accepted")
            return
        self.setup.decline()
        self.dismiss("declined")

    def start_setup(self) -> None:
        self.installing = True
        self.query_one("#setup-buttons").display = False
        self.query_one("#setup-status", Label).update("Setting up… (Esc cancels a download)")
        self.run_setup()

    @work(thread=True, exclusive=True, group="learning-setup")
    def run_setup(self) -> None:
        try:
            outcome = self.setup.accept(on_progress=self._progress, cancel=self.cancel)
        except MacaronError as exc:
            self.app.call_from_thread(self._finished, None, str(exc))
            return
        self.app.call_from_thread(self._finished, outcome, None)

    def _progress(self, update: InstallProgress) -> None:
        self.app.call_from_thread(self._show_progress, update)

    def _show_progress(self, update: InstallProgress) -> None:
        bar = self.query_one("#setup-progress", ProgressBar)
        bar.display = True
        bar.update(total=max(update.total_bytes, 1), progress=update.done_bytes)
        done, total = human_bytes(update.done_bytes), human_bytes(update.total_bytes)
        line = update.line.strip()[:70]
        status = f"Installing the trainer ({update.step}/{update.steps}): {done} of about {total} · {line}"
        self.query_one("#setup-status", Label).update(status)

    def _finished(self, outcome: SetupOutcome | None, error: str | None) -> None:
        self.installing = False
        self.outcome = outcome
        self.query_one("#setup-plan").display = False  # what was planned is now what was done, below
        lines = []
        if outcome is not None:
            schedule = outcome.schedule
            lines.append(f"Schedule: {schedule.message}.")
            if schedule.problem:
                lines.append(f"[yellow]{schedule.problem}[/yellow]")
            if outcome.installed_trainer:
                lines.append(f"Trainer: {outcome.trainer.label} installed into {self.setup.plan().prefix}.")
        if error:
            lines.append(f"[red]{error}[/red]")
        lines.append(self.session.learning_readiness().sentence())
        self.query_one("#setup-status", Label).update("Done." if error is None else "Not finished.")
        self.query_one("#setup-result", Static).update("\n".join(lines))
        self.query_one("#setup-done", Button).display = True
        self.query_one("#setup-done", Button).focus()
