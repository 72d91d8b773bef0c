"""The one schema of a model manifest (`models/*.toml`, and the user's in the config folder).

A manifest the user wrote or copied decides which files macaron opens and where downloads go,
so it is checked when it is loaded: every known key's type, names matched whole (a name ending
in a newline is not a name), sha256 as 64 hex digits, sizes in range, and no file or subfolder
that climbs out of the model's folder. Errors name the file and the key.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any

from macaron_local.errors import InvalidInputError

NAME_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
SHA256 = re.compile(r"[0-9a-f]{64}")
SOURCE_KINDS = ("package", "huggingface", "path")
FORMATS = ("gguf", "peft")
TEXT_KEYS = ("file", "package", "repo", "revision", "subfolder")
MAX_TEXT = 4096
MAX_SIZE = 2**63 - 1  # what a file size can be (a 64-bit offset)


def _fail(where: str, key: str, what: str, value: Any) -> InvalidInputError:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return InvalidInputError(f"model manifest {where}: {key} must be {what} (got {shown})")


def _text(where: str, key: str, value: Any, max_length: int = MAX_TEXT) -> None:
    if not isinstance(value, str) or len(value) > max_length or any(ord(c) < 0x20 for c in value):
        raise _fail(where, key, f"text of at most {max_length} characters, without control characters", value)


def check_source(data: Any, where: str, table: str) -> None:
    if not isinstance(data, dict):
        raise _fail(where, f"[{table}]", "a table", data)
    kind = data.get("source")
    if kind not in SOURCE_KINDS:
        raise _fail(where, f"[{table}] source", "one of " + ", ".join(SOURCE_KINDS), kind)
    for key in TEXT_KEYS:
        if key in data:
            _text(where, f"[{table}] {key}", data[key])
    if kind != "path":  # relative to the model's folder or package: must stay inside it
        for key in ("file", "subfolder"):
            parts = PurePosixPath(str(data.get(key, "")).replace("\\", "/")).parts
            if ".." in parts or (parts and parts[0] == "/"):
                raise _fail(where, f"[{table}] {key}", "a path inside the model's folder", data[key])
    if "format" in data and data["format"] not in FORMATS:
        raise _fail(where, f"[{table}] format", "one of " + ", ".join(FORMATS), data["format"])
    if "sha256" in data and not (isinstance(data["sha256"], str) and SHA256.fullmatch(data["sha256"])):
        raise _fail(where, f"[{table}] sha256", "64 lowercase hex digits", data["sha256"])
    size = data.get("size")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_SIZE):
        raise _fail(where, f"[{table}] size", f"a whole number of bytes from 0 to {MAX_SIZE}", size)


def check_manifest(data: dict[str, Any], where: str, slots: tuple[str, ...]) -> None:
    """InvalidInputError naming the key unless `data` is a well-typed manifest."""
    if "name" not in data or "base" not in data:
        raise InvalidInputError(f"model manifest {where} needs 'name' and a [base] table")
    name = data["name"]
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise _fail(where, "name", "lowercase letters, digits, '.', '_' or '-' (64 at most)", name)
    if "description" in data:
        _text(where, "description", data["description"], 1000)
    if "architecture" in data:
        _text(where, "architecture", data["architecture"], 64)
    check_source(data["base"], where, "base")
    experts = data.get("experts", {})
    if not isinstance(experts, dict):
        raise _fail(where, "[experts]", "a table", experts)
    for slot, entry in experts.items():
        if slot not in slots:
            raise _fail(where, f"[experts.{slot}]", "one of " + ", ".join(slots), slot)
        if not isinstance(entry, dict):
            raise _fail(where, f"[experts.{slot}]", "a table", entry)
        if "name" in entry:
            _text(where, f"[experts.{slot}] name", entry["name"], 64)
        if "source" in entry:
            check_source(entry, where, f"experts.{slot}")
    training = data.get("training", {})
    if not isinstance(training, dict):
        raise _fail(where, "[training]", "a table", training)
    if "checkpoint" in training:
        _text(where, "[training] checkpoint", training["checkpoint"], 256)
