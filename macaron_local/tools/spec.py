"""What a tool is, and what one run of it gave."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

#: What a tool does to the world. Only `read` runs without asking.
EFFECTS = ("read", "write", "execute", "external")
#: How a call ended.
STATUSES = ("ok", "error", "refused", "denied", "timeout")


class ToolRefused(Exception):
    """A call the sandbox will not run; its message is the one line the model and user see."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool as the model sees it (name, description, JSON schema of its arguments) and as
    the agent treats it (its effect decides whether the user must approve)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    effect: str = "read"
    run: Callable[[Mapping[str, Any]], str] | None = field(default=None, compare=False, repr=False)
    #: Raises ToolRefused for arguments the tool would refuse anyway, before the user is asked.
    check: Callable[[Mapping[str, Any]], object] | None = field(default=None, compare=False, repr=False)

    @property
    def needs_approval(self) -> bool:
        return self.effect != "read"

    def openai_schema(self) -> dict[str, Any]:
        """The OpenAI / Hugging Face tool format chat templates read (`tools=`)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": dict(self.parameters)},
        }


@dataclass(frozen=True)
class ToolOutcome:
    """What a call gave: its status, the text that goes back to the model, and its time."""

    status: str
    text: str
    ms: float = 0.0
