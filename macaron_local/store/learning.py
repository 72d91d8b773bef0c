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

from macaron_local.store import registry, rows
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
    versions, rolled_back, files = {}, {}, []
    if tainted:
        versions, rolled_back, files = _withdraw_versions(db, [r["id"] for r in tainted], reason)
    db.execute("DELETE FROM conversations WHERE id = ?", [conversation_id])
    return ForgetResult(
        conversation_id=conversation_id,
        messages=messages,
        feedback=len(feedback_ids),
        tainted_runs=[r["id"] for r in tainted]
        + sorted({v for v in versions.values() if v} - {r["id"] for r in tainted}),
        adapter_versions=sorted(set(versions) | {r["adapter_version"] for r in tainted if r["adapter_version"]}),
        rolled_back=rolled_back,
        deleted_files=files,
    )


def _withdraw_versions(
    db: Database, run_ids: list[str], reason: str
) -> tuple[dict[str, str | None], dict[str, str | None], list[str]]:
    """Stop serving, and mark for deletion, every version that learned from the tainted runs.

    That is each version a tainted run produced (rejected candidates too: their files encode
    the data as well) and every descendant of one (a night continues from its parent's weights),
    whose runs are tainted in turn. Each deployment of such a version moves to its newest
    untainted ancestor, or is removed (the bare expert serves). Returns {version: its run},
    {"slot@base": version now served}, and the file hashes no remaining version uses (the
    caller deletes them once this transaction has committed).
    """
    marks = ",".join("?" * len(run_ids))
    seeds = [r[0] for r in db.execute(f"SELECT id FROM adapter_versions WHERE learning_run_id IN ({marks})", run_ids)]
    seeds += [r[0] for r in db.execute(f"SELECT adapter_version FROM learning_runs WHERE id IN ({marks})", run_ids)]
    found = list(
        db.execute(
            """WITH RECURSIVE down(id) AS (
                SELECT value FROM json_each(?) WHERE value IS NOT NULL
                UNION SELECT v.id FROM adapter_versions v JOIN down ON v.parent_id = down.id
            ) SELECT v.id, v.learning_run_id, v.sha256 FROM adapter_versions v JOIN down ON v.id = down.id""",
            [json.dumps(seeds)],
        )
    )
    versions = {row[0]: row[1] for row in found}
    if not versions:
        return {}, {}, []
    inherited = reason.replace("learned from", "grew from a version that learned from")
    for run_id in {run for run in versions.values() if run and run not in run_ids}:
        db.execute(
            "UPDATE learning_runs SET tainted = 1, tainted_reason = coalesce(tainted_reason || '; ', '') || ?"
            " WHERE id = ?",
            [inherited, run_id],
        )
    rolled_back: dict[str, str | None] = {}
    deployments = db.execute(
        f"SELECT slot, base_model, version_id FROM deployments WHERE version_id IN ({','.join('?' * len(versions))})",
        list(versions),
    ).fetchall()
    for slot, base_model, version_id in deployments:
        ancestor = next((v for v in registry.lineage(db, version_id, None) if v.id not in versions), None)
        if ancestor is None:
            db.execute("DELETE FROM deployments WHERE slot = ? AND base_model = ?", [slot, base_model])
        else:
            registry.deploy(db, ancestor.id)
        rolled_back[f"{slot}@{base_model}"] = ancestor.id if ancestor else None
    now = now_iso()
    for version_id in versions:
        db.execute("UPDATE adapter_versions SET status = 'retired' WHERE id = ? AND status != 'rejected'", [version_id])
        db.execute(
            # The first forget that withdrew a version is its reason; a later one it also learned
            # from does not rewrite it.
            "INSERT OR IGNORE INTO forgotten_versions (version_id, reason, forgotten_at) VALUES (?, ?, ?)",
            [version_id, f"{reason}: stopped serving and its adapter file deleted", now],
        )
    hashes = sorted({row[2] for row in found})
    still_used = {
        r[0]
        for r in db.execute(
            f"SELECT DISTINCT sha256 FROM adapter_versions WHERE sha256 IN ({','.join('?' * len(hashes))})"
            " AND id NOT IN (SELECT version_id FROM forgotten_versions)",
            hashes,
        )
    }
    return versions, rolled_back, [h for h in hashes if h not in still_used]


def forgotten_reason(db: Database, version_id: str) -> str | None:
    """Why a version's file was deleted (it learned from a forgotten conversation), or None."""
    row = db.execute("SELECT reason FROM forgotten_versions WHERE version_id = ?", [version_id]).fetchone()
    return row[0] if row else None
