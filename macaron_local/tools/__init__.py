"""The agent's hands: built-in tools confined to the folders the user allows, tools from the
MCP servers the user lists, approval before anything that writes, deletes or executes, and the
loop that carries a tool call to its result and back to the expert that made it.

- `config`: the `[tools]` settings (allowed folders, limits, MCP servers);
- `spec`: what a tool is and what running one gave;
- `sandbox`: path checks (allowed folders, no `..`, no symlink leading out);
- `builtin`: read/list/search/write files and run a command;
- `mcp_servers`: stdio MCP servers through the `mcp` SDK, namespaced by server;
- `approval`: who says yes (the TUI's modal, a terminal prompt, a flag) and the standing rules;
- `prompting`: the tools as the model reads them, and the grammar that makes a small model
  write a well-formed call;
- `agent`: the loop.
"""
