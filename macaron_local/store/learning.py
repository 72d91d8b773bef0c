"""What the nightly learner records, and what `forget` must undo.

A learning run names the feedback ids it trained on. Deleting a conversation removes its rows,
but an adapter trained on them still carries what it learned; so `forget` finds every run
whose `feedback_ids` include the conversation's feedback and marks it tainted, for the learner
to retrain or drop those adapter versions. Feedback ids are AUTOINCREMENT and never reused, so
an old run can never be confused with newer feedback that happens to get the same id.

These functions run inside the caller's transaction (see `Store`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from sqlite_utils import Database

from macaron_local.store import rows
from macaron_local.store.ids import new_id, now_iso
from macaron_local.store.models import ForgetResult, LearningRun


def record_run(
    db: Database,
    *,
    slot: str,
    status: str,
    feedback_ids: Sequence[int],
    decision: str | None = None,
    reason: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    adapter_version: str | None = None,
    started_at: str | None = None,
    finished_at: str | None = None,
) -> str:
    run_id = new_id()
    db.execute(
        "INSERT INTO learning_runs (id, started_at, finished_at, slot, status, decision, reason,"
        " feedback_ids, metrics, adapter_version) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            run_id,
            started_at or now_iso(),
            finished_at,
            slot,
            status,
            decision,
            reason,
            rows.dump_json([int(i) for i in feedback_ids]),
            rows.dump_json(dict(metrics or {})),
            adapter_version,
        ],
    )
    return run_id


def runs(db: Database) -> list[LearningRun]:
    return [rows.learning_run(r) for r in db.query("SELECT * FROM learning_runs ORDER BY started_at, id")]


def forget(db: Database, conversation_id: str) -> ForgetResult:
    """Taint the runs that used this conversation's feedback, then delete the conversation
    (messages, turns, feedback and search rows follow by cascade and triggers)."""
    feedback_ids = [r[0] for r in db.execute("SELECT id FROM feedback WHERE conversation_id = ?", [conversation_id])]
    messages = db.execute("SELECT count(*) FROM messages WHERE conversation_id = ?", [conversation_id]).fetchone()[0]
    tainted: list[dict[str, Any]] = []
    if feedback_ids:
        tainted = list(
            db.query(
                """SELECT id, adapter_version FROM learning_runs r
                WHERE EXISTS (SELECT 1 FROM json_each(r.feedback_ids) j
                              WHERE j.value IN (SELECT value FROM json_each(?)))
                ORDER BY started_at, id""",
                [json.dumps(feedback_ids)],
            )
        )
        reason = f"learned from forgotten conversation {conversation_id}"
        for run in tainted:
            db.execute(
                "UPDATE learning_runs SET tainted = 1, tainted_reason = CASE"
                " WHEN coalesce(tainted_reason, '') = '' THEN ? ELSE tainted_reason || '; ' || ? END"
                " WHERE id = ?",
                [reason, reason, run["id"]],
            )
    db.execute("DELETE FROM conversations WHERE id = ?", [conversation_id])
    return ForgetResult(
        conversation_id=conversation_id,
        messages=messages,
        feedback=len(feedback_ids),
        tainted_runs=[r["id"] for r in tainted],
        adapter_versions=sorted({r["adapter_version"] for r in tainted if r["adapter_version"]}),
    )
