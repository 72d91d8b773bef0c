"""The adapter registry: every version ever trained or imported, and which one each slot serves.

Adapter files are content-addressed (`adapters/<sha256>.gguf`) and copied in atomically, so a
version's file never changes under its id. Deploy and rollback each move one pointer (the
`deployments` row of a slot and base model) and update statuses in one transaction: a crash
leaves either the old or the new version deployed, never neither.

Built for a million versions: every question a front end or the learner asks is one indexed
lookup or a bounded walk. Listings are pages (newest first, `limit` rows, `before` an id for
the next page), because a listing of everything would grow with the registry; lineage walks
`parent_id` with a recursive query that stops after `limit` ancestors.

Files and rows meet in two places, and both are ordered so that a crash or a concurrent
garbage collection can never leave a version pointing at a missing file: a file is copied in
first, then checked again under the write lock before the row that references it is inserted;
garbage collection decides and deletes under that same lock.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from macaron_local.errors import InvalidInputError
from macaron_local.store.adapter_files import (  # noqa: F401  (the registry's file half, re-exported)
    CONTENT_NAME,
    STALE_TEMP_S,
    TEMP_NAME,
    GcReport,
    collect_garbage,
    companion_path,
    disk_errors,
    ensure_file,
    ensure_files,
    missing_files,
    remove_companion,
    store_companion,
    store_file,
    store_files,
)
from macaron_local.store.ids import new_id, now_iso

STATUSES = ("candidate", "deployed", "rejected", "retired")
#: Rows a listing returns unless asked for another page size.
PAGE = 50
TAG_PATTERN = re.compile(r"^[^\s]{1,128}$")
#: Batches at least this big get a page cache of BULK_CACHE_KIB while they are inserted.
BULK_CACHE_ROWS = 1000
BULK_CACHE_KIB = 65536


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


@dataclass(frozen=True)
class NewVersion:
    """One version for `register_many`: metadata, plus the adapter file it is registered with.

    `file` is copied into the registry (content-addressed). `id` may be given in advance so a
    batch can name parents that are in the same batch (they must come earlier in it).
    """

    slot: str
    base_model: str
    rank: int
    file: Path
    parent_id: str | None = None
    learning_run_id: str | None = None
    feedback_ids: Sequence[int] = ()
    evaluations: Mapping[str, Any] | None = None
    status: str = "candidate"
    tags: Sequence[str] = ()
    id: str | None = None


@dataclass(frozen=True)
class Plugin:
    """An adapter imported from outside (a GGUF file or a PEFT directory and its manifest)."""

    name: str
    version_id: str
    slot: str
    new_expert: bool
    base_model: str
    format: str
    validated: bool
    source: str
    manifest: dict[str, Any]
    created_at: str
    sha256: str
    path: str
    rank: int
    status: str


def _version(row: Mapping[str, Any]) -> AdapterVersion:
    data = dict(row)
    data["feedback_ids"] = json.loads(data["feedback_ids"])
    data["evaluations"] = json.loads(data["evaluations"])
    return AdapterVersion(**data)


#: The version columns in AdapterVersion's field order: listings build versions from plain
#: tuples, which is most of what keeps a page of versions well under a millisecond.
COLUMNS = ", ".join(f.name for f in fields(AdapterVersion))


def _versions(db: Database, sql: str, params: Sequence[Any]) -> list[AdapterVersion]:
    """Run a query selecting `COLUMNS` (prefixed `v.` as needed) and build its versions."""
    loads = json.loads
    return [
        AdapterVersion(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], loads(r[9]), loads(r[10]), r[11])
        for r in db.conn.execute(sql, params)
    ]


# --------------------------------------------------------------------- registering
def _check_tags(tags: Iterable[str]) -> list[str]:
    out = []
    for tag in tags:
        if not isinstance(tag, str) or not TAG_PATTERN.fullmatch(tag):
            raise InvalidInputError(f"a tag is 1 to 128 characters without spaces (got {tag!r})")
        out.append(tag)
    return out


def _check_fields(slot: str, base_model: str, rank: int, status: str) -> None:
    if not slot or not isinstance(slot, str):
        raise InvalidInputError("an adapter version needs a slot")
    if not base_model or not isinstance(base_model, str):
        raise InvalidInputError("an adapter version needs a base model")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidInputError(f"an adapter's rank is a whole number >= 1 (got {rank!r})")
    if status not in STATUSES:
        raise InvalidInputError(f"status must be one of {', '.join(STATUSES)} (got {status!r})")


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
    tags: Sequence[str] = (),
) -> str:
    """Insert one version row (its file is already stored); returns the new id."""
    _check_fields(slot, base_model, int(rank), status)
    tags = _check_tags(tags)
    if parent_id is not None:
        get(db, parent_id)  # a clear error instead of a foreign-key failure
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
    add_tags(db, version_id, tags)
    return version_id


def register_many(db: Database, versions: Sequence[NewVersion], stored: Mapping[Path, tuple[str, Path]]) -> list[str]:
    """Insert many version rows at once (one executemany each for versions and tags).

    `stored` maps each version's source file to its (hash, registry path), from `ensure_file`.
    Call inside one write transaction: a failure anywhere registers nothing. A batch may not
    deploy (that moves a pointer: use `deploy`); a parent must exist or come earlier in it.
    """
    ids = [v.id or new_id() for v in versions]
    known: set[str] = set()
    outside: set[str] = set()  # parents that must already be registered
    rows, tag_rows = [], []
    now = now_iso()
    for version_id, v in zip(ids, versions, strict=True):
        _check_fields(v.slot, v.base_model, v.rank, v.status)
        if v.status == "deployed":
            raise InvalidInputError("a bulk registration cannot deploy; register, then deploy one version")
        if v.parent_id is not None and v.parent_id not in known:
            outside.add(v.parent_id)
        known.add(version_id)
        digest, path = stored[v.file]
        rows.append(
            (
                version_id,
                v.slot,
                v.base_model,
                v.parent_id,
                v.rank,
                digest,
                str(path),
                v.status,
                v.learning_run_id,
                json.dumps(list(v.feedback_ids)),
                json.dumps(dict(v.evaluations or {}), sort_keys=True),
                now,
            )
        )
        tag_rows.extend((tag, version_id) for tag in _check_tags(v.tags))
    missing = outside - _existing(db, outside)
    if missing:
        parent = min(missing)
        raise InvalidInputError(f"parent {parent} is neither registered nor earlier in the batch")
    with _bulk_cache(db, len(rows)):
        db.conn.executemany(
            "INSERT INTO adapter_versions (id, slot, base_model, parent_id, rank, sha256, path, status,"
            " learning_run_id, feedback_ids, evaluations, created_at) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
            rows,
        )
        db.conn.executemany("INSERT OR IGNORE INTO adapter_tags (tag, version_id) VALUES (?, ?)", tag_rows)
    return ids


@contextmanager
def _bulk_cache(db: Database, n_rows: int) -> Iterator[None]:
    """A larger page cache while a big batch goes in.

    Each index takes the batch's rows at a few thousand places (one per slot, base model, file,
    tag); with SQLite's default 2 MB cache those pages are evicted and re-read for every few
    rows, which halves the insert rate at a million versions. Restored afterwards.
    """
    if n_rows < BULK_CACHE_ROWS:
        yield
        return
    previous = db.execute("PRAGMA cache_size").fetchone()[0]
    db.execute(f"PRAGMA cache_size = -{BULK_CACHE_KIB}")
    try:
        yield
    finally:
        db.execute(f"PRAGMA cache_size = {int(previous)}")


def _existing(db: Database, ids: set[str]) -> set[str]:
    """Which of `ids` are registered (one query per 500)."""
    found: set[str] = set()
    chunk = sorted(ids)
    for start in range(0, len(chunk), 500):
        part = chunk[start : start + 500]
        marks = ",".join("?" * len(part))
        found.update(r[0] for r in db.execute(f"SELECT id FROM adapter_versions WHERE id IN ({marks})", part))
    return found


def add_tags(db: Database, version_id: str, tags: Iterable[str]) -> None:
    rows = [(tag, version_id) for tag in _check_tags(tags)]
    if rows:
        db.conn.executemany("INSERT OR IGNORE INTO adapter_tags (tag, version_id) VALUES (?, ?)", rows)


def remove_tags(db: Database, version_id: str, tags: Iterable[str]) -> None:
    db.conn.executemany(
        "DELETE FROM adapter_tags WHERE tag = ? AND version_id = ?", [(tag, version_id) for tag in tags]
    )


def tags_of(db: Database, version_id: str) -> list[str]:
    return [r[0] for r in db.execute("SELECT tag FROM adapter_tags WHERE version_id = ? ORDER BY tag", [version_id])]


# --------------------------------------------------------------------- reading
def get(db: Database, version_id: str) -> AdapterVersion:
    row = next(db.query("SELECT * FROM adapter_versions WHERE id = ?", [version_id]), None)
    if row is None:
        raise InvalidInputError(f"no adapter version {version_id}")
    return _version(row)


def deployed(db: Database, slot: str, base_model: str) -> AdapterVersion | None:
    """The version a slot serves: one primary-key lookup in `deployments`, one in the versions."""
    found = _versions(
        db,
        f"SELECT {_prefixed('v')} FROM deployments d JOIN adapter_versions v ON v.id = d.version_id"
        " WHERE d.slot = ? AND d.base_model = ?",
        [slot, base_model],
    )
    return found[0] if found else None


def lineage(db: Database, version_id: str, limit: int | None = PAGE) -> list[AdapterVersion]:
    """`version_id` and its ancestors, newest first: the parent_id chain, at most `limit` long.

    The recursive query stops after `limit` rows, so a walk costs the same whatever the
    registry's size; `limit=None` walks to the root (a cycle, which no API can create, still
    ends: the walk is bounded by the number of versions).
    """
    if limit is not None and limit < 1:
        raise InvalidInputError("limit must be at least 1")
    # The walk carries whole rows: one primary-key lookup per ancestor, no join back at the end.
    found = _versions(
        db,
        f"""WITH RECURSIVE up({COLUMNS}, depth) AS (
            SELECT {COLUMNS}, 0 FROM adapter_versions WHERE id = ?
            UNION ALL
            SELECT {_prefixed("v")}, up.depth + 1 FROM adapter_versions v JOIN up ON v.id = up.parent_id
            LIMIT ?
        )
        SELECT {COLUMNS} FROM up ORDER BY depth""",
        [version_id, limit if limit is not None else _count(db)],
    )
    if not found:
        raise InvalidInputError(f"no adapter version {version_id}")
    return found


def slot_lineage(db: Database, slot: str, base_model: str, limit: int | None = PAGE) -> list[AdapterVersion]:
    """The deployed version of a slot and what it grew from, newest first (empty: bare expert)."""
    current = deployed(db, slot, base_model)
    return lineage(db, current.id, limit) if current else []


def _prefixed(alias: str) -> str:
    return ", ".join(f"{alias}.{f.name}" for f in fields(AdapterVersion))


def _count(db: Database) -> int:
    return max(1, int(db.execute("SELECT max(rowid) FROM adapter_versions").fetchone()[0] or 1))


def _page(limit: int) -> int:
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidInputError(f"limit must be a whole number >= 1 (got {limit!r})")
    return limit


def find_by_tag(db: Database, tag: str, limit: int = PAGE, before: str | None = None) -> list[AdapterVersion]:
    """Versions carrying `tag`, newest first; pass the last id as `before` for the next page."""
    return _versions(
        db,
        f"SELECT {_prefixed('v')} FROM adapter_tags t JOIN adapter_versions v ON v.id = t.version_id"
        " WHERE t.tag = ? AND t.version_id < ? ORDER BY t.version_id DESC LIMIT ?",
        [tag, before or "~", _page(limit)],
    )


def find_by_base(db: Database, base_model: str, limit: int = PAGE, before: str | None = None) -> list[AdapterVersion]:
    """Versions trained for or imported onto `base_model`, newest first, one page at a time."""
    return _versions(
        db,
        f"SELECT {COLUMNS} FROM adapter_versions WHERE base_model = ? AND id < ? ORDER BY id DESC LIMIT ?",
        [base_model, before or "~", _page(limit)],
    )


def versions(
    db: Database,
    slot: str | None = None,
    base_model: str | None = None,
    newest: int | None = None,
    learning_run_id: str | None = None,
) -> list[AdapterVersion]:
    """Versions oldest first; with `newest`, only the last `newest` of them (a page, not the
    whole history: the registry may hold a million). `learning_run_id`: only the candidates
    that run registered (indexed: a run's few among every night's)."""
    clauses, params = [], []
    for column, value in (("slot", slot), ("base_model", base_model), ("learning_run_id", learning_run_id)):
        if value is not None:
            clauses.append(f"{column} = ?")
            params.append(value)
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    if newest is None:
        rows = db.query(f"SELECT * FROM adapter_versions {where} ORDER BY created_at, id", params)
        return [_version(r) for r in rows]
    rows = db.query(f"SELECT * FROM adapter_versions {where} ORDER BY id DESC LIMIT ?", [*params, int(newest)])
    return [_version(r) for r in rows][::-1]


# --------------------------------------------------------------------- deploying
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


def delete_version(db: Database, version_id: str) -> AdapterVersion:
    """Remove a version row that nothing depends on (an imported plugin being removed).

    Learned versions are kept forever for rollback; this is only for versions that are not
    deployed and have no descendants. Its tags go with it; its file stays until a collection.
    """
    version = get(db, version_id)
    if db.execute("SELECT 1 FROM deployments WHERE version_id = ?", [version_id]).fetchone():
        raise InvalidInputError(
            f"version {version_id} is deployed for {version.slot} on {version.base_model}; roll it back first"
        )
    child = db.execute("SELECT id FROM adapter_versions WHERE parent_id = ? LIMIT 1", [version_id]).fetchone()
    if child is not None:
        raise InvalidInputError(f"version {child[0]} was built on version {version_id}; it cannot be removed")
    db.execute("DELETE FROM adapter_tags WHERE version_id = ?", [version_id])
    db.execute("DELETE FROM adapter_versions WHERE id = ?", [version_id])
    return version


# --------------------------------------------------------------------- plugins
def add_plugin(
    db: Database,
    *,
    name: str,
    version_id: str,
    slot: str,
    new_expert: bool,
    base_model: str,
    format: str,
    validated: bool,
    source: str,
    manifest: Mapping[str, Any],
) -> None:
    if db.execute("SELECT 1 FROM plugins WHERE name = ?", [name]).fetchone():
        raise InvalidInputError(f"a plugin named {name!r} is already imported; remove it first")
    db.execute(
        "INSERT INTO plugins (name, version_id, slot, new_expert, base_model, format, validated, source,"
        " manifest, created_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
        [
            name,
            version_id,
            slot,
            int(new_expert),
            base_model,
            format,
            int(validated),
            source,
            json.dumps(dict(manifest), sort_keys=True),
            now_iso(),
        ],
    )


_PLUGIN_SELECT = (
    "SELECT p.*, v.sha256, v.path, v.rank, v.status FROM plugins p JOIN adapter_versions v ON v.id = p.version_id"
)


def _plugin(row: Mapping[str, Any]) -> Plugin:
    data = dict(row)
    data["manifest"] = json.loads(data["manifest"])
    data["new_expert"] = bool(data["new_expert"])
    data["validated"] = bool(data["validated"])
    return Plugin(**data)


def plugins(db: Database) -> list[Plugin]:
    return [_plugin(r) for r in db.query(f"{_PLUGIN_SELECT} ORDER BY p.name")]


def get_plugin(db: Database, name: str) -> Plugin:
    row = next(db.query(f"{_PLUGIN_SELECT} WHERE p.name = ?", [name]), None)
    if row is None:
        raise InvalidInputError(f"no plugin named {name!r} (see `macaron plugins list`)")
    return _plugin(row)


def remove_plugin(db: Database, name: str) -> Plugin:
    """Forget a plugin and its version; the caller collects its file if nothing else uses it."""
    plugin = get_plugin(db, name)
    db.execute("DELETE FROM plugins WHERE name = ?", [name])
    delete_version(db, plugin.version_id)
    return plugin
