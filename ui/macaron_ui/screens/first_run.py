"""First run: no model chosen yet. Offer the embedded model (ready now, offline) or Tall
(a large download, with its size against the free disk, progress and cancel)."""

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

GB = 1e9  # decimal, as download sizes are quoted


class FirstRunScreen(ModalScreen[str | None]):
    """Dismisses with the chosen model's name (or None if the user quits)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, catalog: Catalog) -> None:
        super().__init__()
        self.catalog = catalog
        self.cancel = threading.Event()
        self.downloading = False

    def compose(self) -> ComposeResult:
        tall = self.catalog.get("tall")
        size = (tall.base.size or 0) / GB
        free = shutil.disk_usage(self.catalog.settings.data_dir).free / GB
        with Vertical(classes="dialog wide", id="first-run"):
            yield Label("Welcome to macaron-local. Which model should answer you?", classes="dialog-title")
            yield Button("Embedded: SmolLM2-135M · ready now, works offline", id="embedded", variant="primary")
            yield Button(
                f"Tall: Qwen3.6-35B-A3B + 4 experts · download about {size:.0f} GB ({free:.0f} GB free)",
                id="tall",
                disabled=free < size,
            )
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
        self.query_one("#download-status", Label).update(f"{name}: {done / GB:.2f} GB")

    @work(thread=True, exclusive=True)
    def download(self) -> None:
        try:
            pull(self.catalog, self.catalog.get("tall"), progress=self._progress)
        except MacaronError as exc:
            self.app.call_from_thread(self._failed, str(exc))
            return
        self.app.call_from_thread(self.dismiss, "tall")

    def _failed(self, message: str) -> None:
        self.downloading = False
        self.cancel.clear()
        self.query_one("#download-status", Label).update(f"[red]{message}[/red]")
        self.query_one("#embedded", Button).disabled = False
        self.query_one("#tall", Button).label = "Tall: try the download again (it resumes)"
