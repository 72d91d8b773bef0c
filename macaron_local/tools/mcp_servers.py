"""Tools from the MCP servers the user lists (stdio), through the official `mcp` SDK.

Each server is started once, when the agent first needs its tools, and kept for the session;
its tools are named `<server>__<tool>` (the OpenAI function-name alphabet has no dot). A tool
the server marks read-only (`readOnlyHint`) runs without asking; every other one waits for the
user, as the built-in tools that write or execute do. The SDK is asynchronous; one event-loop
thread serves every server so the rest of the program calls them like functions.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from macaron_local.errors import MacaronError
from macaron_local.tools.config import McpServer
from macaron_local.tools.spec import ToolSpec

SEPARATOR = "__"
START_TIMEOUT_S = 30.0


class McpServers:
    """The running servers and their tools. `close()` stops them all.

    Each server lives in one task of the loop thread that enters the SDK's stdio client and
    session and waits to be stopped: the SDK's cancel scopes must be left by the task that
    entered them. Calls come from other threads through `run_coroutine_threadsafe`.
    """

    def __init__(self, servers: Sequence[McpServer], timeout_s: float = 20.0) -> None:
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-servers", daemon=True)
        self._thread.start()
        self._stop = self._call_soon(self._make_event())
        self._tasks: list[concurrent.futures.Future] = []
        self._sessions: dict[str, Any] = {}
        self.tools: list[ToolSpec] = []
        try:
            for server in servers:
                self.tools += self._start(server)
        except BaseException:
            self.close()
            raise

    async def _make_event(self) -> asyncio.Event:
        return asyncio.Event()

    def _call_soon(self, coroutine, timeout: float = START_TIMEOUT_S):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _start(self, server: McpServer) -> list[ToolSpec]:
        ready: concurrent.futures.Future = concurrent.futures.Future()
        self._tasks.append(asyncio.run_coroutine_threadsafe(self._serve(server, ready), self._loop))
        try:
            session, listed = ready.result(START_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise MacaronError(f"MCP server {server.name!r} did not answer within {START_TIMEOUT_S:g} s") from None
        except Exception as exc:  # the server's own failure, whatever it is, is one line
            raise MacaronError(f"MCP server {server.name!r} ({server.command}) did not start: {exc}") from None
        self._sessions[server.name] = session
        specs = []
        for tool in listed.tools:
            read_only = bool(tool.annotations and tool.annotations.read_only_hint)
            specs.append(
                ToolSpec(
                    f"{server.name}{SEPARATOR}{tool.name}",
                    tool.description or tool.title or tool.name,
                    tool.input_schema or {"type": "object", "properties": {}},
                    "read" if read_only else "external",
                    self._runner(server.name, tool.name),
                )
            )
        return specs

    async def _serve(self, server: McpServer, ready: concurrent.futures.Future) -> None:
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        params = StdioServerParameters(command=server.command, args=list(server.args), env=dict(server.env) or None)
        try:
            async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
                await session.initialize()
                listed = await session.list_tools()
                ready.set_result((session, listed))
                await self._stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
            if not isinstance(exc, Exception):
                raise

    def _runner(self, server: str, tool: str):
        def run(arguments: Mapping[str, Any]) -> str:
            call = self._sessions[server].call_tool(tool, dict(arguments), read_timeout_seconds=self.timeout_s)
            future = asyncio.run_coroutine_threadsafe(call, self._loop)
            try:
                result = future.result(self.timeout_s + 5)
            except concurrent.futures.TimeoutError:
                future.cancel()
                raise TimeoutError(f"the MCP call ran past its {self.timeout_s:g} s timeout and was stopped") from None
            texts = [getattr(part, "text", None) or f"[{getattr(part, 'type', 'content')}]" for part in result.content]
            text = "\n".join(texts)
            if getattr(result, "is_error", False):
                raise RuntimeError(text or f"{server}{SEPARATOR}{tool} failed")
            return text

        return run

    def close(self) -> None:
        """Stop every server (their processes end with their stdin) and the loop thread."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._stop.set)
        for task in self._tasks:
            with contextlib.suppress(Exception):
                task.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._loop.is_running():
            self._loop.close()
