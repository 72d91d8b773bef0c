"""The experience store: every conversation, turn and correction, in one private SQLite file.

`open_store(path)` gives a migrated, ready `Store`; `open_default_store(settings)` opens the
user's, `Settings.data_dir / "macaron.db"`. Failures the user can fix (locked, read-only, not a
database, written by a newer version) raise `StoreError` with one clear line.
"""

from __future__ import annotations

from pathlib import Path

from macaron_local.settings import Settings
from macaron_local.store.connection import DEFAULT_BUSY_TIMEOUT_MS, connect, connect_readonly
from macaron_local.store.db import Store
from macaron_local.store.errors import StoreError
from macaron_local.store.models import (
    FEEDBACK_KINDS,
    ROLES,
    Conversation,
    ConversationSummary,
    Feedback,
    FeedbackItem,
    ForgetResult,
    ImportResult,
    LearningRun,
    Message,
    SearchHit,
    Turn,
)
from macaron_local.store.registry import AdapterVersion

STORE_FILENAME = "macaron.db"

__all__ = [
    "AdapterVersion",
    "FEEDBACK_KINDS",
    "ROLES",
    "STORE_FILENAME",
    "Conversation",
    "ConversationSummary",
    "Feedback",
    "FeedbackItem",
    "ForgetResult",
    "ImportResult",
    "LearningRun",
    "Message",
    "SearchHit",
    "Store",
    "StoreError",
    "Turn",
    "default_store_path",
    "open_default_store",
    "open_store",
]


def open_store(path: Path, *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS, readonly: bool = False) -> Store:
    """Open (or create) the store at `path`: folder 0700, files 0600, WAL, migrated.
    `readonly`: only read it (nothing created or written; a missing store reads as empty)."""
    path = Path(path)
    opener = connect_readonly if readonly else connect
    return Store(opener(path, busy_timeout_ms=busy_timeout_ms), path)


def default_store_path(settings: Settings) -> Path:
    return settings.data_dir / STORE_FILENAME


def open_default_store(settings: Settings, *, readonly: bool = False) -> Store:
    """The user's store, in the data directory (created 0700 first, unless only reading)."""
    if not readonly:
        settings.ensure_dirs()
    return open_store(default_store_path(settings), readonly=readonly)
