"""Tools in the chat app, driven by Textual's pilot on the embedded model: a call waits in the
approval modal showing the exact diff; approving runs it once, denying runs nothing; the call
and its result are drawn folded in the transcript."""

from __future__ import annotations

import pytest
from test_ui import quit_midway, until
from textual.widgets import Collapsible

from macaron_local.session import Session
from macaron_local.settings import Settings
from macaron_ui.app import MacaronApp
from macaron_ui.screens.modals import ToolApprovalScreen
from macaron_ui.widgets.message import MessageView
from macaron_ui.widgets.prompt import PromptInput

pytestmark = pytest.mark.slow
SIZE = (110, 40)


@pytest.mark.parametrize("key", ["y", "n"])
async def test_the_approval_modal_shows_the_call_and_only_approval_runs_it(home: Settings, tmp_path, key):
    work = tmp_path / "work"
    work.mkdir()
    tools = {"enabled": True, "write_folders": [str(work)], "tool_choice": "write_file", "max_steps": 1}
    home.save(model="embedded", max_tokens=160, tools=tools)
    app = MacaronApp(home)
    async with app.run_test(size=SIZE) as pilot:
        screen = app.chat
        await until(pilot, lambda: screen.session.loaded)
        prompt = screen.query_one(PromptInput)
        prompt.focus()
        prompt.value = "Write the word hello into the file notes.txt."
        before = screen.turns_shown
        await pilot.press("enter")
        await until(pilot, lambda: isinstance(app.screen, ToolApprovalScreen), timeout=240)
        modal = app.screen
        assert modal.request.tool.name == "write_file" and "+++ " in modal.request.preview
        assert list(work.iterdir()) == []  # nothing runs while the modal waits
        await pilot.press(key)
        await until(pilot, lambda: screen.turns_shown > before and not screen.generating, timeout=240)
        views = list(screen.query(MessageView))
        folds = [fold.title for view in views for fold in view.query(Collapsible)]
        store = screen.session.store
        [turn] = [t for t in store.get_conversation(screen.session.conversation_id).turns if t.tool_calls]
    assert any(title.startswith("Tool call: write_file") for title in folds)
    assert any(title.startswith("Tool result: ") for title in folds)
    [call] = turn.tool_calls
    if key == "y":
        assert call["approval"] == "approved" and call["status"] == "ok"
        assert [p.name for p in work.iterdir()] == [call["arguments"]["path"]]
    else:
        assert call["approval"] == "denied" and list(work.iterdir()) == []


def test_quitting_while_a_call_waits_for_approval_denies_it_and_exits(home: Settings, tmp_path):
    """Ctrl+Q with the approval modal up did nothing: the app's binding had lost the default's
    priority, so the modal took the key, and the agent's worker waited on the modal. Now Ctrl+Q
    denies the waiting call, stops the request and rates nothing (the user left; the call was
    not judged)."""
    work = tmp_path / "work"
    work.mkdir()
    tools = {"enabled": True, "write_folders": [str(work)], "tool_choice": "write_file", "max_steps": 3}
    home.save(model="embedded", max_tokens=160, tools=tools)
    quit_midway("Write the word hello into the file notes.txt.", "isinstance(app.screen, ToolApprovalScreen)", 240)
    assert list(work.iterdir()) == []
    with Session(Settings.load()) as session:
        [conversation] = session.store.list_conversations()
        stored = session.store.get_conversation(conversation.id)
    [turn] = [t for t in stored.turns if t.tool_calls]
    [call] = turn.tool_calls
    assert call["approval"] == "denied" and call["status"] == "denied"
    assert [t for t in stored.turns if t.tool_calls] == [turn]  # no further call was made after leaving
    assert stored.feedback == []  # leaving is not a judgement of the call
