"""The tool-call text format between the server and the model: `<tool_call>{json}</tool_call>`.

The model is told the tools in its system prompt and answers a call as one or more
`<tool_call>` blocks holding `{"name": ..., "arguments": {...}}` (or a JSON list of them, as
SmolLM2 writes). Calls a client sends back in the history are written the same way, so the
model reads its own earlier calls as it wrote them. This is deliberately small and self-contained:
a model family's own tool-call syntax belongs to the protocol layer, and `parse_tool_calls`
is the one function to replace when that lands.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from macaron_local.server.schemas import ChatMessage, ToolSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # a JSON object, as the OpenAI API carries it


def tools_prompt(tools: list[ToolSpec]) -> str:
    """What the system prompt gains when a request offers tools."""
    specs = [
        {"name": t.function.name, "description": t.function.description, "parameters": t.function.parameters}
        for t in tools
    ]
    return (
        "You can call these tools:\n<tools>"
        + json.dumps(specs, ensure_ascii=False)
        + "</tools>\nTo call one, reply with only "
        + OPEN
        + '{"name": ..., "arguments": {...}}'
        + CLOSE
        + "."
    )


def call_text(name: str, arguments: str | dict[str, Any]) -> str:
    """One call as the model writes it."""
    if isinstance(arguments, str):
        with contextlib.suppress(json.JSONDecodeError):  # otherwise kept as the client sent it
            arguments = json.loads(arguments or "{}")
    return OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CLOSE


def history_text(message: ChatMessage) -> str:
    """A client's history message as the text the model sees (calls rendered in the format)."""
    text = message.text()
    calls = [call_text(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return "\n".join(part for part in (text, *calls) if part)


def streamable(text: str) -> int:
    """While streaming: how much of `text` (not yet sent) can go out as plain text now. A call
    that has begun, or may be beginning at the very end, is held back until the reply ends."""
    at = text.find(OPEN)
    if at >= 0:
        return at
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return len(text) - size
    return len(text)


def parse_tool_calls(text: str, known: set[str]) -> tuple[str, list[ParsedCall]]:
    """Split a reply into its plain text and the calls of tools in `known` it makes.

    A block that is not JSON, names an unknown tool or has non-object arguments is left in the
    text: the client sees what the model said rather than a call that cannot be made.
    """
    calls: list[ParsedCall] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        found = _calls_in(match.group(1), known)
        if found is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls += found
    kept.append(text[position:])
    return "".join(kept).strip() if calls else text, calls


def _calls_in(body: str, known: set[str]) -> list[ParsedCall] | None:
    try:
        data = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    items = data if isinstance(data, list) else [data]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in known:
            return None
        arguments = item.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ParsedCall(f"call_{uuid.uuid4().hex[:24]}", item["name"], json.dumps(arguments)))
    return calls
