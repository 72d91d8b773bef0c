"""The real chat app, driven by Textual's pilot on the real embedded model; assertions read the
store's rows, not just the screen."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from textual.widgets import Collapsible, Input, TextArea

from macaron_local.session import Session
from macaron_local.settings import Settings
from macaron_local.store import open_default_store
from macaron_ui.app import MacaronApp
from macaron_ui.screens.chat import ChatScreen
from macaron_ui.screens.first_run import FirstRunScreen
from macaron_ui.screens.modals import EditorScreen, HelpScreen, LearningScreen
from macaron_ui.widgets.message import MessageView
from macaron_ui.widgets.prompt import PromptInput

SIZE = (110, 36)


@pytest.fixture
def settings(home: Settings) -> Settings:
    home.save(model="embedded", max_tokens=40)
    return home


async def until(pilot, condition, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.05)


def chat(app: MacaronApp) -> ChatScreen:
    screen = app.chat
    assert screen is not None
    return screen


async def send(pilot, app: MacaronApp, text: str) -> None:
    screen = chat(app)
    await until(pilot, lambda: screen.session.loaded)
    prompt = screen.query_one(PromptInput)
    prompt.focus()
    prompt.value = text
    await answered(pilot, app, lambda: pilot.press("enter"))


async def answered(pilot, app: MacaronApp, action) -> None:
    """Do `action` and wait until the reply it starts is finished and drawn."""
    screen = chat(app)
    before = screen.turns_shown
    await action()
    await until(pilot, lambda: screen.turns_shown > before and not screen.generating)


def replies(app: MacaronApp) -> list[MessageView]:
    return [v for v in chat(app).query(MessageView) if v.role == "assistant"]


def store_of(app: MacaronApp):
    return chat(app).session.store


async def test_send_streams_a_reply_and_records_the_turn(settings):
    app = MacaronApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, app, "What is the capital of France? Answer in one word.")
        views = replies(app)
        assert len(views) == 1 and "Paris" in views[0].text
        assert views[0].tag.startswith("L0 Chat")
        store = store_of(app)
        [summary] = store.list_conversations()
        conversation = store.get_conversation(summary.id)
        assert [m.role for m in conversation.messages] == ["user", "assistant"]
        [turn] = conversation.turns
        assert turn.expert == "L0" and turn.model == "embedded" and turn.completion_tokens > 0
        assert turn.finish_reason in ("stop", "length") and "Paris" in conversation.messages[1].content


async def test_correct_rate_regenerate_and_search(settings):
    app = MacaronApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, app, "Name a fruit.")
        store = store_of(app)
        original = replies(app)[-1]
        original_id = original.message_id
        original.focus()
        await pilot.press("plus")
        await pilot.pause(0.2)
        original = replies(app)[-1]
        original.focus()
        await pilot.press("e")
        await until(pilot, lambda: isinstance(app.screen, EditorScreen))
        app.screen.query_one(TextArea).text = "Teal."
        await pilot.press("ctrl+s")
        await until(pilot, lambda: replies(app) and replies(app)[-1].text == "Teal.")
        conversation = store.get_conversation(store.list_conversations()[0].id)
        kinds = sorted((f.kind, f.value, f.text) for f in conversation.feedback)
        assert kinds == [("correction", None, "Teal."), ("rating", 1, None)]
        assert all(f.message_id == original_id for f in conversation.feedback)
        assert replies(app)[-1].tag.startswith("L0 Chat") and "corrected by you" in " ".join(replies(app)[-1].marks)
        # The original reply is stored untouched; the model now sees the corrected version.
        assert [m.content for m in conversation.messages if m.role == "assistant"] != ["Teal."]
        assert chat(app).session.messages[-1] == {"role": "assistant", "content": "Teal."}

        await answered(pilot, app, lambda: pilot.press("ctrl+r"))  # regenerate the (corrected) reply
        conversation = store.get_conversation(conversation.id)
        assert [m.role for m in conversation.messages].count("assistant") == 2
        assert any(f.kind == "regenerate" for f in conversation.feedback)
        assert "branch 2/2" in " ".join(replies(app)[-1].marks)

        search = chat(app).query_one("#search", Input)
        search.focus()
        await pilot.press(*"fruit")
        await pilot.pause(0.3)
        listing = chat(app).query_one("#conversations")
        assert listing.option_count == 1 and listing.get_option_at_index(0).id == conversation.id


async def test_editing_a_message_branches_and_brackets_switch_branches(settings):
    app = MacaronApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, app, "Say hello.")
        user_view = next(v for v in chat(app).query(MessageView) if v.role == "user")
        user_view.focus()
        await pilot.press("e")
        await until(pilot, lambda: isinstance(app.screen, EditorScreen))
        app.screen.query_one(TextArea).text = "Say goodbye."
        await answered(pilot, app, lambda: pilot.press("ctrl+s"))
        store = store_of(app)
        conversation = store.get_conversation(store.list_conversations()[0].id)
        users = [m for m in conversation.messages if m.role == "user"]
        assert [m.content for m in users] == ["Say hello.", "Say goodbye."]
        assert users[0].parent_id == users[1].parent_id  # siblings: a branch, nothing overwritten
        shown = next(v for v in chat(app).query(MessageView) if v.role == "user")
        assert shown.text == "Say goodbye." and "branch 2/2" in " ".join(shown.marks)
        shown.focus()
        await pilot.press("left_square_bracket")
        await until(pilot, lambda: [v.text for v in chat(app).query(MessageView) if v.role == "user"] == ["Say hello."])
        assert len(replies(app)) == 1


async def test_quitting_with_an_unsaved_correction_warns_once_then_quits(settings):
    app = MacaronApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, app, "Name a fruit.")
        replies(app)[-1].focus()
        await pilot.press("e")
        await until(pilot, lambda: isinstance(app.screen, EditorScreen))
        app.screen.query_one(TextArea).text = "Teal."
        await pilot.press("ctrl+q")
        await pilot.pause(0.3)
        assert isinstance(app.screen, EditorScreen) and app.screen.query_one(TextArea).text == "Teal."
        assert app.is_running
        await pilot.press("ctrl+q")
        await until(pilot, lambda: not app.is_running, timeout=30)
    store = open_default_store(settings, readonly=True)
    assert not store.get_conversation(store.list_conversations()[0].id).feedback  # nothing saved


async def test_escape_cancels_and_keeps_what_was_said(settings):
    settings.save(max_tokens=400)
    app = MacaronApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        screen = chat(app)
        await until(pilot, lambda: screen.session.loaded)
        screen.query_one(PromptInput).value = "Write a very long story about a dragon."
        await pilot.press("enter")
        await until(pilot, lambda: replies(app) and len(replies(app)[-1].text) > 20)
        await pilot.press("escape")
        await until(pilot, lambda: not screen.generating)
        store = store_of(app)
        [turn] = store.get_conversation(store.list_conversations()[0].id).turns
        assert turn.finish_reason == "cancelled" and 0 < turn.completion_tokens < 400


async def test_help_learning_panel_and_export(settings, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    app = MacaronApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        await send(pilot, app, "Hi!")
        await pilot.press("f1")
        await until(pilot, lambda: isinstance(app.screen, HelpScreen))
        await pilot.press("escape")
        await pilot.press("ctrl+l")
        await until(pilot, lambda: isinstance(app.screen, LearningScreen))
        await pilot.press("p")
        await pilot.pause(0.1)
        assert Settings.load().get("learning_paused") is True
        await pilot.press("escape")
        chat(app).export_markdown()
        [exported] = list(tmp_path.glob("*.md"))
        assert "## User" in exported.read_text() and "Hi!" in exported.read_text()


async def test_first_run_offers_the_embedded_model(home):
    app = MacaronApp(home)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: isinstance(app.screen, FirstRunScreen))
        assert "GB free" in str(app.screen.query_one("#tall").label)
        fit = app.screen.query_one("#tall-fit")
        assert "Tall" in str(fit.render())  # whether it fits, with the numbers
        # ... all of them: the line wraps inside the dialog instead of running off its edge
        dialog = app.screen.query_one("#first-run")
        assert fit.region.right <= dialog.content_region.right
        assert fit.region.height * fit.region.width >= len(str(fit.render()))
        await pilot.click("#embedded")
        await until(pilot, lambda: app.chat is not None)
        assert Settings.load().configured()["model"] == "embedded"


async def test_app_reopens_the_last_conversation_with_its_correction(settings):
    session = Session(settings)
    session.send("What is 2 + 2?").wait()
    reply_id = session.leaf_id
    session.correct(reply_id, "4")
    session.close()
    app = MacaronApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: replies(app))
        assert replies(app)[-1].text == "4" and "corrected by you" in " ".join(replies(app)[-1].marks)


async def test_a_replys_thinking_is_folded_and_t_unfolds_it(settings):
    session = Session(settings)
    cid = session.store.new_conversation("embedded", "")
    question = session.store.add_message(cid, "user", "Is 7 prime?")
    turn = {"model": "embedded", "expert": "L0", "thinking": "7 has no divisors."}
    session.store.add_reply(cid, question, "Yes.", turn)
    session.close()
    app = MacaronApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: replies(app))
        view = replies(app)[-1]
        fold = view.query_one(Collapsible)
        assert view.text == "Yes." and view.thinking == "7 has no divisors." and fold.collapsed
        view.focus()
        await pilot.press("t")
        assert not fold.collapsed


def test_main_screen_snapshot(settings, snap_compare):
    async def loaded(pilot) -> None:
        await until(pilot, lambda: pilot.app.chat is not None and pilot.app.chat.session.loaded)
        pilot.app.chat.query_one(PromptInput).cursor_blink = False  # a blinking cursor is not a difference
        await pilot.pause(0.3)

    assert snap_compare(MacaronApp(settings), terminal_size=SIZE, run_before=loaded)


async def test_a_1mb_paste_shows_a_clear_error_and_the_app_stays_usable(settings):
    app = MacaronApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        screen = chat(app)
        await until(pilot, lambda: screen.session.loaded)
        screen.query_one(PromptInput).value = "x " * 500_000
        await answered(pilot, app, lambda: pilot.press("enter"))
        assert "too long" in str(screen.query_one("#status").render())
        store = store_of(app)
        [message] = store.get_conversation(store.list_conversations()[0].id).messages
        assert len(message.content) == 1_000_000
        await send(pilot, app, "Hello")
        assert replies(app)


QUIT_MIDWAY = """
import asyncio
from macaron_local.settings import Settings
from macaron_ui.app import MacaronApp
from macaron_ui.screens.modals import ToolApprovalScreen
from macaron_ui.widgets.message import MessageView
from macaron_ui.widgets.prompt import PromptInput

async def main():
    app = MacaronApp(Settings.load())
    async with app.run_test(size=(110, 40)) as pilot:
        screen = app.chat
        while not screen.session.loaded:
            await pilot.pause(0.05)
        screen.query_one(PromptInput).value = {prompt!r}
        await pilot.press("enter")
        while not ({ready}):
            await pilot.pause(0.05)
        await pilot.press("ctrl+q")
        while app.is_running:
            await pilot.pause(0.05)
    print("left midway")

asyncio.run(main())
"""


def quit_midway(prompt: str, ready: str, timeout: float) -> None:
    """Send `prompt` in the app, press Ctrl+Q once `ready` (an expression over `app` and
    `screen`) holds, and expect a clean exit. In a child process, so a hang fails the test
    instead of stalling the suite."""
    script = QUIT_MIDWAY.format(prompt=prompt, ready=ready)
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=os.environ.copy()
    )
    assert child.returncode == 0 and "left midway" in child.stdout, child.stderr[-2000:]


def test_quitting_while_a_reply_is_written_stops_it_and_exits(settings):
    """Ctrl+Q mid-reply used to hang for good: the app closed the engine on its loop while the
    writing worker held the engine and waited on that loop to show its next token."""
    settings.save(max_tokens=400)
    writing = '[v for v in screen.query(MessageView) if v.role == "assistant" and len(v.text) > 20]'
    quit_midway("Write a very long story about a dragon.", writing, timeout=180)
    with Session(Settings.load()) as session:
        [conversation] = session.store.list_conversations()
        [turn] = session.store.get_conversation(conversation.id).turns
    assert turn.finish_reason == "cancelled" and 0 < turn.completion_tokens < 400
