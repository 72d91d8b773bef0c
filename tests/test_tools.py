"""The tools themselves, without a model: the sandbox's refusals, approval before anything that
writes or executes, limits, and a real stdio MCP server started with the `mcp` SDK."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from macaron_local.engine import GenerationParams
from macaron_local.errors import InvalidInputError
from macaron_local.protocol.features import ToolCall
from macaron_local.tools.agent import Agent
from macaron_local.tools.approval import Approvals, fixed
from macaron_local.tools.builtin import builtin_tools, command_has_network
from macaron_local.tools.config import McpServer, tools_config
from macaron_local.tools.mcp_servers import McpServers
from macaron_local.tools.prompting import call_grammar, offer_tools, tool_block

HERE = Path(__file__).parent


@pytest.fixture
def folders(tmp_path):
    read, write, outside = tmp_path / "read", tmp_path / "work", tmp_path / "outside"
    for folder in (read, write, outside):
        folder.mkdir()
    (read / "notes.txt").write_text("milk\neggs\n")
    (outside / "secret.txt").write_text("the secret")
    return read, write, outside


def agent_for(read: Path, write: Path, asker=None, **limits) -> Agent:
    config = tools_config({"write_folders": [str(write)], **limits}, cwd=read)
    return Agent(None, builtin_tools(config), Approvals(asker), config)


def run(agent: Agent, name: str, **arguments):
    return agent.execute(ToolCall(name, arguments), "call-message")


def test_reading_runs_without_asking_and_writing_waits_for_the_user(folders):
    read, write, _ = folders
    asked = []
    agent = agent_for(read, write, lambda request: asked.append(request) or "deny")
    step = run(agent, "read_file", path="notes.txt")
    assert (step.status, step.approval, step.result) == ("ok", "read-only", "milk\neggs\n") and not asked

    denied = run(agent, "write_file", path="todo.txt", content="buy bread")
    assert (denied.status, denied.approval) == ("denied", "denied")
    assert not (write / "todo.txt").exists() and denied.result == "write_file was not run: the user denied it."
    assert "+buy bread" in asked[0].preview and asked[0].folder == str(write)  # the exact diff was shown

    agent.approvals.ask = lambda request: asked.append(request) or "approve"
    approved = run(agent, "write_file", path="todo.txt", content="buy bread")
    assert (approved.status, approved.approval) == ("ok", "approved")
    assert (write / "todo.txt").read_text() == "buy bread" and len(asked) == 2  # ran once, once asked


def test_always_approves_that_tool_in_that_folder_only(folders):
    read, write, _ = folders
    asked = []
    agent = agent_for(read, write, lambda request: asked.append(request.tool.name) or "always")
    assert run(agent, "write_file", path="a.txt", content="1").approval == "approved"
    assert run(agent, "write_file", path="b.txt", content="2").approval == "always"
    assert run(agent, "run_command", command="true").approval == "approved"  # another tool: asked again
    assert asked == ["write_file", "run_command"]


def test_with_nobody_to_ask_a_call_that_needs_approval_is_denied(folders):
    read, write, _ = folders
    step = run(agent_for(read, write), "run_command", command="touch ran")
    assert (step.status, step.approval) == ("denied", "no one to ask") and not (write / "ran").exists()


@pytest.mark.parametrize(
    ("tool", "arguments", "needle"),
    [
        ("write_file", {"path": "../outside/x.txt", "content": "x"}, "paths with '..' are refused"),
        ("write_file", {"path": "OUTSIDE", "content": "x"}, "is outside the folders allowed for write"),
        ("read_file", {"path": "OUTSIDE/secret.txt"}, "is outside the folders allowed for read"),
        ("read_file", {"path": "link/secret.txt"}, "outside the folders allowed for read"),
        ("write_file", {"path": "wlink/x.txt", "content": "x"}, "outside the folders allowed for write"),
        ("write_file", {"path": "x.txt", "content": 3}, "argument 'content' must be text"),
        ("nonexistent", {}, "no tool is named 'nonexistent'"),
    ],
)
def test_the_sandbox_refuses_in_one_line_before_anyone_is_asked(folders, tool, arguments, needle):
    read, write, outside = folders
    (read / "link").symlink_to(outside)
    (write / "wlink").symlink_to(outside)
    arguments = {
        k: (str(outside / v[8:]) if isinstance(v, str) and v.startswith("OUTSIDE") else v) for k, v in arguments.items()
    }
    asked = []
    step = run(agent_for(read, write, lambda request: asked.append(request) or "approve"), tool, **arguments)
    assert step.status == "refused" and needle in step.result and "\n" not in step.result
    assert not asked and not (outside / "x.txt").exists()


def test_a_command_past_its_timeout_is_stopped_and_output_is_capped(folders):
    read, write, _ = folders
    agent = agent_for(read, write, fixed("approve"), timeout_s=0.5, max_output_chars=100)
    slow = run(agent, "run_command", command="sleep 5; touch finished")
    assert slow.status == "timeout" and slow.result == "the command ran past its 0.5 s timeout and was stopped"
    assert slow.ms < 4000 and not (write / "finished").exists()
    loud = run(agent, "run_command", command="yes | head -c 5000")
    assert loud.status == "ok" and loud.result.endswith("[... cut at 100 characters]") and len(loud.result) < 140


@pytest.mark.skipif(command_has_network(), reason="this OS gives commands no separate network namespace")
def test_commands_have_no_network(folders):
    read, write, _ = folders
    probe = f"{sys.executable} -c \"import socket; socket.create_connection(('1.1.1.1', 80), timeout=3)\""
    step = run(agent_for(read, write, fixed("approve")), "run_command", command=probe)
    assert step.status == "ok" and "exit code 1" in step.result and "unreachable" in step.result


def test_bad_tools_settings_are_one_line_errors(tmp_path):
    for table, needle in (
        ({"write_folders": "here"}, "write_folders must be a list"),
        ({"timeout_s": 0}, "timeout_s must be a number"),
        ({"mcp": {"x": {"args": []}}}, "needs command"),
        ({"mcp": {"a.b": {"command": "x"}}}, "a server name is letters"),
    ):
        with pytest.raises(InvalidInputError, match=needle):
            tools_config(table, cwd=tmp_path)


def test_tools_reach_the_prompt_and_the_grammar_only_allows_text_or_a_call(folders):
    read, write, _ = folders
    tools = builtin_tools(tools_config({"write_folders": [str(write)]}, cwd=read))
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    messages, variables, params = offer_tools(system, GenerationParams(), tools, "auto", "{{ messages }}", grammar=True)
    assert messages[0]["content"].startswith("Be brief.\n\n" + tool_block(tools)) and variables == {}
    assert params.grammar.startswith("root ::= call | text")
    messages, variables, params = offer_tools(
        system, GenerationParams(), tools, "write_file", "{{ tools }}", grammar=True
    )
    assert messages == system and [t["function"]["name"] for t in variables["tools"]] == ["write_file"]
    assert params.grammar.startswith("root ::= call\n") and '"\\"write_file\\""' in params.grammar
    _, _, params = offer_tools(system, GenerationParams(), tools, "none", "", grammar=True)
    assert params.grammar == "root ::= [^<] [^<]*"  # tools exist, none may be called: text only
    assert offer_tools(system, GenerationParams(), tools, "auto", "", grammar=False)[2].grammar is None
    assert "call-object ::=" in call_grammar(tools[:1], required=True)


@pytest.fixture
def mcp_server(tmp_path):
    notes = tmp_path / "notes.log"
    server = McpServer(
        "notes", sys.executable, (str(HERE / "mcp_notes_server.py"),), {**os.environ, "NOTES_FILE": str(notes)}
    )
    servers = McpServers([server], timeout_s=20)
    yield servers, notes
    servers.close()


def test_an_mcp_servers_tools_are_namespaced_and_only_read_only_ones_run_unasked(mcp_server, tmp_path):
    servers, notes = mcp_server
    by_name = {tool.name: tool for tool in servers.tools}
    assert set(by_name) == {"notes__add", "notes__note"}
    assert by_name["notes__add"].effect == "read" and by_name["notes__note"].effect == "external"
    config = tools_config({}, cwd=tmp_path)
    asked = []
    agent = Agent(None, servers.tools, Approvals(lambda request: asked.append(request) or "deny"), config)
    added = agent.execute(ToolCall("notes__add", {"a": 2, "b": 40}), "m")
    assert (added.status, added.result, asked) == ("ok", "42", [])
    denied = agent.execute(ToolCall("notes__note", {"text": "hello"}), "m")
    assert denied.status == "denied" and not notes.exists() and '"text": "hello"' in asked[0].preview
    agent.approvals.ask = fixed("approve")
    approved = agent.execute(ToolCall("notes__note", {"text": "hello"}), "m")
    assert approved.status == "ok" and notes.read_text() == "hello\n"  # ran exactly once
    failed = agent.execute(ToolCall("notes__add", {"a": "two"}), "m")
    assert failed.status == "error" and "\n" not in failed.result


def test_an_mcp_server_that_does_not_start_is_one_line(tmp_path):
    from macaron_local.errors import MacaronError

    with pytest.raises(MacaronError, match="MCP server 'broken'") as failure:
        McpServers([McpServer("broken", sys.executable, ("-c", "import sys; sys.exit(3)"))], timeout_s=5)
    assert "\n" not in str(failure.value)


@pytest.mark.parametrize(
    "table",
    [
        {"mcp": 3},
        {"mcp": {"x": 3}},
        {"read_folders": ["a\0b"]},
        {"read_folders": [1]},
        {"enabled": "yes"},
        {"tool_choice": 5},
        {"max_steps": True},
        {"max_output_chars": float("nan")},
        [1],
    ],
)
def test_hostile_tools_tables_are_one_line_errors(tmp_path, table):
    with pytest.raises(InvalidInputError) as failure:
        tools_config(table, cwd=tmp_path)
    assert "\n" not in str(failure.value)


def test_the_toolbox_reads_mcp_servers_from_the_settings_and_starts_them_on_first_use(home, tmp_path):
    from macaron_local.tools.toolbox import Toolbox

    notes = tmp_path / "notes.log"
    server = {"command": sys.executable, "args": [str(HERE / "mcp_notes_server.py")], "env": {"NOTES_FILE": str(notes)}}
    home.save(tools={"mcp": {"notes": server}})
    with Toolbox(home) as box:
        assert box._servers is None  # nothing started yet
        names = [tool.name for tool in box.tools]
        assert names[:5] == ["read_file", "list_folder", "search_folder", "write_file", "run_command"]
        assert set(names[5:]) == {"notes__add", "notes__note"}
        add = next(tool for tool in box.tools if tool.name == "notes__add")
        assert add.run({"a": 1, "b": 2}) == "3"


def test_an_edited_call_runs_with_the_users_arguments_and_is_checked_again(folders):
    read, write, outside = folders
    agent = agent_for(read, write, lambda request: ("edit", {"path": "fixed.txt", "content": "as I meant it"}))
    step = run(agent, "write_file", path="typo.txt", content="as it wrote")
    assert (step.approval, step.status, step.arguments) == (
        "edited",
        "ok",
        {"path": "fixed.txt", "content": "as I meant it"},
    )
    assert sorted(p.name for p in write.iterdir()) == ["fixed.txt"]
    agent.approvals.ask = lambda request: ("edit", {"path": "../outside/x.txt", "content": "x"})
    sneaky = run(agent, "write_file", path="ok.txt", content="x")
    assert (sneaky.approval, sneaky.status) == ("edited", "refused") and not (outside / "x.txt").exists()


def test_ask_shows_a_step_whose_result_is_empty(folders, capsys):
    """A tool may return nothing (an empty file): the one-line report must not fail on it."""
    import argparse

    from macaron_local.cli import ask

    read, write, _ = folders
    (read / "empty.txt").write_text("")
    step = run(agent_for(read, write), "read_file", path="empty.txt")
    assert (step.status, step.result) == ("ok", "")
    show = ask.step_reporter(argparse.Namespace(json=False))
    show(step)
    assert capsys.readouterr().err == "tool read_file: read-only, ok: \n"
