"""Who says yes to a tool call, and the standing rules the user gave.

Reading runs without asking. Anything that writes, deletes, executes or reaches an MCP tool not
marked read-only waits for an `Asker`: the TUI's modal, a terminal prompt, or a fixed answer
(`--yes-tools`, `--no-tools`). With nobody to ask, the call is denied. An answer of `always`
approves that tool in that folder for the rest of the session; an answer of `("edit", args)`
approves the call with the arguments the user corrected it to (recorded as a correction of
the reply that made the call, like any other). Only the user's answer can approve: nothing
the model writes or a tool returns is ever read as one.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from macaron_local.tools.spec import ToolSpec

ANSWERS = ("approve", "deny", "always")
MAX_PREVIEW_LINES = 200


@dataclass(frozen=True)
class ApprovalRequest:
    """What the user is shown: the exact call, where it acts, and for a file write its diff."""

    tool: ToolSpec
    arguments: Mapping[str, Any]
    folder: str  # where it acts (the rule `always` remembers), "" when it names none
    preview: str

    @property
    def title(self) -> str:
        what = {"write": "writes a file", "execute": "runs a command", "external": "an MCP tool that may act"}
        return f"Allow {self.tool.name}? ({what.get(self.tool.effect, 'reads')})"


#: Given a request, the user's answer: one of ANSWERS, or ("edit", corrected arguments).
Asker = Callable[[ApprovalRequest], "str | tuple[str, dict[str, Any]]"]


@dataclass(frozen=True)
class Decision:
    approved: bool
    how: str  # read-only | always | approved | edited | denied | no one to ask
    arguments: dict[str, Any] | None = None  # the user's corrected arguments (how == "edited")


def request_for(tool: ToolSpec, arguments: Mapping[str, Any], workdir: Path | None) -> ApprovalRequest:
    """The request shown for a call: a diff for a file write, the command and folder for a
    command, the arguments as JSON otherwise."""
    path = arguments.get("path")
    folder = ""
    if tool.name == "write_file" and isinstance(path, str):
        target = Path(path).expanduser()
        if not target.is_absolute() and workdir is not None:
            target = workdir / target
        folder = str(target.parent)
        old = target.read_text(encoding="utf-8", errors="replace") if target.is_file() else ""
        diff = difflib.unified_diff(
            old.splitlines(), str(arguments.get("content", "")).splitlines(), str(target), str(target), lineterm=""
        )
        lines = list(diff) or [f"{target}: no change"]
        if len(lines) > MAX_PREVIEW_LINES:
            lines = lines[:MAX_PREVIEW_LINES] + [f"[... {len(lines) - MAX_PREVIEW_LINES} more lines]"]
        preview = "\n".join(lines)
    elif tool.name == "run_command":
        folder = str(workdir or "")
        preview = f"$ {arguments.get('command', '')}\n(in {folder or 'no folder'})"
    else:
        preview = json.dumps(dict(arguments), indent=2, ensure_ascii=False)
    return ApprovalRequest(tool, arguments, folder, preview)


@dataclass
class Approvals:
    """The session's standing rules (tool, folder) and the one who is asked for the rest."""

    ask: Asker | None = None
    always: set[tuple[str, str]] = field(default_factory=set)

    def decide(self, request: ApprovalRequest) -> Decision:
        if not request.tool.needs_approval:
            return Decision(True, "read-only")
        if (request.tool.name, request.folder) in self.always:
            return Decision(True, "always")
        if self.ask is None:
            return Decision(False, "no one to ask")
        answer = self.ask(request)
        if isinstance(answer, tuple) and len(answer) == 2 and answer[0] == "edit" and isinstance(answer[1], dict):
            return Decision(True, "edited", dict(answer[1]))
        if answer == "always":
            self.always.add((request.tool.name, request.folder))
            return Decision(True, "approved")
        return Decision(True, "approved") if answer == "approve" else Decision(False, "denied")


def fixed(answer: str) -> Asker:
    """An asker that always gives the same answer (`--yes-tools` / `--no-tools`)."""
    if answer not in ANSWERS:
        raise ValueError(f"answer must be one of {ANSWERS}")
    return lambda request: answer
