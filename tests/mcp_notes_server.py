"""A real stdio MCP server for the tests, written with the `mcp` SDK: `add` is marked
read-only; `note` is not (it appends to the file named by NOTES_FILE), so it needs approval."""

from __future__ import annotations

import os

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

app = MCPServer("notes")


@app.tool(annotations=ToolAnnotations(read_only_hint=True))
def add(a: int, b: int) -> str:
    """Add two whole numbers."""
    return str(a + b)


@app.tool()
def note(text: str) -> str:
    """Keep a note."""
    with open(os.environ["NOTES_FILE"], "a", encoding="utf-8") as out:
        out.write(text + "\n")
    return "noted"


if __name__ == "__main__":
    app.run("stdio")
