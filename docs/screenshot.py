"""Record docs/screenshot.svg from a real session: the embedded model answers, a reply is
corrected and rated. Run: python docs/screenshot.py (takes about half a minute)."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

from textual.widgets import TextArea

from macaron_local.settings import Settings
from macaron_ui.app import MacaronApp
from macaron_ui.screens.modals import EditorScreen
from macaron_ui.widgets.message import MessageView
from macaron_ui.widgets.prompt import PromptInput

OUT = Path(__file__).with_name("screenshot.svg")


async def wait(pilot, condition) -> None:
    while not condition():
        await pilot.pause(0.05)


async def main() -> None:
    settings = Settings.load(tempfile.mkdtemp(prefix="macaron-shot-"))
    settings.ensure_dirs()
    settings.save(model="embedded", max_tokens=120)
    app = MacaronApp(settings)
    async with app.run_test(size=(120, 40)) as pilot:
        chat = app.chat
        await wait(pilot, lambda: chat.session.loaded)
        for text in ("What is the capital of France?", "Write a python function that reverses a string."):
            before = chat.turns_shown
            chat.query_one(PromptInput).value = text
            await pilot.press("enter")
            await wait(pilot, lambda before=before: chat.turns_shown > before)
        first_reply = [v for v in chat.query(MessageView) if v.role == "assistant"][0]
        first_reply.focus()
        await pilot.press("e")
        await wait(pilot, lambda: isinstance(app.screen, EditorScreen))
        app.screen.query_one(TextArea).text = "Paris. (It has been the capital since 987.)"
        await pilot.press("ctrl+s")
        await pilot.pause(0.5)
        [v for v in chat.query(MessageView) if v.role == "assistant"][-1].focus()
        await pilot.press("plus")
        await pilot.pause(0.5)
        chat.query_one(PromptInput).cursor_blink = False
        app.save_screenshot(str(OUT))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    asyncio.run(main())
