"""The daemon's settings: the `[daemon]` and `[learn]` tables of `settings.toml`.

They live in the one settings file (so the app, the CLI and the scheduled run agree) but are
parsed here, strictly: a typo in a key or a malformed window is one clear error, not a daemon
that silently never runs.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from datetime import time
from typing import Any

from macaron_local.errors import InvalidInputError
from macaron_local.learn.loop import KL_REFERENCES, LearnConfig
from macaron_local.settings import Settings

WINDOW_PATTERN = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")


@dataclass(frozen=True)
class Window:
    """A daily time window in local time; it may wrap past midnight (23:00-05:00)."""

    start: time
    end: time

    @classmethod
    def parse(cls, text: str) -> Window:
        match = WINDOW_PATTERN.match(str(text))
        if not match:
            raise InvalidInputError(f'daemon window must look like "02:00-06:00" (got {text!r})')
        h1, m1, h2, m2 = (int(g) for g in match.groups())
        if h1 > 23 or h2 > 23 or m1 > 59 or m2 > 59:
            raise InvalidInputError(f"daemon window {text!r} has an impossible time")
        if (h1, m1) == (h2, m2):
            raise InvalidInputError(f"daemon window {text!r} is empty: start and end are the same")
        return cls(time(h1, m1), time(h2, m2))

    def contains(self, moment: time) -> bool:
        moment = moment.replace(second=0, microsecond=0, tzinfo=None)
        if self.start < self.end:
            return self.start <= moment < self.end
        return moment >= self.start or moment < self.end

    def minutes(self) -> tuple[int, int]:
        """(start, length) in minutes since midnight."""
        start = self.start.hour * 60 + self.start.minute
        end = self.end.hour * 60 + self.end.minute
        return start, (end - start) % (24 * 60)

    def __str__(self) -> str:
        return f"{self.start:%H:%M}-{self.end:%H:%M}"


@dataclass(frozen=True)
class DaemonConfig:
    """When `macaron daemon run` may learn.

    The scheduler starts `daemon run` every `every_minutes` inside the window; the first start
    whose conditions hold learns, later ones find nothing new and exit. So a busy evening or a
    laptop on battery only delays learning, it does not skip the night.
    """

    window: Window = dataclasses.field(default_factory=lambda: Window.parse("02:00-06:00"))
    every_minutes: int = 30
    idle_minutes: int = 15  # no keyboard or mouse input, and a low load, for this long
    max_load: float = 0.5  # load average per CPU core that still counts as idle
    min_feedback: int = 10  # new corrections, ratings or regenerates since the last run
    require_ac: bool = True
    low_priority: bool = True  # nice 19 + idle CPU and IO classes; false on a dedicated machine

    def fire_times(self) -> list[tuple[int, int]]:
        """(hour, minute) of every scheduled start inside the window, in order."""
        start, length = self.window.minutes()
        return [divmod((start + offset) % (24 * 60), 60) for offset in range(0, length, self.every_minutes)]


def _typed(table: str, key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if not isinstance(value, bool):
            raise InvalidInputError(f"[{table}] {key} must be true or false (got {value!r})")
        return value
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise InvalidInputError(f"[{table}] {key} must be a whole number (got {value!r})")
    if kind is float and (isinstance(value, bool) or not isinstance(value, int | float)):
        raise InvalidInputError(f"[{table}] {key} must be a number (got {value!r})")
    if kind is str and not isinstance(value, str):
        raise InvalidInputError(f"[{table}] {key} must be text (got {value!r})")
    return kind(value)


def _table(settings: Settings, name: str) -> dict[str, Any]:
    value = settings.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidInputError(f"[{name}] in {settings.settings_file} must be a table")
    return value


def daemon_config(settings: Settings) -> DaemonConfig:
    """The `[daemon]` table, defaults filled in, every value checked."""
    raw = _table(settings, "daemon")
    kinds = {
        "every_minutes": int,
        "idle_minutes": int,
        "max_load": float,
        "min_feedback": int,
        "require_ac": bool,
        "low_priority": bool,
    }
    unknown = sorted(set(raw) - set(kinds) - {"window"})
    if unknown:
        raise InvalidInputError(f"unknown [daemon] setting {unknown[0]!r} (known: window, {', '.join(kinds)})")
    values: dict[str, Any] = {k: _typed("daemon", k, raw[k], kind) for k, kind in kinds.items() if k in raw}
    if "window" in raw:
        values["window"] = Window.parse(raw["window"])
    config = DaemonConfig(**values)
    if not 1 <= config.every_minutes <= 24 * 60:
        raise InvalidInputError("[daemon] every_minutes must be between 1 and 1440")
    if config.idle_minutes < 0 or config.min_feedback < 1 or config.max_load <= 0:
        raise InvalidInputError("[daemon] idle_minutes must be >= 0, min_feedback >= 1 and max_load > 0")
    return config


def learn_config(settings: Settings) -> LearnConfig:
    """The `[learn]` table over LearnConfig's defaults (steps, lr, rank, ...); the trainer is
    the `learning_backend` setting that `macaron learn` uses too, unless the table names one."""
    raw = _table(settings, "learn")
    fields = {f.name: f for f in dataclasses.fields(LearnConfig)}
    values: dict[str, Any] = {}
    if "backend" in fields and settings.get("learning_backend"):
        values["backend"] = str(settings.get("learning_backend"))
    for key, value in raw.items():
        if key not in fields:
            raise InvalidInputError(f"unknown [learn] setting {key!r} (known: {', '.join(fields)})")
        kind = type(getattr(LearnConfig(), key))
        values[key] = _typed("learn", key, value, kind)
    config = LearnConfig(**values)
    if config.trainer not in ("local", "tinker", "mint"):
        raise InvalidInputError(f'[learn] trainer must be "local", "tinker" or "mint" (got {config.trainer!r})')
    if config.kl_reference not in KL_REFERENCES:
        raise InvalidInputError(f'[learn] kl_reference must be "deployed" or "base" (got {config.kl_reference!r})')
    if config.steps < 1 or config.rank < 1 or config.lr <= 0:
        raise InvalidInputError("[learn] steps and rank must be >= 1 and lr > 0")
    if config.passage_weight < 0 or config.passages_per_step < 0:
        raise InvalidInputError("[learn] passage_weight and passages_per_step must be >= 0")
    if config.anchor_hold_weight < 0 or config.anchor_holds_per_step < 0:
        raise InvalidInputError("[learn] anchor_hold_weight and anchor_holds_per_step must be >= 0")
    if config.lesson_weight < 0 or config.lessons_per_step < 0 or config.lesson_questions < 0:
        raise InvalidInputError("[learn] lesson_weight, lessons_per_step and lesson_questions must be >= 0")
    if config.lesson_reward < 0:
        raise InvalidInputError(f"[learn] lesson_reward must be >= 0 (got {config.lesson_reward})")
    if config.imitation_visits < 0:
        raise InvalidInputError(f"[learn] imitation_visits must be >= 0 (got {config.imitation_visits})")
    if not 0 <= config.average_share <= 1:
        raise InvalidInputError(f"[learn] average_share must be from 0 to 1 (got {config.average_share})")
    return config
