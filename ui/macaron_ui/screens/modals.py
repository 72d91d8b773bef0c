"""Small modal screens: the correction editor, a text prompt, a picker, tool approval, help and
learning."""

from __future__ import annotations

import json

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Markdown, OptionList, Static, TextArea
from textual.widgets.option_list import Option

from macaron_local.session import Session
from macaron_local.tools.approval import ApprovalRequest
from macaron_ui.screens.learning_setup import LearningSetupScreen

#: Readiness states that "Set up learning" fixes (the schedule, the trainer, or both).
SETUP_FIXES = ("not_set_up", "no_trainer", "no_schedule")


class EditorScreen(ModalScreen[str | None]):
    """A multi-line editor prefilled with the text to correct; Ctrl+S saves, Esc cancels.
    Ctrl+Q with an unsaved edit warns once instead of quitting (a second Ctrl+Q quits)."""

    BINDINGS = [
        Binding("ctrl+s", "save", "Save"),
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+a", "select_all", "Select all", priority=True),
    ]

    def __init__(self, title: str, text: str) -> None:
        super().__init__()
        self.title_text = title
        self.text = text
        self.warned_on_quit = False

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide"):
            yield Label(self.title_text, classes="dialog-title")
            yield TextArea(self.text, id="editor", soft_wrap=True)
            yield Label("[dim]Ctrl+S save · Ctrl+A select all · Esc cancel[/dim]")

    def on_mount(self) -> None:
        self.query_one(TextArea).focus()

    def action_select_all(self) -> None:
        self.query_one(TextArea).select_all()

    def action_save(self) -> None:
        self.dismiss(self.query_one(TextArea).text)

    def action_cancel(self) -> None:
        self.dismiss(None)

    def may_quit(self) -> bool:
        """False (and a warning) the first time the user quits with an edit not yet saved: an
        edit is a correction the nightly run learns from, so losing it silently loses a lesson."""
        if self.warned_on_quit or self.query_one(TextArea).text == self.text:
            return True
        self.warned_on_quit = True
        self.notify("Unsaved edit: Ctrl+S saves it, Esc drops it, Ctrl+Q again quits.", severity="warning")
        return False


class TextPromptScreen(ModalScreen[str | None]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, value: str = "") -> None:
        super().__init__()
        self.title_text = title
        self.value = value

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title")
            yield Input(self.value, id="answer")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.dismiss(event.value.strip() or None)

    def action_cancel(self) -> None:
        self.dismiss(None)


class PickScreen(ModalScreen[str | None]):
    """Pick one of several options (id, label)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str, options: list[tuple[str, str]]) -> None:
        super().__init__()
        self.title_text = title
        self.options = options

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Label(self.title_text, classes="dialog-title")
            yield OptionList(*(Option(label, id=key) for key, label in self.options), id="choices")

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(event.option.id)

    def action_cancel(self) -> None:
        self.dismiss(None)


HELP = """\
# Keys

| Key | Does |
| --- | --- |
| **Enter** | send the message |
| **Up / Down** (in the input) | walk your earlier messages |
| **Esc** | stop the reply being generated |
| **Tab / Shift+Tab** | move between the input, messages and the sidebar |
| **e** (on a reply) or **F2** | correct the reply: edit it and save with Ctrl+S |
| **e** (on your message) | edit it: starts a new branch |
| **+ / -** (on a reply) | rate it good or bad |
| **r** (on a reply) or **Ctrl+R** | regenerate the reply (the old one is kept) |
| **[ / ]** (on a message) | previous / next branch |
| **t** (on a message) | unfold its thinking, tool call or tool result |
| **y / n / a / e** (tool approval) | approve, deny, approve this tool here from now on, edit the call first |
| **c** or **Ctrl+Y** | copy the reply |
| **b** | copy the reply's first code block |
| **Ctrl+N** | new chat |
| **Ctrl+F** | search all conversations |
| **Ctrl+L** | the learning panel |
| **Ctrl+P** | command palette: rename, export as Markdown, delete, switch model, roll back an expert… |
| **F1** | this help |
| **Ctrl+Q** | quit |

Corrections and ratings are stored on this computer only; the nightly learning run turns them
into a personal adapter for the expert that answered.
"""


class ToolApprovalScreen(ModalScreen["str | tuple[str, dict]"]):
    """The exact call the assistant wants to make (a diff for a file write), and the user's
    answer: approve (y), deny (n or Esc), always for this tool in this folder (a), or edit the
    arguments first (e: the corrected call runs, and is learned as a correction)."""

    BINDINGS = [
        Binding("y", "answer('approve')", "Approve"),
        Binding("n,escape", "answer('deny')", "Deny"),
        Binding("a", "answer('always')", "Always here"),
        Binding("e", "edit", "Edit"),
    ]

    def __init__(self, request: ApprovalRequest) -> None:
        super().__init__()
        self.request = request

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog wide", id="tool-approval"):
            yield Label(self.request.title, classes="dialog-title")
            with VerticalScroll(id="tool-preview"):
                yield Static(self.request.preview, markup=False)
            with Horizontal(classes="dialog-buttons"):
                yield Button("Approve (y)", id="approve", variant="success")
                yield Button("Deny (n)", id="deny", variant="error")
                yield Button("Always here (a)", id="always")
                yield Button("Edit (e)", id="edit")

    def on_mount(self) -> None:
        self.query_one("#deny", Button).focus()  # Enter on the default does nothing harmful

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "edit":
            self.action_edit()
            return
        self.dismiss(event.button.id or "deny")

    def action_answer(self, answer: str) -> None:
        self.dismiss(answer)

    def action_edit(self) -> None:
        def edited(text: str | None) -> None:
            if text is None:
                return
            try:
                arguments = json.loads(text)
            except ValueError as exc:
                self.notify(f"not JSON: {exc}", severity="error")
                return
            if not isinstance(arguments, dict):
                self.notify("the arguments must be a JSON object", severity="error")
                return
            self.dismiss(("edit", arguments))

        current = json.dumps(dict(self.request.arguments), indent=2, ensure_ascii=False)
        self.app.push_screen(EditorScreen("Edit the call's arguments (JSON), then Ctrl+S", current), edited)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape,f1,q", "close", "Close")]

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog wide"):
            yield Markdown(HELP)
            yield Button("Close", id="close")

    def on_button_pressed(self) -> None:
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)


class LearningScreen(ModalScreen[None]):
    """When learning last ran, what it used, the held-out scores, the decision and why."""

    BINDINGS = [Binding("escape", "close", "Close"), Binding("p", "toggle_pause", "Pause/resume")]

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog wide"):
            with Horizontal(id="learning-buttons"):
                yield Button("Set up learning", id="setup", variant="primary")
                yield Button("Pause learning", id="toggle")
                yield Button("Close", id="close")
            yield Markdown(self.render_status(), id="learning")

    def on_mount(self) -> None:
        self._update()

    def render_status(self) -> str:
        status = self.session.learning_status()
        lines = ["# Learning", "", *self.render_readiness()]
        lines += ["", "## Serving now", ""]
        deployed = self.session.deployed_versions()
        if not deployed:
            lines.append("Every expert answers as shipped: no learned version is deployed yet.")
        for slot, version in sorted(deployed.items()):
            learned = len(version.feedback_ids)
            lines.append(
                f"- **{slot}**: learned version `{version.id}` from {learned} piece{'' if learned == 1 else 's'} "
                f"of feedback, {version.created_at[:16].replace('T', ' ')} UTC (roll back from the palette)"
            )
        lines.append("")
        daemon = self.session.daemon_status()
        lines += ["## Nightly run", "", daemon.summary(), ""]
        for past in daemon.recent[1:4]:
            lines.append(f"- {past.started_at[:16].replace('T', ' ')} UTC: {past.outcome} · {past.summary}")
        lines += ["", "## Learning runs", ""]
        if not status.runs:
            lines.append("No learning run yet.")
        for run in status.runs:
            lines.append(
                f"- **{run.started_at[:16].replace('T', ' ')}** {run.slot or ''}: {run.decision or run.status}"
                f" · {run.reason or ''}"
            )
        return "\n".join(lines)

    def render_readiness(self) -> list[str]:
        """What happens to the feedback waiting now, and the one fix: the core's words."""
        ready = self.session.learning_readiness()
        lines = [f"**{ready.sentence()}**"]
        if ready.action_app and ready.state not in SETUP_FIXES:
            lines.append(ready.action_app)
        if ready.state in SETUP_FIXES:
            lines.append("**Set up learning** (above) fixes it.")
        waiting = ready.pending_feedback
        lines += [
            "",
            f"{waiting} new piece{'' if waiting == 1 else 's'} of feedback (corrections, ratings, regenerations) "
            f"since the last run; a nightly run needs {ready.min_feedback}.",
        ]
        return lines

    def refresh_status(self) -> None:
        """Redraw (a run may just have deployed a new version)."""
        self._update()

    def _update(self) -> None:
        self.query_one("#learning", Markdown).update(self.render_status())
        paused = self.session.learning_status().paused
        self.query_one("#toggle", Button).label = "Resume learning" if paused else "Pause learning"
        self.query_one("#setup", Button).display = self.session.learning_readiness().state in SETUP_FIXES

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "toggle":
            self.action_toggle_pause()
        elif event.button.id == "setup":
            self.app.push_screen(LearningSetupScreen(self.session), lambda _: self._update())
        else:
            self.dismiss(None)

    def action_toggle_pause(self) -> None:
        self.session.set_learning_paused(not self.session.learning_status().paused)
        self._update()

    def action_close(self) -> None:
        self.dismiss(None)
