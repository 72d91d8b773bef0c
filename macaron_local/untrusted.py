"""Reading files the user hands us (imports, manifests, settings) without trusting them.

Every text format we import goes through here, so each limit is kept in one place:
- the path must be a regular file: a FIFO would block every command, a directory or a dangling
  symbolic link would end in a traceback; it is opened non-blocking and checked with fstat;
- its size is capped before it is read;
- JSON rejects NaN and Infinity (Python accepts them, SQLite stores them as NULL, and they
  come back out as non-standard JSON) and integers too long to parse;
- the decoded value may nest at most `MAX_DEPTH` deep (the parsers recurse: deeper input is a
  RecursionError), its integers must fit SQLite's signed 64 bits, and its strings must be
  encodable as UTF-8 (a lone surrogate escape `\\ud800` decodes to a str SQLite cannot store).
Every failure is one InvalidInputError that names the file (or line) and what is wrong.
"""

from __future__ import annotations

import json
import math
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

from macaron_local.errors import InvalidInputError, MacaronError

MAX_DEPTH = 32
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Manifests and settings are a few hundred bytes; this is generous and still bounded.
MAX_SMALL_FILE = 1 << 20


def open_regular(path: str | os.PathLike[str], what: str, error: type[MacaronError] = InvalidInputError) -> int:
    """A read-only fd for `path`, refused unless it is a regular file (never blocks on a FIFO).
    Errors read "`what` `path`: why" (`what` may be empty)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except FileNotFoundError:
        why = "a dangling symbolic link" if os.path.islink(path) else "no such file"
        raise error(f"{what} {path}: {why}") from None
    except IsADirectoryError:
        raise error(f"{what} {path}: a directory, not a file") from None
    except OSError as exc:
        raise error(f"{what} {path}: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a pipe, socket or device"
        raise error(f"{what} {path}: {kind}, not a regular file")
    return fd


def read_regular(
    path: str | os.PathLike[str],
    what: str,
    max_bytes: int = MAX_SMALL_FILE,
    error: type[MacaronError] = InvalidInputError,
) -> bytes:
    """The bytes of a regular file no bigger than `max_bytes`."""
    fd = open_regular(path, what, error)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise error(f"{what} {path} is {size} bytes; at most {max_bytes} are allowed")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise error(f"{what} {path} is over {max_bytes} bytes")
    return data


def read_text(
    path: str | os.PathLike[str],
    what: str,
    max_bytes: int = MAX_SMALL_FILE,
    error: type[MacaronError] = InvalidInputError,
) -> str:
    try:
        return read_regular(path, what, max_bytes, error).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not valid UTF-8 (bad byte at {exc.start})") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def load_json(text: str | bytes, where: str, error: type[MacaronError] = InvalidInputError) -> Any:
    """Standard JSON only (no NaN/Infinity), nested at most MAX_DEPTH, every value storable."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise error(f"{where}: nested more than {MAX_DEPTH} deep") from None
    except ValueError as exc:  # NaN/Infinity, or an integer with thousands of digits
        raise error(f"{where}: not standard JSON ({' '.join(str(exc).split())[:120]})") from None
    check_value(value, where, error)
    return value


def load_toml(text: str, where: str, error: type[MacaronError] = InvalidInputError) -> dict[str, Any]:
    """A TOML document, nested at most MAX_DEPTH, every value storable."""
    try:
        value = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{where} is not valid TOML ({' '.join(str(exc).split())[:160]})") from None
    except RecursionError:
        raise error(f"{where}: nested more than {MAX_DEPTH} deep") from None
    check_value(value, where, error)
    return value


def check_value(value: Any, where: str, error: type[MacaronError] = InvalidInputError) -> None:
    """Depth, integer range, finite floats and UTF-8-encodable strings, checked without recursion."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        item, depth, at = stack.pop()
        if depth > MAX_DEPTH:
            raise error(f"{where}: nested more than {MAX_DEPTH} deep")
        if isinstance(item, dict):
            for key, child in item.items():
                _check_string(key, where, f"{at}.{key}" if at else str(key), error)
                stack.append((child, depth + 1, f"{at}.{key}" if at else str(key)))
        elif isinstance(item, list):
            stack.extend((child, depth + 1, f"{at}[{i}]") for i, child in enumerate(item))
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            if not INT64_MIN <= item <= INT64_MAX:
                raise error(f"{where}: {at or 'a value'} is {_short(item)}, beyond a 64-bit integer")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise error(f"{where}: {at or 'a value'} is {item}, not a finite number")
        elif isinstance(item, str):
            _check_string(item, where, at, error)


def _check_string(text: object, where: str, at: str, error: type[MacaronError]) -> None:
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise error(f"{where}: {at or 'a string'} holds a lone surrogate (not valid Unicode text)") from None


def _short(number: int) -> str:
    digits = str(number) if abs(number) < 10**40 else f"a {len(str(abs(number)))}-digit number"
    return digits
