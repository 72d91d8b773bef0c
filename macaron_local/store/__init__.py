"""The experience store: every conversation, turn and correction, in one private SQLite file.

`open_store(path)` gives a migrated, ready `Store`; `open_default_store(settings)` opens the
user's, `Settings.data_dir / "macaron.db"`. Failures the user can fix (locked, read-only, not a
database, written by a newer version) raise `StoreError` with one clear line.
"""

from __future__ import annotations

from pathlib import Path

from macaron_local.settings import Settings
from macaron_local.store.connection import DEFAULT_BUSY_TIMEOUT_MS, connect
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


def open_store(path: Path, *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS) -> Store:
    """Open (or create) the store at `path`: folder 0700, files 0600, WAL, migrated."""
    path = Path(path)
    return Store(connect(path, busy_timeout_ms=busy_timeout_ms), path)


def default_store_path(settings: Settings) -> Path:
    return settings.data_dir / STORE_FILENAME


def open_default_store(settings: Settings) -> Store:
    """The user's store, in the data directory (created 0700 first)."""
    settings.ensure_dirs()
    return open_store(default_store_path(settings))
