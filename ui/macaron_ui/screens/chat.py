"""The main screen: conversations on the left, the transcript and the input on the right.

All work that blocks (loading the model, generating, writing feedback) happens in workers or in
the session; this screen only turns keys into session calls and session results into widgets.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from pathlib import Path

from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, LoadingIndicator, OptionList, Static

from macaron_local.errors import MacaronError
from macaron_local.session import Reply, Session, TranscriptItem
from macaron_local.tools.agent import Agent
from macaron_local.tools.approval import ApprovalRequest, Approvals
from macaron_local.tools.toolbox import Toolbox
from macaron_ui.screens.modals import (
    EditorScreen,
    HelpScreen,
    LearningScreen,
    PickScreen,
    TextPromptScreen,
    ToolApprovalScreen,
)
from macaron_ui.widgets.conversations import ConversationList
from macaron_ui.widgets.message import MessageView
from macaron_ui.widgets.prompt import PromptInput

WELCOME = (
    "# macaron\n\nA personal assistant that runs on this computer and learns from your corrections.\n\n"
    "Type below and press **Enter**. Select a reply (Tab or click) and press **e** to correct it, "
    "**+**/**-** to rate it, **r** to regenerate. **F1** lists every key; **Ctrl+P** opens the command palette."
)


class ChatScreen(Screen):
    BINDINGS = [
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("escape", "cancel", "Stop", show=False),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("f2", "correct", "Correct"),
        Binding("ctrl+y", "copy_reply", "Copy"),
        Binding("ctrl+f", "focus_search", "Search"),
        Binding("ctrl+l", "learning", "Learning"),
        Binding("f1", "help", "Keys"),
    ]

    def __init__(self, session: Session) -> None:
        super().__init__()
        self.session = session
        self.cancel_event = threading.Event()
        self.generating = False
        self.turns_shown = 0  # replies finished and redrawn (tests and status watchers wait on it)
        self.updates_told: list[str] = []  # "L0 Chat updated: ..." notices shown so far
        self.learning_notices: list[str] = []  # what was said after each piece of feedback
        self._unsubscribe: Callable[[], None] | None = None

    # ----------------------------------------------------------------- layout
    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        with Horizontal():
            with Vertical(id="sidebar"):
                yield Input(placeholder="Search all conversations", id="search")
                yield ConversationList(id="conversations")
            with Vertical(id="main"):
                yield VerticalScroll(id="transcript")
                with Horizontal(id="statusbar"):
                    yield LoadingIndicator(id="busy")
                    yield Static("", id="status")
                yield PromptInput(id="prompt")
        yield Footer()

    async def on_mount(self) -> None:
        self.query_one("#transcript", VerticalScroll).anchor()
        self.query_one("#busy").display = False
        recent = self.session.list_conversations(limit=1)
        if recent and self.session.conversation_id is None:
            self.session.open_conversation(recent[0].id)  # carry on where the user left off
        await self.show_transcript()
        self.refresh_conversations()
        self.query_one(PromptInput).focus()
        self._unsubscribe = self.session.on_adapters_changed(self._adapters_changed)
        self.load_model()

    async def on_unmount(self) -> None:
        """Leaving by any way (Ctrl+Q already did this): the reply being written stops and its
        worker finishes (the turn is stored) before the app closes the session under it."""
        if self._unsubscribe is not None:
            self._unsubscribe()
        await self.stop_generating()

    # ----------------------------------------------------------------- learned adapters
    def _adapters_changed(self) -> None:
        """From the session's watchdog thread: the store changed; maybe a new deployment."""
        with contextlib.suppress(RuntimeError):  # the app is shutting down
            self.app.call_from_thread(self.announce_updates)

    def announce_updates(self, notices: tuple[str, ...] | list[str] | None = None) -> None:
        """Tell the user what the nightly run changed; it is served from the next turn."""
        for notice in self.session.pending_updates() if notices is None else notices:
            self.updates_told.append(notice)
            self.notify(notice, title="Learning", timeout=10)
        if isinstance(self.app.screen, LearningScreen):
            self.app.screen.refresh_status()

    # ----------------------------------------------------------------- model
    def set_status(self, text: str, busy: bool = False) -> None:
        self.query_one("#status", Static).update(text)
        self.query_one("#busy").display = busy

    @work(thread=True, exclusive=True, group="model")
    def load_model(self) -> None:
        name = self.session.manifest.name
        self.app.call_from_thread(self.set_status, f"Loading {name}…", True)
        try:
            self.session.load() if not self.session.loaded else None
        except MacaronError as exc:
            self.app.call_from_thread(self.set_status, f"[red]{exc}[/red]")
            return
        self.app.call_from_thread(self.set_status, f"{name} ready · {self.session.manifest.description}")

    # ----------------------------------------------------------------- transcript
    @property
    def transcript(self) -> VerticalScroll:
        return self.query_one("#transcript", VerticalScroll)

    async def show_transcript(self) -> None:
        await self.transcript.remove_children()
        items = self.session.transcript()
        if not items:
            await self.transcript.mount(MessageView("welcome", WELCOME))
            return
        await self.transcript.mount_all(self._view(item) for item in items)
        self.transcript.scroll_end(animate=False)

    def _view(self, item: TranscriptItem) -> MessageView:
        view = MessageView(item.role, item.content, item.message_id, item.tag, item.thinking)
        view.marks = item.marks
        return view

    def selected(self, role: str = "assistant") -> MessageView | None:
        """The focused message of that role, else the last one."""
        focused = self.focused
        if isinstance(focused, MessageView) and focused.role == role and focused.message_id:
            return focused
        views = [v for v in self.query(MessageView) if v.role == role and v.message_id]
        return views[-1] if views else None

    # ----------------------------------------------------------------- sending
    @on(Input.Submitted, "#prompt")
    def send(self, event: Input.Submitted) -> None:
        text = event.value
        if not text.strip():
            return
        if self.generating:
            self.notify("Still answering: press Esc to stop it first.", severity="warning")
            return
        prompt = self.query_one(PromptInput)
        prompt.remember(text)
        prompt.value = ""
        if self.tools_enabled():
            self.begin_request()
            self.run_worker(self.show_request(text))
            self.run_agent(text)
            return
        self.start(lambda cancel: self.session.send(text, cancel=cancel), user_text=text)

    # ----------------------------------------------------------------- tools
    def tools_enabled(self) -> bool:
        table = self.session.settings.values.get("tools") or {}
        return isinstance(table, dict) and table.get("enabled") is True

    async def show_request(self, text: str) -> None:
        """The user's message at once, while the agent works (the transcript is redrawn after)."""
        for view in [v for v in self.query(MessageView) if v.role == "welcome"]:
            await view.remove()
        await self.transcript.mount(MessageView("user", text))
        self.transcript.scroll_end(animate=False)

    def ask_approval(self, request: ApprovalRequest) -> str:
        """From the agent's worker thread: show the modal and wait for the user's answer, or
        for the request to be stopped (leaving the app closes the modal; this is the backstop)."""
        answered = threading.Event()
        answer = {"value": "deny"}
        cancel = self.cancel_event

        def chosen(value: str | None) -> None:
            answer["value"] = value or "deny"
            answered.set()

        if cancel.is_set():
            return "deny"
        self.app.call_from_thread(self.app.push_screen, ToolApprovalScreen(request), chosen)
        while not answered.wait(0.2):
            if cancel.is_set():
                return "deny"
        return answer["value"]

    @work(thread=True, exclusive=True, group="generate")
    def run_agent(self, text: str) -> None:
        """A request with the tools offered: each call waits for the modal; the trajectory is
        drawn folded once the agent has answered."""
        call = self.app.call_from_thread
        try:
            call(self.set_status, "Working (tools on)…", True)
            with Toolbox(self.session.settings) as toolbox:
                steps = []

                def shown(step) -> None:
                    steps.append(step)
                    call(self.set_status, f"tool {step.name}: {step.approval}, {step.status}", True)

                agent = Agent(self.session, toolbox.tools, Approvals(self.ask_approval), toolbox.config, shown)
                turn = agent.run(text, tool_choice=toolbox.config.tool_choice, cancel=self.cancel_event)
            stopped = " · stopped" if turn.cancelled else ""
            call(self.set_status, f"{len(steps)} tool call(s) · {turn.reply.route.slot} answered{stopped}")
        except MacaronError as exc:
            call(self.set_status, f"[red]{exc}[/red]")
        finally:
            self.generating = False
            call(self.after_turn)

    def begin_request(self) -> None:
        """Every request, with tools or without, gets its own cancel event (Esc and leaving set
        it) and blocks a second send until its worker is done."""
        self.cancel_event = threading.Event()
        self.generating = True

    def start(self, begin: Callable[[threading.Event], Reply], user_text: str | None = None) -> None:
        self.begin_request()
        self.run_generation(begin, user_text)

    @work(thread=True, exclusive=True, group="generate")
    def run_generation(self, begin: Callable[[threading.Event], Reply], user_text: str | None) -> None:
        call = self.app.call_from_thread
        view: MessageView | None = None
        try:
            self.app.call_from_thread(self.set_status, "Thinking…", True)
            reply = begin(self.cancel_event)
            view = call(self._begin_reply, reply, user_text)
            for chunk in reply:
                call(view.append, chunk)
            done = reply.completion
            decode_s = max((done.total_ms - done.ttft_ms) / 1000, 1e-6)
            speed = f" · {(len(done.tokens) - 1) / decode_s:.1f} tok/s" if len(done.tokens) > 1 else ""
            stopped = " · stopped" if done.finish_reason == "cancelled" else ""
            call(
                self.set_status,
                f"{len(done.tokens)} tokens{speed} · first token {done.ttft_ms:.0f} ms{stopped}",
            )
        except MacaronError as exc:
            call(self.set_status, f"[red]{exc}[/red]")
        finally:
            self.generating = False
            if view is not None:
                call(view.finish)
            call(self.after_turn)

    async def _begin_reply(self, reply: Reply, user_text: str | None) -> MessageView:
        welcome = [v for v in self.query(MessageView) if v.role == "welcome"]
        for view in welcome:
            await view.remove()
        if user_text is not None:
            await self.transcript.mount(MessageView("user", user_text, reply.user_message_id))
        tag = f"{reply.route.slot} {reply.route.expert_name}" + (
            f" · {', '.join(self.session.adapter_names(reply.adapters))}" if reply.adapters else ""
        )
        view = MessageView("assistant", "", None, tag)
        await self.transcript.mount(view)
        self.announce_updates(reply.notices)
        self.set_status(f"{tag} · {reply.route.reason}", True)
        return view

    async def after_turn(self) -> None:
        await self.show_transcript()
        self.refresh_conversations()
        self.turns_shown += 1

    def action_cancel(self) -> None:
        if self.generating:
            self.cancel_event.set()

    async def stop_generating(self) -> None:
        """Cancel the reply being written and wait for its worker without blocking the loop (the
        worker hands each token to it)."""
        self.action_cancel()
        if isinstance(self.app.screen, ToolApprovalScreen):
            self.app.screen.dismiss(None)  # the call waiting for approval is denied, not left waiting
        running = [w for w in self.app.workers if w.node is self and w.group == "generate" and w.is_running]
        if running:
            await self.app.workers.wait_for_complete(running)

    # ----------------------------------------------------------------- feedback
    @on(MessageView.Action)
    async def on_message_action(self, event: MessageView.Action) -> None:
        actions = {
            "correct": self.action_correct,
            "rate_up": lambda: self.rate(1),
            "rate_down": lambda: self.rate(-1),
            "regenerate": self.action_regenerate,
            "copy": self.action_copy_reply,
            "copy_code": self.action_copy_code,
            "previous_branch": lambda: self.switch_branch(-1),
            "next_branch": lambda: self.switch_branch(1),
        }
        result = actions[event.action]()
        if hasattr(result, "__await__"):
            await result

    def action_correct(self) -> None:
        focused = self.focused
        if isinstance(focused, MessageView) and focused.role == "user" and focused.message_id:
            self._edit_user_message(focused)
            return
        if self.generating:
            self.notify("Still answering: wait for the reply (or press Esc), then correct it.")
            return
        view = self.selected()
        if view is None:
            self.notify("No reply to correct yet.")
            return

        def save(text: str | None) -> None:
            if text is not None and text.strip() and text != view.text:
                self.session.correct(view.message_id, text)
                self.tell_learning("Correction saved.")
                self.run_worker(self.after_turn())

        self.app.push_screen(EditorScreen("Correct the reply, then Ctrl+S to save (Esc cancels)", view.text), save)

    def tell_learning(self, saved: str) -> None:
        """After feedback: when it will be learned from, or why not and the fix (the core decides)."""
        status = self.session.learning_readiness()
        notice = status.notice(saved)
        self.learning_notices.append(notice)
        severity = "warning" if status.action_app else "information"
        self.notify(notice, title="Learning", severity=severity, timeout=12)

    def _edit_user_message(self, view: MessageView) -> None:
        def resend(text: str | None) -> None:
            if text is not None and text.strip() and text != view.text:
                message_id = view.message_id
                self.start(lambda cancel: self.session.edit(message_id, text, cancel=cancel), user_text=None)

        self.app.push_screen(EditorScreen("Edit your message; it starts a new branch (Ctrl+S)", view.text), resend)

    def rate(self, value: int) -> None:
        view = self.selected()
        if view is None:
            return
        self.session.rate(view.message_id, value)
        self.tell_learning("Rated " + ("up" if value > 0 else "down") + ".")
        self.run_worker(self.after_turn())

    def action_regenerate(self) -> None:
        view = self.selected()
        if view is None or self.generating:
            return
        message_id = view.message_id
        self.start(lambda cancel: self.session.regenerate(message_id, cancel=cancel), user_text=None)

    def switch_branch(self, step: int) -> None:
        focused = self.focused
        if not isinstance(focused, MessageView) or not focused.message_id:
            return
        if self.session.switch_branch(focused.message_id, step):
            self.run_worker(self.after_turn())

    def action_copy_reply(self) -> None:
        view = self.selected()
        if view is not None:
            self.app.copy_to_clipboard(view.text)
            self.notify("Reply copied.")

    def action_copy_code(self) -> None:
        view = self.selected()
        code = view.first_code_block() if view else None
        if code is None:
            self.notify("That reply has no code block.")
            return
        self.app.copy_to_clipboard(code)
        self.notify("Code block copied.")

    # ----------------------------------------------------------------- conversations
    def refresh_conversations(self) -> None:
        query = self.query_one("#search", Input).value.strip()
        listing = self.query_one(ConversationList)
        if query:
            listing.show_hits(self.session.search(query))
        else:
            listing.show_conversations(self.session.list_conversations())

    @on(Input.Changed, "#search")
    def on_search(self) -> None:
        self.refresh_conversations()

    @on(OptionList.OptionSelected, "#conversations")
    async def open_conversation(self, event: OptionList.OptionSelected) -> None:
        if self.generating or not event.option.id or event.option.id == "__none__":
            return
        self.session.open_conversation(event.option.id)
        await self.show_transcript()
        self.query_one(PromptInput).focus()

    async def action_new_chat(self) -> None:
        if self.generating:
            return
        self.session.new_conversation()
        await self.show_transcript()
        self.query_one(PromptInput).focus()

    def action_focus_search(self) -> None:
        self.query_one("#search", Input).focus()

    def action_help(self) -> None:
        self.app.push_screen(HelpScreen())

    def action_learning(self) -> None:
        self.app.push_screen(LearningScreen(self.session))

    def rename(self) -> None:
        conversation = self.session.conversation_id
        if conversation is None:
            self.notify("Nothing to rename yet.")
            return

        def done(title: str | None) -> None:
            if title:
                self.session.rename(conversation, title)
                self.refresh_conversations()

        self.app.push_screen(TextPromptScreen("New title for this conversation"), done)

    def export_markdown(self) -> None:
        if self.session.conversation_id is None:
            self.notify("Nothing to export yet.")
            return
        path = self.session.export_markdown_file(Path.cwd())
        self.notify(f"Exported to {path}")

    def delete_conversation(self) -> None:
        conversation = self.session.conversation_id
        if conversation is None:
            return

        def done(choice: str | None) -> None:
            if choice == "delete":
                result = self.session.forget(conversation)
                self.notify(result.summary())
                self.run_worker(self.after_turn())

        self.app.push_screen(
            PickScreen(
                "Delete this conversation everywhere? Learned versions that used it are removed.",
                [("delete", "Delete it"), ("keep", "Keep it")],
            ),
            done,
        )

    def switch_model(self) -> None:
        options = [(m.name, f"{m.name} · {m.description}") for m in self.session.available_models()]

        def done(name: str | None) -> None:
            if name and name != self.session.manifest.name and not self.generating:
                self.session.switch_model(name)
                self.load_model()

        self.app.push_screen(PickScreen("Switch model", options), done)

    def roll_back(self) -> None:
        deployed = self.session.deployed_versions()
        if not deployed:
            self.notify("No expert has a learned version to roll back yet.")
            return

        def done(slot: str | None) -> None:
            if slot:
                restored = self.session.rollback(slot)
                now = f"version {restored.id}" if restored else "the bare expert"
                self.notify(f"{slot} rolled back: it now answers with {now}.")

        options = [(slot, f"{slot}: roll back {version.id}") for slot, version in deployed.items()]
        self.app.push_screen(PickScreen("Roll back which expert?", options), done)
