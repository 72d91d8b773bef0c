"""Turning SQLite rows into the store's dataclasses (and JSON columns back into Python)."""

from __future__ import annotations

import json
from typing import Any

from sqlite_utils import Database

from macaron_local.store.models import Conversation, Feedback, LearningRun, Message, Turn


def dump_json(value: Any) -> str:
    """Canonical JSON for a TEXT column: the same value always gives the same bytes, which
    keeps export -> import -> export byte-identical."""
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def message(row: dict[str, Any]) -> Message:
    return Message(
        id=row["id"],
        conversation_id=row["conversation_id"],
        parent_id=row["parent_id"],
        role=row["role"],
        content=row["content"],
        created_at=row["created_at"],
    )


def turn(row: dict[str, Any]) -> Turn:
    calls = row.get("tool_calls")
    return Turn(
        **{
            **row,
            "adapters": json.loads(row["adapters"]),
            "sampling": json.loads(row["sampling"]),
            "tool_calls": json.loads(calls) if calls is not None else None,
        }
    )


def feedback(row: dict[str, Any]) -> Feedback:
    return Feedback(
        id=row["id"],
        conversation_id=row["conversation_id"],
        message_id=row["message_id"],
        kind=row["kind"],
        value=row["value"],
        text=row["text"],
        created_at=row["created_at"],
    )


def learning_run(row: dict[str, Any]) -> LearningRun:
    return LearningRun(
        **{
            **row,
            "feedback_ids": json.loads(row["feedback_ids"]),
            "metrics": json.loads(row["metrics"]),
            "tainted": bool(row["tainted"]),
        }
    )


def conversation(db: Database, row: dict[str, Any]) -> Conversation:
    """A conversation row plus all its messages, turns and feedback, in creation order."""
    cid = row["id"]
    return Conversation(
        **row,
        messages=[
            message(r)
            for r in db.query("SELECT * FROM messages WHERE conversation_id = ? ORDER BY created_at, id", [cid])
        ],
        turns=[
            turn(r) for r in db.query("SELECT * FROM turns WHERE conversation_id = ? ORDER BY created_at, id", [cid])
        ],
        feedback=[feedback(r) for r in db.query("SELECT * FROM feedback WHERE conversation_id = ? ORDER BY id", [cid])],
    )
