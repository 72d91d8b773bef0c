"""One message in the transcript: a header (who, which expert, feedback marks) and Markdown.

Replies stream in through Textual's MarkdownStream, which batches appends so long replies stay
fast. The widget is focusable: the focused reply is the one that keys like `e` (correct), `+`/`-`
(rate) and `c` (copy) act on. A reply's reasoning block (Qwen3's thinking) is shown folded above
it; `t` unfolds and folds it again.
"""

from __future__ import annotations

import re

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.message import Message as TextualMessage
from textual.widgets import Collapsible, Markdown, Static

CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)
TOOL_NAME = re.compile(r'<tool_call>\s*(?:\{\s*"name"\s*:\s*"([^"]+)"|<function=([^>\n]+)>)')
#: Longer messages (a 1 MB paste) are shown truncated; the store keeps the full text.
DISPLAY_LIMIT = 20_000


def displayable(text: str) -> str:
    if len(text) <= DISPLAY_LIMIT:
        return text
    return text[:DISPLAY_LIMIT] + f"\n\n*… {len(text) - DISPLAY_LIMIT:,} more characters, kept in full in the store*"


def trajectory_title(role: str, text: str) -> str | None:
    """The folded line of a trajectory step: a reply that calls a tool, or a tool's result."""
    if role == "tool":
        first = text.strip().splitlines()[0] if text.strip() else "(empty)"
        return f"Tool result: {first[:70]} (t)"
    call = TOOL_NAME.search(text) if role == "assistant" and "<tool_call>" in text else None
    if call is not None:
        return f"Tool call: {call.group(1) or call.group(2)} (t)"
    return None


class MessageView(Vertical, can_focus=True):
    """A user message or a reply, with the tag of the expert that wrote it."""

    BINDINGS = [
        Binding("e", "act('correct')", "Correct/Edit"),
        Binding("plus,equals_sign", "act('rate_up')", "Good"),
        Binding("minus", "act('rate_down')", "Bad"),
        Binding("r", "act('regenerate')", "Regenerate"),
        Binding("c", "act('copy')", "Copy"),
        Binding("b", "act('copy_code')", "Copy code"),
        Binding("t", "toggle_thinking", "Thinking", show=False),
        Binding("left_square_bracket", "act('previous_branch')", "Prev branch", show=False),
        Binding("right_square_bracket", "act('next_branch')", "Next branch", show=False),
    ]

    class Action(TextualMessage):
        """Asks the screen to act on this message (the screen owns the session)."""

        def __init__(self, view: MessageView, action: str) -> None:
            super().__init__()
            self.view = view
            self.action = action

    def __init__(
        self, role: str, text: str = "", message_id: str | None = None, tag: str = "", thinking: str = ""
    ) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self.text = text
        self.thinking = thinking
        self.message_id = message_id
        self.tag = tag
        self.marks: list[str] = []
        self._stream = None

    def compose(self) -> ComposeResult:
        if self.role != "welcome":
            yield Static(self._header(), classes="message-header")
        if self.thinking:
            with Collapsible(title="Thinking (t)", collapsed=True, classes="message-thinking"):
                yield Static(displayable(self.thinking), markup=False)
        fold = trajectory_title(self.role, self.text)
        if fold is not None:  # a tool call or a tool's result: folded, `t` opens it
            with Collapsible(title=fold, collapsed=True, classes="message-tool"):
                yield Static(displayable(self.text), markup=False, classes="message-body")
            return
        yield Markdown(displayable(self.text), classes="message-body")

    def _header(self) -> str:
        who = "You" if self.role == "user" else ("Tool" if self.role == "tool" else "macaron")
        parts = [f"[b]{who}[/b]"]
        if self.tag:
            parts.append(f"[dim]{self.tag}[/dim]")
        parts.extend(self.marks)
        return "  ".join(parts)

    def set_tag(self, tag: str) -> None:
        self.tag = tag
        self.query_one(".message-header", Static).update(self._header())

    def set_marks(self, marks: list[str]) -> None:
        self.marks = marks
        self.query_one(".message-header", Static).update(self._header())

    async def append(self, chunk: str) -> None:
        """Stream a piece of the reply into the Markdown body."""
        if self._stream is None:
            self._stream = Markdown.get_stream(self.query_one(Markdown))
        self.text += chunk
        await self._stream.write(chunk)

    async def finish(self) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None

    async def replace_text(self, text: str) -> None:
        self.text = text
        body = self.query_one(".message-body")
        if isinstance(body, Markdown):
            await body.update(displayable(text))
        else:
            body.update(displayable(text))

    def first_code_block(self) -> str | None:
        match = CODE_BLOCK.search(self.text)
        return match.group(1) if match else None

    def action_toggle_thinking(self) -> None:
        for fold in self.query(Collapsible):
            fold.collapsed = not fold.collapsed

    def action_act(self, action: str) -> None:
        self.post_message(self.Action(self, action))
