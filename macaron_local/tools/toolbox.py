"""The tools one front end offers: the built-in ones and every listed MCP server's, from the
settings, with the servers stopped when the front end is done."""

from __future__ import annotations

from pathlib import Path

from macaron_local.settings import Settings
from macaron_local.tools.builtin import builtin_tools
from macaron_local.tools.config import ToolsConfig, tools_config
from macaron_local.tools.mcp_servers import McpServers
from macaron_local.tools.spec import ToolSpec


class Toolbox:
    """`with Toolbox(settings) as box:` box.tools, box.config."""

    def __init__(self, settings: Settings, cwd: Path | None = None) -> None:
        self.config: ToolsConfig = tools_config(settings.values.get("tools"), cwd=cwd)
        self._servers: McpServers | None = None
        self._tools: list[ToolSpec] | None = None

    @property
    def tools(self) -> list[ToolSpec]:
        """The built-in tools and the MCP servers' (started on first use, not before: a front
        end that offers no tools starts no server)."""
        if self._tools is None:
            tools = builtin_tools(self.config)
            if self.config.mcp:
                self._servers = McpServers(self.config.mcp, self.config.timeout_s)
                tools += self._servers.tools
            self._tools = tools
        return self._tools

    @property
    def enabled(self) -> bool:
        return self.config.enabled

    def close(self) -> None:
        if self._servers is not None:
            self._servers.close()
            self._servers = None

    def __enter__(self) -> Toolbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
