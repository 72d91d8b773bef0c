"""The message input, with shell-like history on Up and Down."""

from __future__ import annotations

from textual.binding import Binding
from textual.widgets import Input


class PromptInput(Input):
    """An Input that remembers what was sent (Up/Down walk the history)."""

    BINDINGS = [
        Binding("up", "history(-1)", "Previous", show=False),
        Binding("down", "history(1)", "Next", show=False),
    ]

    def __init__(self, **kwargs) -> None:
        super().__init__(placeholder="Message macaron… (Enter to send, F1 for keys)", **kwargs)
        self.history: list[str] = []
        self._cursor = 0

    def remember(self, text: str) -> None:
        if text and (not self.history or self.history[-1] != text):
            self.history.append(text)
        self._cursor = len(self.history)

    def action_history(self, step: int) -> None:
        if not self.history:
            return
        self._cursor = max(0, min(len(self.history), self._cursor + step))
        self.value = self.history[self._cursor] if self._cursor < len(self.history) else ""
        self.cursor_position = len(self.value)
