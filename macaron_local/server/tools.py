"""Tool calls between the API and the model.

A request's tools go to the session as tools offered (`offered_tool`): the model's chat
template renders them where it knows tools (Qwen3's, Tall's), else the system message lists
them, and a small model's reply is held to a well-formed call by a grammar
(`macaron_local.tools.prompting`). The model answers a call as `<tool_call>` blocks: hermes
JSON `{"name": ..., "arguments": {...}}` (or a JSON list of them, as SmolLM2 writes), or
Qwen3-Coder markup for Tall's family. Calls a client sends back in the history are written in
hermes JSON, so the model reads earlier calls in one format.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from macaron_local.protocol import features
from macaron_local.server.schemas import ChatMessage, ToolSpec
from macaron_local.tools.spec import ToolSpec as OfferedTool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # a JSON object, as the OpenAI API carries it


def offered_tool(tool: ToolSpec) -> OfferedTool:
    """A request's tool as the session offers it: the client runs it, so it has no runner."""
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    return OfferedTool(tool.function.name, tool.function.description or "", parameters, effect="external")


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


def parse_tool_calls(text: str, known: set[str], family: str = "hermes") -> tuple[str, list[ParsedCall]]:
    """Split a reply into its plain text and the calls of tools in `known` it makes.

    A block that is not JSON, names an unknown tool or has non-object arguments is left in the
    text: the client sees what the model said rather than a call that cannot be made.
    """
    calls: list[ParsedCall] = []
    kept: list[str] = []
    position = 0
    for match in _BLOCK.finditer(text):
        found = _markup_calls(match.group(0), known) if family == "qwen3_coder" else _calls_in(match.group(1), known)
        if found is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls += found
    kept.append(text[position:])
    return "".join(kept).strip() if calls else text, calls


def _markup_calls(block: str, known: set[str]) -> list[ParsedCall] | None:
    """Qwen3-Coder calls (`<function=NAME><parameter=KEY>VALUE</parameter></function>`)."""
    found = features.parse_tool_calls(block if block.endswith(CLOSE) else block + CLOSE, "qwen3_coder")
    if not found or any(call.name not in known for call in found):
        return None
    return [ParsedCall(f"call_{uuid.uuid4().hex[:24]}", c.name, json.dumps(c.arguments)) for c in found]


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
