"""The adapter registry: every version ever trained, and which one each slot serves.

Adapter files are content-addressed (`adapters/<sha256>.gguf`) and copied in atomically, so a
version's file never changes under its id. Deploy and rollback each move one pointer (the
`deployments` row of a slot and base model) and update statuses in one transaction: a crash
leaves either the old or the new version deployed, never neither.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from macaron_local.errors import InvalidInputError
from macaron_local.hashing import sha256_file
from macaron_local.store.ids import new_id, now_iso


@dataclass(frozen=True)
class AdapterVersion:
    id: str
    slot: str
    base_model: str
    parent_id: str | None
    rank: int
    sha256: str
    path: str
    status: str
    learning_run_id: str | None
    feedback_ids: list[int]
    evaluations: dict[str, Any]
    created_at: str


def _version(row: Mapping[str, Any]) -> AdapterVersion:
    data = dict(row)
    data["feedback_ids"] = json.loads(data["feedback_ids"])
    data["evaluations"] = json.loads(data["evaluations"])
    return AdapterVersion(**data)


def store_file(source: Path, adapters_dir: Path) -> tuple[str, Path]:
    """Copy an adapter into the content-addressed folder (temp file + rename); returns (hash, path)."""
    digest = sha256_file(source)
    adapters_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    target = adapters_dir / f"{digest}.gguf"
    if not target.exists():
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.copyfile(source, tmp)
        os.chmod(tmp, 0o600)
        with tmp.open("rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    return digest, target


def register(
    db: Database,
    *,
    slot: str,
    base_model: str,
    rank: int,
    sha256: str,
    path: Path,
    parent_id: str | None = None,
    learning_run_id: str | None = None,
    feedback_ids: Sequence[int] = (),
    evaluations: Mapping[str, Any] | None = None,
    status: str = "candidate",
) -> str:
    version_id = new_id()
    db.execute(
        "INSERT INTO adapter_versions (id, slot, base_model, parent_id, rank, sha256, path, status,"
        " learning_run_id, feedback_ids, evaluations, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        [
            version_id,
            slot,
            base_model,
            parent_id,
            int(rank),
            sha256,
            str(path),
            status,
            learning_run_id,
            json.dumps(list(feedback_ids)),
            json.dumps(dict(evaluations or {}), sort_keys=True),
            now_iso(),
        ],
    )
    return version_id


def get(db: Database, version_id: str) -> AdapterVersion:
    row = next(db.query("SELECT * FROM adapter_versions WHERE id = ?", [version_id]), None)
    if row is None:
        raise InvalidInputError(f"no adapter version {version_id}")
    return _version(row)


def deployed(db: Database, slot: str, base_model: str) -> AdapterVersion | None:
    row = next(
        db.query(
            "SELECT v.* FROM deployments d JOIN adapter_versions v ON v.id = d.version_id"
            " WHERE d.slot = ? AND d.base_model = ?",
            [slot, base_model],
        ),
        None,
    )
    return _version(row) if row else None


def deploy(db: Database, version_id: str) -> AdapterVersion:
    """Point the version's slot at it; the version it replaces is retired (kept for rollback)."""
    version = get(db, version_id)
    previous = deployed(db, version.slot, version.base_model)
    if previous is not None and previous.id != version.id:
        db.execute("UPDATE adapter_versions SET status = 'retired' WHERE id = ?", [previous.id])
    db.execute("UPDATE adapter_versions SET status = 'deployed' WHERE id = ?", [version.id])
    db.execute(
        "INSERT INTO deployments (slot, base_model, version_id, updated_at) VALUES (?,?,?,?)"
        " ON CONFLICT(slot, base_model) DO UPDATE SET version_id = excluded.version_id,"
        " updated_at = excluded.updated_at",
        [version.slot, version.base_model, version.id, now_iso()],
    )
    return get(db, version.id)


def rollback(db: Database, slot: str, base_model: str) -> AdapterVersion | None:
    """Serve the deployed version's parent again (None: back to the bare expert)."""
    current = deployed(db, slot, base_model)
    if current is None:
        raise InvalidInputError(f"nothing is deployed for {slot} on {base_model}; there is nothing to roll back")
    db.execute("UPDATE adapter_versions SET status = 'retired' WHERE id = ?", [current.id])
    if current.parent_id is None:
        db.execute("DELETE FROM deployments WHERE slot = ? AND base_model = ?", [slot, base_model])
        return None
    return deploy(db, current.parent_id)


def versions(db: Database, slot: str | None = None, base_model: str | None = None) -> list[AdapterVersion]:
    clauses, params = [], []
    for column, value in (("slot", slot), ("base_model", base_model)):
        if value is not None:
            clauses.append(f"{column} = ?")
            params.append(value)
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    return [_version(r) for r in db.query(f"SELECT * FROM adapter_versions {where} ORDER BY created_at, id", params)]
