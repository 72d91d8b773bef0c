"""The tools as the model reads them, and a grammar for models too small to write a call.

Templates that know tools (Qwen3's, Tall's) get them as the `tools` variable, exactly as
Hugging Face's `apply_chat_template(tools=...)` passes them; for a template that does not
(SmolLM2's), the system message gains a block that lists them and shows the call markup.

`call_grammar` builds a llama.cpp GBNF grammar from the tools' JSON schemas so that what the
model writes is either plain text or one well-formed hermes call
(`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`): the embedded 135M model
cannot keep to a format by itself, and with the grammar the agent loop still runs end to end.
`tool_choice` narrows it as the OpenAI API does: `auto` (text or a call), `required` (a
call), `none` (text: no tools offered), or one tool's name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import replace

from macaron_local.engine.template import Message
from macaron_local.errors import InvalidInputError
from macaron_local.tools.spec import ToolSpec

CHOICES = ("auto", "required", "none")
TEXT_GRAMMAR = "root ::= [^<] [^<]*"


def template_takes_tools(source: str) -> bool:
    return re.search(r"\btools\b", source) is not None


def chosen_tools(tools: Sequence[ToolSpec], tool_choice: str) -> list[ToolSpec]:
    if tool_choice == "none":
        return []
    if tool_choice in CHOICES:
        return list(tools)
    named = [t for t in tools if t.name == tool_choice]
    if not named:
        raise InvalidInputError(f"tool_choice names no offered tool: {tool_choice!r}")
    return named


def tool_block(tools: Sequence[ToolSpec]) -> str:
    """The system-message block for templates without tool support (our own wording)."""
    lines = ["You can use these tools. To use one, reply with only:", "<tool_call>"]
    lines += ['{"name": "TOOL", "arguments": {...}}', "</tool_call>", "", "Tools:"]
    lines += [json.dumps(t.openai_schema()["function"], ensure_ascii=False) for t in tools]
    return "\n".join(lines)


def with_tools(messages: list[Message], tools: Sequence[ToolSpec], template_source: str) -> tuple[list[Message], dict]:
    """(messages, template variables) that offer `tools` to the model."""
    if not tools:
        return messages, {}
    if template_takes_tools(template_source):
        return messages, {"tools": [t.openai_schema() for t in tools]}
    out = [dict(m) for m in messages]
    block = tool_block(tools)
    if out and out[0]["role"] == "system":
        out[0]["content"] = f"{out[0]['content']}\n\n{block}"
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, {}


def call_grammar(tools: Sequence[ToolSpec], *, required: bool) -> str:
    """GBNF for one hermes tool call over `tools` (or, unless `required`, plain text)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": dict(t.parameters)},
                "required": ["name", "arguments"],
            }
            for t in tools
        ]
    }
    rules = json_schema_to_gbnf(json.dumps(schema), prop_order=["name", "arguments"])
    rules = re.sub(r"^root ::=", "call-object ::=", rules, flags=re.MULTILINE)
    call = 'call ::= "<tool_call>\\n" call-object "\\n</tool_call>"'
    root = "root ::= call" if required else "root ::= call | text\ntext ::= [^<] [^<]*"
    return f"{root}\n{call}\n{rules}"


def offer_tools(
    messages: list[Message],
    params,
    tools: Sequence[ToolSpec],
    tool_choice: str,
    template_source: str,
    *,
    grammar: bool,
):
    """(messages, template variables, params) for a reply that may call `tools`: the tools in
    the prompt, and with `grammar` (the model's `[protocol] tool_grammar`) the reply held to
    text or one well-formed call (only a call when `tool_choice` requires one)."""
    offered = chosen_tools(tools, tool_choice) if tools else []
    messages, variables = with_tools(messages, offered, template_source)
    if offered and grammar:
        params = replace(params, grammar=call_grammar(offered, required=tool_choice != "auto"))
    elif tools and grammar:  # tools exist but none may be called now: text only (no call markup)
        params = replace(params, grammar=TEXT_GRAMMAR)
    return messages, variables, params
