"""The Textual application: screens, key bindings and the command palette.

The app holds no business logic: it owns a `Session` and hands it to the screens, which call it
(from workers when the call blocks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from pathlib import Path

from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.screen import Screen

from macaron_local.learning_setup import LearningSetup
from macaron_local.session import Session
from macaron_local.settings import Settings
from macaron_ui.screens.chat import ChatScreen
from macaron_ui.screens.first_run import FirstRunScreen
from macaron_ui.screens.learning_setup import LearningSetupScreen
from macaron_ui.screens.modals import EditorScreen
from macaron_ui.widgets.prompt import PromptInput


class MacaronApp(App[None]):
    CSS_PATH = Path(__file__).with_name("app.tcss")
    TITLE = "macaron"
    # Priority, so it also works over a modal: the approval modal stands between the user and a
    # worker that waits for its answer.
    BINDINGS = [Binding("ctrl+q", "quit", "Quit", priority=True)]

    def __init__(
        self,
        settings: Settings,
        model: str | None = None,
        session: Session | None = None,
        learning_setup: LearningSetup | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.model = model
        self.session = session
        self.learning_setup = learning_setup  # what setting learning up runs (tests: a dry run)

    def on_mount(self) -> None:
        if self.session is None and self.model is None and "model" not in self.settings.configured():
            self.push_screen(FirstRunScreen(self._catalog()), self._chosen)
        else:
            self._start(self.model)

    def _catalog(self):
        from macaron_local.catalog import Catalog

        return Catalog(self.settings)

    def _chosen(self, model: str | None) -> None:
        if model is None:
            self.exit()
            return
        self.settings.save(model=model)
        self._start(model)
        self._offer_learning_setup()

    def _offer_learning_setup(self) -> None:
        """The first run's second question: set nightly learning up (asked once; the answer is kept)."""
        assert self.session is not None
        if self.session.learning_setup.choice() is None:
            self.push_screen(LearningSetupScreen(self.session), lambda _: self._focus_prompt())

    def _focus_prompt(self) -> None:
        chat = self.chat
        if chat is not None:
            chat.query_one(PromptInput).focus()

    def _start(self, model: str | None) -> None:
        if self.session is None:
            self.session = Session(self.settings, model=model)
        if self.learning_setup is not None:
            self.session.learning_setup = self.learning_setup
        self.sub_title = self.session.manifest.name
        self.push_screen(ChatScreen(self.session))

    @property
    def chat(self) -> ChatScreen | None:
        return next((s for s in self.screen_stack if isinstance(s, ChatScreen)), None)

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        chat = self.chat
        if chat is None:
            return
        yield SystemCommand("New chat", "Start a new conversation (Ctrl+N)", chat.action_new_chat)
        yield SystemCommand("Regenerate reply", "Answer again; the old reply is kept (Ctrl+R)", chat.action_regenerate)
        yield SystemCommand("Correct reply", "Edit the selected reply (F2)", chat.action_correct)
        yield SystemCommand("Rate reply good", "Thumbs up for the selected reply", lambda: chat.rate(1))
        yield SystemCommand("Rate reply bad", "Thumbs down for the selected reply", lambda: chat.rate(-1))
        yield SystemCommand("Copy reply", "Copy the selected reply (Ctrl+Y)", chat.action_copy_reply)
        yield SystemCommand("Copy code block", "Copy the first code block of the selected reply", chat.action_copy_code)
        yield SystemCommand("Rename conversation", "Give this conversation a title", chat.rename)
        yield SystemCommand("Export as Markdown", "Write this conversation to a .md file", chat.export_markdown)
        yield SystemCommand("Delete conversation", "Forget it everywhere", chat.delete_conversation)
        yield SystemCommand("Switch model", "Answer with another model", chat.switch_model)
        yield SystemCommand("Roll back an expert", "Return an expert to an earlier adapter version", chat.roll_back)
        yield SystemCommand("Learning panel", "What learning did and when (Ctrl+L)", chat.action_learning)
        yield SystemCommand("Keys", "Every key binding (F1)", chat.action_help)

    async def action_quit(self) -> None:
        """Stop the reply being written before leaving: its worker posts every token to this
        loop and holds the engine, so closing the session under it would wait forever. An unsaved
        correction gets one warning first."""
        if isinstance(self.screen, EditorScreen) and not self.screen.may_quit():
            return
        chat = self.chat
        if chat is not None:
            await chat.stop_generating()
        self.exit()

    async def on_unmount(self) -> None:
        """Close the session off the loop. A reply still being written (any way out but Ctrl+Q)
        stops at its next token once the engine closes, but only if the loop is free to take
        that token from its worker."""
        if self.session is not None:
            await asyncio.to_thread(self.session.close)
