"""What differs per model family in a reply: its reasoning block and its tool-call markup.

Qwen3-family models (Tall's Qwen3.6 base) may open a reply with a reasoning block that ends in
`</think>`. It is kept apart from the reply: stored on the turn, shown folded, never fed back
(the Qwen3 templates drop it from earlier turns themselves) and never scored as the reply.

Tool calls come in two markups:
- `qwen3_coder` (Tall): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>`;
- `hermes` (Qwen2.5/Qwen3 default, SmolLM2 and most others): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  (a JSON object, or a list of them).
A reply that ends in a tool call keeps its task open: the tool result goes back to the same
expert with no route hop and no summary.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

FAMILIES = ("hermes", "qwen3_coder")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


def family_for(architecture: str, configured: str = "") -> str:
    """The configured family, else Qwen3-Coder markup for Qwen3.5/3.6 MoE bases, else hermes."""
    if configured:
        if configured not in FAMILIES:
            raise ValueError(f"unknown model family {configured!r} (known: {', '.join(FAMILIES)})")
        return configured
    return "qwen3_coder" if architecture in ("qwen35moe", "qwen3_5_moe") else "hermes"


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, reply). Without a closing `</think>` there is no reasoning block."""
    if THINK_CLOSE not in text:
        return "", text
    head, _, tail = text.partition(THINK_CLOSE)
    return head.replace(THINK_OPEN, "", 1).strip(), tail.lstrip("\n")


def _value(raw: str) -> Any:
    """A Qwen3-Coder parameter is text; JSON values (numbers, lists, objects) are decoded."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def parse_tool_calls(text: str, family: str) -> list[ToolCall]:
    """Every well-formed tool call in `text` (malformed ones are ignored: they are prose)."""
    calls: list[ToolCall] = []
    for body in _CALL.findall(text):
        if family == "qwen3_coder":
            for name, params in _FUNCTION.findall(body):
                arguments = {key.strip(): _value(value) for key, value in _PARAMETER.findall(params)}
                calls.append(ToolCall(name.strip(), arguments))
            continue
        try:
            decoded = json.loads(body)
        except ValueError:
            continue
        for item in decoded if isinstance(decoded, list) else [decoded]:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                arguments = item.get("arguments", item.get("parameters", {}))
                if isinstance(arguments, str):
                    arguments = _value(arguments)
                calls.append(ToolCall(item["name"], arguments if isinstance(arguments, dict) else {}))
    return calls


def ends_in_tool_call(text: str, family: str) -> bool:
    """Does the reply end with a (parsable) tool call: is the expert waiting for a result?"""
    return text.rstrip().endswith("</tool_call>") and bool(parse_tool_calls(text, family))
