"""The first run, driven by Textual's pilot on a fresh MACARON_HOME: the model is chosen, learning
is declined (remembered), then set up from the learning panel (Ctrl+L). The schedule is a dry
run: rendered for real, written nowhere, no systemctl. A correction's notice is the core's."""

from __future__ import annotations

import sys

from fake_pip_index import ISOLATED_PIP, fake_index, fake_plan
from test_ui import until
from textual.widgets import Markdown, Static, TextArea

from macaron_local.learning_setup import LearningSetup
from macaron_local.learning_setup.install import TrainerPlan
from macaron_local.settings import Settings
from macaron_ui.app import MacaronApp
from macaron_ui.screens.chat import ChatScreen
from macaron_ui.screens.first_run import FirstRunScreen
from macaron_ui.screens.learning_setup import LearningSetupScreen
from macaron_ui.screens.modals import EditorScreen, LearningScreen
from macaron_ui.widgets.message import MessageView
from macaron_ui.widgets.prompt import PromptInput

SIZE = (110, 40)


def showing(app, screen_type) -> bool:
    """That screen is on top and composed (a pushed screen is current before its widgets mount)."""
    return isinstance(app.screen, screen_type) and bool(app.screen.query("Button"))


def text_of(widget) -> str:
    return str(widget.render())


async def test_first_run_declines_then_sets_learning_up_from_the_panel(home, tmp_path, monkeypatch):
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(xdg))  # where the units would go; a dry run writes nothing
    home.save(max_tokens=12)
    # A trainer is installed here (dev extras); should one be missing, the plan refuses to download.
    no_download = TrainerPlan(None, "", "", blocked="tests never download a trainer")
    app = MacaronApp(home, learning_setup=LearningSetup(home, schedule_mode="dry-run", plan=no_download))
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: showing(app, FirstRunScreen))
        await pilot.click("#embedded")
        await until(pilot, lambda: showing(app, LearningSetupScreen))
        plan = text_of(app.screen.query_one("#setup-plan", Static))
        assert "Schedule: starts a learning run in the window 02:00-06:00" in plan
        assert "is installed already" in plan  # this test environment has a trainer
        await pilot.click("#setup-decline")
        await until(pilot, lambda: isinstance(app.screen, ChatScreen))
        assert Settings.load().configured()["learning_setup"] == "declined"

        # A correction now says, truthfully, that it will not be learned from, and what fixes it.
        chat = app.chat
        await until(pilot, lambda: chat.session.loaded)
        prompt = chat.query_one(PromptInput)
        prompt.value = "Name a colour."
        prompt.focus()
        await pilot.press("enter")
        await until(pilot, lambda: chat.turns_shown > 0 and not chat.generating)
        [reply] = [v for v in chat.query(MessageView) if v.role == "assistant"]
        reply.focus()
        await pilot.press("e")
        await until(pilot, lambda: isinstance(app.screen, EditorScreen))
        app.screen.query_one(TextArea).text = "Teal."
        await pilot.press("ctrl+s")
        await until(pilot, lambda: chat.learning_notices)
        trainer = LearningSetup(home).trainer().label  # PyTorch or MLX: whichever this environment has
        assert chat.learning_notices[-1] == (
            "Correction saved. macaron will not learn from it, because you chose not to set up learning, "
            f"so the nightly schedule is not installed ({trainer} is ready). Install it: Ctrl+L, then Set up learning."
        )

        await pilot.press("ctrl+l")
        await until(pilot, lambda: showing(app, LearningScreen))
        panel = app.screen
        shown = panel.query_one("#learning", Markdown).source
        assert "because you chose not to set up learning" in shown and "**Set up learning** (above)" in shown
        assert panel.query_one("#setup").display
        await pilot.click("#setup")
        await until(pilot, lambda: showing(app, LearningSetupScreen))
        setup_screen = app.screen
        await pilot.click("#setup-accept")
        await until(pilot, lambda: setup_screen.outcome is not None)
        schedule = setup_screen.outcome.schedule
        assert schedule.mode == "dry-run" and not schedule.written and not schedule.enabled
        timer = next(f for f in schedule.files if f.path.name == "macaron-learn.timer")
        assert timer.path.parent == xdg / "systemd" / "user"
        assert "OnCalendar=*-*-* 02,03,04,05:00,30:00" in timer.content and "Persistent=true" in timer.content
        service = next(f for f in schedule.files if f.path.name == "macaron-learn.service")
        assert "daemon run" in service.content
        assert not xdg.exists()  # rendered, not written
        assert Settings.load().configured()["learning_setup"] == "accepted"
        assert "dry run: would write" in text_of(setup_screen.query_one("#setup-result", Static))
        await pilot.click("#setup-done")
        await until(pilot, lambda: showing(app, LearningScreen))
        shown = app.screen.query_one("#learning", Markdown).source
        assert "you chose" not in shown  # the choice is now "accepted"
        assert "the nightly schedule is not installed" in shown  # a dry run installs nothing: still true


async def test_the_setup_screen_runs_pip_in_a_worker_with_a_progress_bar(home, tmp_path, monkeypatch):
    """No trainer importable in this process: the screen offers one with its size; accepting runs
    the real pip (against a local fake package) with a progress bar, then reports the truth."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for name in ("torch", "mlx", "mlx_lm"):
        monkeypatch.setitem(sys.modules, name, None)
    home.save(model="embedded")
    with fake_index(tmp_path / "index") as (url, wheel):
        plan = fake_plan(url, tmp_path / "site")
        setup = LearningSetup(home, schedule_mode="dry-run", pip=ISOLATED_PIP, plan=plan)
        app = MacaronApp(home, learning_setup=setup)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: app.chat is not None)
            await pilot.press("ctrl+l")
            await until(pilot, lambda: showing(app, LearningScreen))
            assert "learning is not set up on this computer" in app.screen.query_one("#learning", Markdown).source
            await pilot.click("#setup")
            await until(pilot, lambda: showing(app, LearningSetupScreen))
            screen = app.screen
            offer = text_of(screen.query_one("#setup-plan"))
            assert "Trainer: none is installed. Installs PyTorch, test build (a local fake)" in offer
            await pilot.click("#setup-accept")
            await until(pilot, lambda: screen.query_one("#setup-done").display)
            bar = screen.query_one("#setup-progress")
            assert bar.display and bar.total == wheel.stat().st_size and bar.progress == bar.total
            result = text_of(screen.query_one("#setup-result"))
            assert "still cannot be found" in result and "will not learn" in result
            assert (tmp_path / "site" / "macaron_fake_trainer").is_dir()  # pip really ran
