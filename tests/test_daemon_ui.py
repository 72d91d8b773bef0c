"""The app, driven by Textual's pilot: a version deployed by another process is announced at
once ("L0 Chat updated: ..."), the next reply is tagged with it, and the learning panel shows
the nightly run's status and its last outcome."""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime

from conftest import write_random_adapter
from textual.widgets import Markdown

from macaron_local.adapter_names import learned_when
from macaron_local.catalog import Catalog
from macaron_local.daemon.conditions import Probes
from macaron_local.daemon.runner import run_once
from macaron_local.session import Session
from macaron_local.store import open_default_store
from macaron_ui.app import MacaronApp
from macaron_ui.screens.modals import LearningScreen
from macaron_ui.widgets.message import MessageView
from macaron_ui.widgets.prompt import PromptInput

TURN = {"model": "tiny", "expert": "L0", "route_method": "default"}
ON_BATTERY = dataclasses.replace(Probes(), now=lambda: datetime(2026, 3, 1, 3, 0), on_ac=lambda: False)


async def until(pilot, condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.05)


async def test_a_deployment_elsewhere_is_announced_served_and_shown_in_the_panel(home, tiny_model, tmp_path):
    model = tiny_model("llama", False)
    Catalog(home).add_local("tiny", model.path)
    home.save(model="tiny", max_tokens=6)
    run_once(home, probe=ON_BATTERY)  # a night that did not learn, for the panel
    app = MacaronApp(home, session=Session(home, engine_config={"n_ctx": 128}))
    async with app.run_test(size=(110, 36)) as pilot:
        await until(pilot, lambda: app.chat is not None and app.chat.session.loaded)
        chat = app.chat
        with open_default_store(home) as other:  # the daemon's process
            ids = []
            for i in range(2):
                conversation = other.new_conversation("tiny")
                question = other.add_message(conversation, "user", f"q{i}")
                reply, _ = other.add_reply(conversation, question, "r", TURN)
                ids.append(other.add_feedback(reply, "correction", text="better"))
            path = write_random_adapter(tmp_path / "a.gguf", model, 2, seed=3)
            version = other.register_adapter(path, slot="L0", base_model="tiny", rank=2, feedback_ids=ids)
            other.deploy_adapter(version.id)
        await until(pilot, lambda: chat.updates_told == ["L0 Chat updated: learned from 2 corrections"])
        # Textual's notify posts a message: the toast lands a moment after the notice is counted.
        await until(pilot, lambda: any("L0 Chat updated" in str(n.message) for n in app._notifications))

        prompt = chat.query_one(PromptInput)
        prompt.focus()
        prompt.value = "hello"
        before = chat.turns_shown
        await pilot.press("enter")
        await until(pilot, lambda: chat.turns_shown > before and not chat.generating)
        [reply_view] = [v for v in chat.query(MessageView) if v.role == "assistant"][-1:]
        # The tag names the learned version by when it was learned, not by its id.
        assert f"personal, learned {learned_when(version.created_at)}" in reply_view.tag
        assert version.id not in reply_view.tag
        assert chat.updates_told == ["L0 Chat updated: learned from 2 corrections"]  # told once

        await pilot.press("ctrl+l")
        await until(pilot, lambda: isinstance(app.screen, LearningScreen))
        text = app.screen.render_status()
        assert "Nightly learning is not installed" in text and "window 02:00-06:00" in text
        assert "skipped (on battery power" in text
        assert f"**L0**: learned version `{version.id}` from 2 pieces of feedback" in text  # serving now
        assert "2 new pieces of feedback (corrections, ratings, regenerations) since the last run" in text
        assert "No learning run yet." in text
        assert app.screen.query_one("#learning", Markdown) is not None
