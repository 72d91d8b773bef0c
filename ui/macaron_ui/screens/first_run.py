"""First run: no model chosen yet. Offer the embedded model (ready now, offline) or Tall
(a large download, with its size against the free disk, progress and cancel).

Tall's size on the offer comes from its manifest's stated upper bounds (the base plus the four
experts as published, and the converted experts on disk): the hub is not asked until the user
picks Tall, since nothing may reach the network before an explicit download. Once picked, the
exact total from the hub's file metadata is shown while the download runs."""

from __future__ import annotations

import shutil
import threading

from textual import work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label, ProgressBar

from macaron_local.catalog import Catalog
from macaron_local.download import DownloadCancelled, pull
from macaron_local.errors import MacaronError
from macaron_local.fit import machine_verdict
from macaron_local.pull_plan import PullPlan, plan_pull

GB = 1e9  # decimal, as download sizes are quoted


def tall_offer(plan: PullPlan, free_bytes: int) -> tuple[str, bool]:
    """The Tall button's text, and whether this disk can hold the pull (files + converted experts)."""
    download = plan.total_bytes if plan.total_bytes is not None else plan.bound_bytes
    about = "" if plan.total_bytes is not None else "about "
    text = (
        f"Tall: Qwen3.6-35B-A3B + 4 experts · download {about}{download / GB:.0f} GB, "
        f"needs {plan.disk_bytes / GB:.0f} GB of disk ({free_bytes / GB:.0f} GB free)"
    )
    return text, free_bytes >= plan.disk_bytes


class FirstRunScreen(ModalScreen[str | None]):
    """Dismisses with the chosen model's name (or None if the user quits)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, catalog: Catalog) -> None:
        super().__init__()
        self.catalog = catalog
        self.cancel = threading.Event()
        self.downloading = False
        self.total_text = ""  # " · 59.8 GB in all" once the hub has said

    def compose(self) -> ComposeResult:
        plan = plan_pull(self.catalog, self.catalog.get("tall"), online=False)
        offer, fits = tall_offer(plan, shutil.disk_usage(self.catalog.settings.data_dir).free)
        with Vertical(classes="dialog wide", id="first-run"):
            yield Label("Welcome to macaron-local. Which model should answer you?", classes="dialog-title")
            yield Button("Embedded: SmolLM2-135M · ready now, works offline", id="embedded", variant="primary")
            yield Button(offer, id="tall", disabled=not fits)
            yield Label(machine_verdict(self.catalog.settings.models_dir)[1], id="tall-fit")
            yield Label("", id="download-status")
            yield ProgressBar(id="download-progress", show_eta=True)

    def on_mount(self) -> None:
        self.query_one(ProgressBar).display = False

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "embedded":
            self.dismiss("embedded")
        elif event.button.id == "tall" and not self.downloading:
            self.downloading = True
            self.query_one("#embedded", Button).disabled = True
            event.button.label = "Downloading… press Esc to cancel (it resumes next time)"
            self.query_one(ProgressBar).display = True
            self.download()

    def action_cancel(self) -> None:
        if self.downloading:
            self.cancel.set()
        else:
            self.dismiss(None)

    def _progress(self, name: str, done: int, total: int | None) -> None:
        if self.cancel.is_set():
            raise DownloadCancelled("download cancelled; choose Tall again to resume")
        self.app.call_from_thread(self._show_progress, name, done, total)

    def _show_progress(self, name: str, done: int, total: int | None) -> None:
        bar = self.query_one(ProgressBar)
        bar.update(total=total, progress=done)
        self.query_one("#download-status", Label).update(f"{name}: {done / GB:.2f} GB{self.total_text}")

    @work(thread=True, exclusive=True)
    def download(self) -> None:
        try:
            tall = self.catalog.get("tall")
            exact = plan_pull(self.catalog, tall).total_bytes  # the hub's sizes; None offline
            if exact is not None:
                self.app.call_from_thread(self._show_total, exact)
            pull(self.catalog, tall, progress=self._progress)
        except MacaronError as exc:
            self.app.call_from_thread(self._failed, str(exc))
            return
        self.app.call_from_thread(self.dismiss, "tall")

    def _show_total(self, total: int) -> None:
        self.total_text = f" · {total / GB:.1f} GB in all (sizes from the hub)"
        self.query_one("#download-status", Label).update(f"downloading{self.total_text}")

    def _failed(self, message: str) -> None:
        self.downloading = False
        self.cancel.clear()
        self.query_one("#download-status", Label).update(f"[red]{message}[/red]")
        self.query_one("#embedded", Button).disabled = False
        self.query_one("#tall", Button).label = "Tall: try the download again (it resumes)"
