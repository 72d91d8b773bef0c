"""The user's answer to "set learning up?", remembered in the settings file.

`learning_setup` is "accepted" or "declined" (absent: never asked). It only decides whether the
first run asks and how the status words a missing part ("you chose not to ..."); what will
actually happen is read from the machine every time. The settings file is written atomically
(temp file and rename), like every other setting.
"""

from __future__ import annotations

from macaron_local.settings import Settings

KEY = "learning_setup"
ACCEPTED, DECLINED = "accepted", "declined"


def current_choice(settings: Settings) -> str | None:
    value = settings.configured().get(KEY)
    return value if value in (ACCEPTED, DECLINED) else None


def remember(settings: Settings, choice: str) -> None:
    if choice not in (ACCEPTED, DECLINED):
        raise ValueError(choice)
    settings.save(**{KEY: choice})
