"""`StoreError`, and the one place SQLite's failures become sentences a user can act on.

SQLite reports a locked, read-only, full or foreign file as a terse code deep in a stack. The
store wraps every public operation in `sqlite_errors(path)`, so the CLI and the app print one
line that names the file and says what to do. Errors that mean a bug (a constraint the store
should have checked first, bad SQL) are left alone, so they still surface as tracebacks in tests.
"""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from macaron_local.errors import MacaronError


class StoreError(MacaronError):
    """The conversation store cannot be opened, read or written (locked, read-only, not SQLite,
    written by a newer version). Nothing was changed by the failing operation."""


def describe(exc: sqlite3.Error, path: Path) -> StoreError | None:
    """The user-facing StoreError for `exc`, or None when it is not the user's environment's fault."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    text = str(exc)
    if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "database is locked" in text:
        return StoreError(
            f"the store {path} is locked by another program and stayed locked past the timeout; "
            "close other macaron windows or jobs and try again (nothing was changed)"
        )
    if name.startswith("SQLITE_READONLY") or "readonly database" in text:
        return StoreError(
            f"the store {path} is read-only; make it and its folder writable by you (nothing was changed)"
        )
    if name.startswith(("SQLITE_CANTOPEN", "SQLITE_PERM", "SQLITE_AUTH")) or "unable to open" in text:
        return StoreError(
            f"cannot open the store {path}: check that its folder exists and is writable by you "
            "and that the path is a file"
        )
    if name.startswith("SQLITE_NOTADB") or "file is not a database" in text:
        return StoreError(f"{path} is not a SQLite database; move it aside and macaron will start a new store")
    if name.startswith("SQLITE_CORRUPT") or "malformed" in text:
        return StoreError(f"the store {path} is damaged ({text}); restore it from a backup or an export")
    if name.startswith("SQLITE_FULL") or "disk is full" in text:
        free = _free_bytes(path)
        if free is not None and free > ROOM_TO_WRITE:
            # SQLite says "full" too when AUTOINCREMENT has no id left to give (a row at 2^63 - 1).
            return StoreError(
                f"the store {path} is full, not its disk ({free / 1e9:.1f} GB free): it cannot take new rows "
                "(a row id or its size reached SQLite's limit); nothing was changed"
            )
        return StoreError(f"the disk holding {path} is full; free some space (nothing was changed)")
    if name.startswith("SQLITE_IOERR") or "disk I/O error" in text:
        return StoreError(f"input/output error on the store {path} ({text})")
    return None


#: Free space above which "database or disk is full" cannot mean the disk.
ROOM_TO_WRITE = 64 << 20


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(Path(path).parent).free
    except OSError:
        return None


@contextmanager
def sqlite_errors(path: Path) -> Iterator[None]:
    """Turn environmental SQLite failures inside the block into a one-line StoreError."""
    try:
        yield
    except sqlite3.Error as exc:
        error = describe(exc, path)
        if error is None:
            raise
        raise error from exc
