"""Schema migrations, in the style of Simon Willison's `llm`: small named functions, run once.

Each `@migration` function is appended to `MIGRATIONS` in order; `_migrations` records the
name of every one that ran. `migrate(db)` runs the missing ones, each in its own write
transaction, so a crash mid-upgrade leaves the store at the previous, consistent version.

Rules: an applied migration is never edited (stores in the wild already ran it); a change is a
new function appended at the end. A store whose `_migrations` names a migration this code does
not know was written by a newer macaron-local: we refuse to touch it rather than guess.
"""

from __future__ import annotations

from collections.abc import Callable

from sqlite_utils import Database

from macaron_local.store.errors import StoreError
from macaron_local.store.ids import now_iso
from macaron_local.store.transactions import write_transaction

Migration = Callable[[Database], None]
MIGRATIONS: list[Migration] = []


def migration(fn: Migration) -> Migration:
    """Register `fn` as the next migration (its name is what `_migrations` records)."""
    MIGRATIONS.append(fn)
    return fn


def applied_migrations(db: Database) -> list[str]:
    """Names recorded in `_migrations`, in the order they ran (empty for a new store)."""
    if not db["_migrations"].exists():
        return []
    return [row["name"] for row in db.query("SELECT name FROM _migrations ORDER BY applied_at, name")]


def check_not_newer(db: Database) -> None:
    """Raise StoreError, changing nothing, if a newer macaron-local wrote this store."""
    known = {fn.__name__ for fn in MIGRATIONS}
    unknown = [name for name in applied_migrations(db) if name not in known]
    if unknown:
        path = _db_path(db)
        raise StoreError(
            f"{path} was written by a newer macaron-local (unknown migration {', '.join(unknown)}); "
            "upgrade macaron-local"
        )


def migrate(db: Database) -> list[str]:
    """Apply every migration the store lacks, each in one transaction; return their names."""
    check_not_newer(db)
    ran: list[str] = []
    for fn in MIGRATIONS:
        if fn.__name__ in applied_migrations(db):
            continue
        with write_transaction(db):
            db.execute("CREATE TABLE IF NOT EXISTS _migrations (name TEXT PRIMARY KEY, applied_at TEXT NOT NULL)")
            # Re-check under the write lock: another process may have just migrated.
            check_not_newer(db)
            if fn.__name__ in applied_migrations(db):
                continue
            fn(db)
            db.execute("INSERT INTO _migrations (name, applied_at) VALUES (?, ?)", [fn.__name__, now_iso()])
        ran.append(fn.__name__)
    return ran


def _db_path(db: Database) -> str:
    for row in db.execute("PRAGMA database_list").fetchall():
        if row[1] == "main":
            return row[2] or ":memory:"
    return "the store"


@migration
def m001_initial(db: Database) -> None:
    """Conversations as trees of messages, the turn behind each reply, feedback, learning runs."""
    statements = [
        """CREATE TABLE conversations (
            id TEXT PRIMARY KEY,
            title TEXT,
            model TEXT,
            system_prompt TEXT,
            created_at TEXT NOT NULL,
            updated_at TEXT NOT NULL,
            current_leaf_id TEXT
        )""",
        # parent_id cascades too: a subtree never outlives its root, whatever deletes it.
        """CREATE TABLE messages (
            id TEXT PRIMARY KEY,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            parent_id TEXT REFERENCES messages(id) ON DELETE CASCADE,
            role TEXT NOT NULL,
            content TEXT NOT NULL,
            created_at TEXT NOT NULL
        )""",
        """CREATE TABLE turns (
            id TEXT PRIMARY KEY,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            message_id TEXT NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
            model TEXT,
            expert TEXT,
            route_method TEXT,
            route_reason TEXT,
            adapters TEXT NOT NULL DEFAULT '[]',
            sampling TEXT NOT NULL DEFAULT '{}',
            prompt_tokens INTEGER,
            completion_tokens INTEGER,
            ttft_ms REAL,
            total_ms REAL,
            finish_reason TEXT,
            created_at TEXT NOT NULL
        )""",
        # AUTOINCREMENT: a feedback id is never reused, because learning_runs.feedback_ids
        # refers to it after the row itself may have been forgotten.
        """CREATE TABLE feedback (
            id INTEGER PRIMARY KEY AUTOINCREMENT,
            conversation_id TEXT NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
            message_id TEXT NOT NULL REFERENCES messages(id) ON DELETE CASCADE,
            kind TEXT NOT NULL CHECK (kind IN ('correction', 'rating', 'regenerate')),
            value INTEGER CHECK (value IS NULL OR value IN (-1, 1)),
            text TEXT,
            created_at TEXT NOT NULL
        )""",
        """CREATE TABLE learning_runs (
            id TEXT PRIMARY KEY,
            started_at TEXT NOT NULL,
            finished_at TEXT,
            slot TEXT,
            status TEXT,
            decision TEXT,
            reason TEXT,
            feedback_ids TEXT NOT NULL DEFAULT '[]',
            metrics TEXT NOT NULL DEFAULT '{}',
            adapter_version TEXT,
            tainted INTEGER NOT NULL DEFAULT 0,
            tainted_reason TEXT
        )""",
        # Every foreign key gets an index: cascades and tree walks must not scan tables.
        "CREATE INDEX idx_messages_conversation ON messages(conversation_id, created_at)",
        "CREATE INDEX idx_messages_parent ON messages(parent_id)",
        "CREATE INDEX idx_turns_conversation ON turns(conversation_id)",
        "CREATE INDEX idx_turns_message ON turns(message_id)",
        "CREATE INDEX idx_feedback_conversation ON feedback(conversation_id)",
        "CREATE INDEX idx_feedback_message ON feedback(message_id)",
        "CREATE INDEX idx_conversations_updated ON conversations(updated_at)",
    ]
    for sql in statements:
        db.execute(sql)
    # External-content FTS5 index kept in sync by triggers (insert, delete, update).
    db["messages"].enable_fts(["content"], create_triggers=True)


@migration
def m002_adapter_registry(db: Database) -> None:
    """Every adapter version (slot, base model, parent, rank, file hash, what it learned from,
    evaluations, status) and, per slot and base model, the one pointer deploy and rollback move."""
    statements = [
        """CREATE TABLE adapter_versions (
            id TEXT PRIMARY KEY,
            slot TEXT NOT NULL,
            base_model TEXT NOT NULL,
            parent_id TEXT REFERENCES adapter_versions(id),
            rank INTEGER NOT NULL,
            sha256 TEXT NOT NULL,
            path TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('candidate', 'deployed', 'rejected', 'retired')),
            learning_run_id TEXT,
            feedback_ids TEXT NOT NULL DEFAULT '[]',
            evaluations TEXT NOT NULL DEFAULT '{}',
            created_at TEXT NOT NULL
        )""",
        """CREATE TABLE deployments (
            slot TEXT NOT NULL,
            base_model TEXT NOT NULL,
            version_id TEXT REFERENCES adapter_versions(id),
            updated_at TEXT NOT NULL,
            PRIMARY KEY (slot, base_model)
        )""",
        "CREATE INDEX idx_adapter_versions_slot ON adapter_versions(slot, base_model, created_at)",
        "CREATE INDEX idx_adapter_versions_parent ON adapter_versions(parent_id)",
    ]
    for sql in statements:
        db.execute(sql)


@migration
def m003_registry_at_scale(db: Database) -> None:
    """What a registry of a million versions needs to answer in well under a millisecond:
    tags (a version has any number; `plugin:<name>` marks an imported plugin), versions by base
    model newest first, the versions behind a file (garbage collection asks for every file), and
    the plugins imported from outside with the manifest they came with."""
    statements = [
        # WITHOUT ROWID + (tag, version_id) as the key: a tag's versions, newest first (ids are
        # time-ordered), come straight off the primary key with no sort.
        """CREATE TABLE adapter_tags (
            tag TEXT NOT NULL,
            version_id TEXT NOT NULL REFERENCES adapter_versions(id) ON DELETE CASCADE,
            PRIMARY KEY (tag, version_id)
        ) WITHOUT ROWID""",
        "CREATE INDEX idx_adapter_tags_version ON adapter_tags(version_id)",
        "CREATE INDEX idx_adapter_versions_base ON adapter_versions(base_model, id)",
        "CREATE INDEX idx_adapter_versions_sha256 ON adapter_versions(sha256)",
        # slot is L0..L3 or the name of a new expert the plugin brings (new_expert = 1).
        """CREATE TABLE plugins (
            name TEXT PRIMARY KEY,
            version_id TEXT NOT NULL REFERENCES adapter_versions(id),
            slot TEXT NOT NULL,
            new_expert INTEGER NOT NULL DEFAULT 0,
            base_model TEXT NOT NULL,
            format TEXT NOT NULL CHECK (format IN ('gguf', 'peft')),
            validated INTEGER NOT NULL,
            source TEXT NOT NULL,
            manifest TEXT NOT NULL DEFAULT '{}',
            created_at TEXT NOT NULL
        )""",
        "CREATE INDEX idx_plugins_version ON plugins(version_id)",
    ]
    for sql in statements:
        db.execute(sql)


@migration
def m004_forgotten_adapter_versions(db: Database) -> None:
    """Versions whose adapter file was deleted because they learned from a forgotten
    conversation (the file encodes it), and why; and the index `forget` uses to find every
    version (rejected candidates too) a learning run produced."""
    db.execute(
        """CREATE TABLE forgotten_versions (
            version_id TEXT PRIMARY KEY REFERENCES adapter_versions(id),
            reason TEXT NOT NULL,
            forgotten_at TEXT NOT NULL
        )"""
    )
    db.execute("CREATE INDEX idx_adapter_versions_run ON adapter_versions(learning_run_id)")


@migration
def m005_protocol_hops(db: Database) -> None:
    """What the route and summary hops of Macaron's protocol did for a turn: the route hop's raw
    output and time, the hidden summary of the task the reply closed (read by the other experts'
    views) and its time, and the reasoning block kept apart from the reply."""
    for column, kind in (
        ("route_raw", "TEXT"),
        ("route_ms", "REAL"),
        ("summary", "TEXT"),
        ("summary_ms", "REAL"),
        ("thinking", "TEXT"),
    ):
        db.execute(f"ALTER TABLE turns ADD COLUMN {column} {kind}")


@migration
def m006_tool_calls(db: Database) -> None:
    """The tool calls a reply made (JSON list: tool, arguments, how it was approved, status,
    time and the tool message holding the result): an agent's trajectory, kept on the turn of
    the reply that called, exported with it and read by the nightly run."""
    db.execute("ALTER TABLE turns ADD COLUMN tool_calls TEXT")
