"""The `[tools]` table of settings.toml:

    [tools]
    enabled = true                    # offer the tools in the chat and `ask` (default: only on request)
    read_folders = ["~/notes"]        # besides the working directory (always readable)
    write_folders = ["~/notes"]       # none by default: nothing can be written
    timeout_s = 20                    # a command or MCP call past this is stopped
    max_output_chars = 8000           # what goes back to the model is cut here
    max_steps = 6                     # tool calls per request before the agent must answer
    tool_choice = "auto"              # or "required" (a small model rarely calls on its own)

    [tools.mcp.notes]                 # an MCP server (stdio), its tools named notes.<tool>
    command = "python"
    args = ["-m", "my_notes_server"]

Every value is checked when read; a bad one is one line naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from macaron_local.errors import InvalidInputError


@dataclass(frozen=True)
class McpServer:
    name: str
    command: str
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolsConfig:
    enabled: bool = False  # offered in the chat and `ask` without asking for them
    read_folders: tuple[Path, ...] = ()
    write_folders: tuple[Path, ...] = ()
    timeout_s: float = 20.0
    max_output_chars: int = 8000
    max_steps: int = 6
    mcp: tuple[McpServer, ...] = ()
    tool_choice: str = "auto"  # the first step's; later steps are "auto"


def _folders(value: Any, key: str) -> tuple[Path, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v and "\0" not in v for v in value):
        raise InvalidInputError(f"settings [tools] {key} must be a list of folder paths")
    try:
        return tuple(Path(v).expanduser().resolve() for v in value)
    except (OSError, RuntimeError, ValueError) as exc:
        raise InvalidInputError(f"settings [tools] {key}: {exc}") from None


def _number(table: Mapping[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise InvalidInputError(f"settings [tools] {key} must be a number from {low:g} to {high:g}")
    return value


def tools_config(table: Mapping[str, Any] | None, cwd: Path | None = None) -> ToolsConfig:
    """The checked `[tools]` table; the working directory is always readable."""
    table = table or {}
    if not isinstance(table, Mapping):
        raise InvalidInputError("settings [tools] must be a table")
    if not isinstance(table.get("enabled", False), bool):
        raise InvalidInputError("settings [tools] enabled must be true or false")
    servers = []
    listed = table.get("mcp") or {}
    if not isinstance(listed, Mapping):
        raise InvalidInputError("settings [tools.mcp] must be a table of servers")
    for name, spec in listed.items():
        if not isinstance(spec, Mapping) or not isinstance(spec.get("command"), str) or not spec["command"]:
            raise InvalidInputError(f"settings [tools.mcp.{name}] needs command = the program to start")
        args = spec.get("args", [])
        env = spec.get("env", {})
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise InvalidInputError(f"settings [tools.mcp.{name}] args must be a list of strings")
        if not isinstance(env, Mapping) or not all(isinstance(v, str) for v in env.values()):
            raise InvalidInputError(f"settings [tools.mcp.{name}] env must be a table of strings")
        if not name.replace("_", "").replace("-", "").isalnum():
            raise InvalidInputError(f"settings [tools.mcp.{name}]: a server name is letters, digits, - and _")
        servers.append(McpServer(name, spec["command"], tuple(args), dict(env)))
    choice = table.get("tool_choice", "auto")
    if not isinstance(choice, str) or not choice:
        raise InvalidInputError('settings [tools] tool_choice must be "auto", "required", "none" or a tool\'s name')
    here = (Path(cwd or Path.cwd()).resolve(),)
    return ToolsConfig(
        enabled=table.get("enabled", False),
        read_folders=here + _folders(table.get("read_folders", []), "read_folders"),
        write_folders=_folders(table.get("write_folders", []), "write_folders"),
        timeout_s=float(_number(table, "timeout_s", 20.0, 0.1, 3600)),
        max_output_chars=int(_number(table, "max_output_chars", 8000, 100, 1_000_000)),
        max_steps=int(_number(table, "max_steps", 6, 1, 100)),
        mcp=tuple(servers),
        tool_choice=choice,
    )
