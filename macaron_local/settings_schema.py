"""The one schema of `settings.toml`: every known key's type and range, checked when it is loaded.

Without it a wrong value (`n_ctx = "big"`, `temperature = -3`, `kv_switch = "fast"`) passes
`doctor` and fails later, deep inside llama.cpp or a worker thread. Now the file is refused when
it is read, with one line naming the key, what it must be and what it holds.

Keys added to `settings.DEFAULTS` without an entry here are checked against their default's
type. `[daemon]`, `[learn]`, `[tools]` and `[engine]` must be tables; their own keys are checked by
daemon/config.py, tools/config.py and engine/remote/config.py.
Unknown top-level keys are kept (a newer version may have written them) and listed by `doctor`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from macaron_local.errors import InvalidInputError


@dataclass(frozen=True)
class Field:
    kind: type
    low: float | None = None
    high: float | None = None
    choices: tuple[str, ...] = ()
    max_length: int | None = None
    nonempty: bool = False

    def describe(self) -> str:
        if self.choices:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        name = {bool: "true or false", int: "a whole number", float: "a number", str: "text"}[self.kind]
        if self.low is not None and self.high is not None:
            return f"{name} from {self.low:g} to {self.high:g}"
        if self.max_length is not None:
            return f"{'non-empty ' if self.nonempty else ''}{name} of at most {self.max_length} characters"
        return name


FIELDS: dict[str, Field] = {
    "model": Field(str, max_length=64, nonempty=True),
    "n_ctx": Field(int, 64, 1 << 22),
    "n_threads": Field(int, 0, 1024),
    "max_tokens": Field(int, 1, 1 << 20),
    "temperature": Field(float, 0.0, 10.0),
    "repeat_penalty": Field(float, 0.01, 10.0),
    "kv_switch": Field(str, choices=("state", "reset")),
    "system_prompt": Field(str, max_length=100_000),
    "learning_paused": Field(bool),
    "learning_backend": Field(str, choices=("auto", "torch", "mlx")),
    "routing": Field(str, choices=("model", "keywords")),
    "learning_setup": Field(str, choices=("accepted", "declined")),  # the first-run answer
}
TABLES = ("daemon", "learn", "tools", "engine")


def field_for(key: str, defaults: dict[str, Any]) -> Field | None:
    if key in FIELDS:
        return FIELDS[key]
    if key in defaults and defaults[key] is not None:
        kind = type(defaults[key])
        return Field(kind if kind in (bool, int, float, str) else str)
    return None


def check_setting(key: str, value: Any, where: str, defaults: dict[str, Any]) -> None:
    """InvalidInputError naming `key` unless `value` fits its field (unknown keys pass)."""
    if key in TABLES:
        if not isinstance(value, dict):
            raise InvalidInputError(f"{where}: [{key}] must be a table (got {type(value).__name__})")
        return
    spec = field_for(key, defaults)
    if spec is None:
        return
    ok = _fits(spec, value)
    if not ok:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        raise InvalidInputError(f"{where}: {key} must be {spec.describe()} (got {shown})")


def _fits(spec: Field, value: Any) -> bool:
    if spec.kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if spec.kind is int:
        if not isinstance(value, int):
            return False
    elif spec.kind is float:
        if not isinstance(value, int | float) or not math.isfinite(value):
            return False
    elif spec.kind is str:
        if not isinstance(value, str) or (spec.max_length is not None and len(value) > spec.max_length):
            return False
        if spec.choices and value not in spec.choices:
            return False
        return bool(value.strip()) or not spec.nonempty
    if spec.low is not None and value < spec.low:
        return False
    return not (spec.high is not None and value > spec.high)


def check_settings(values: dict[str, Any], where: str, defaults: dict[str, Any]) -> None:
    for key, value in values.items():
        check_setting(key, value, where, defaults)


def unknown_keys(values: dict[str, Any], defaults: dict[str, Any]) -> list[str]:
    return sorted(k for k in values if k not in FIELDS and k not in defaults and k not in TABLES)
