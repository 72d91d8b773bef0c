"""`Store`: the experience store, every turn and every correction, kept for nightly learning.

One `Store` wraps one SQLite connection. It is safe to share between threads (the app writes a
reply from the generation thread while the UI records feedback): a lock serialises use of the
connection, and each public method is one transaction, so a half-done write never exists.
Other processes (the learning daemon, `macaron logs`) open their own connection; WAL plus a
busy timeout lets them read freely and take turns writing.

Conversations are trees. Editing a user message or regenerating a reply adds a sibling under the
same parent and moves `current_leaf_id`; nothing is ever overwritten, so the learner can compare
what the model said with what the user wanted.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TextIO

from sqlite_utils import Database

from macaron_local.errors import InvalidInputError
from macaron_local.store import jsonl, learning, registry, rows
from macaron_local.store.errors import sqlite_errors
from macaron_local.store.ids import new_id, now_iso
from macaron_local.store.models import (
    FEEDBACK_KINDS,
    ROLES,
    TURN_FIELDS,
    Conversation,
    ConversationSummary,
    FeedbackItem,
    ForgetResult,
    ImportResult,
    LearningRun,
    Message,
    SearchHit,
)
from macaron_local.store.registry import AdapterVersion, GcReport, NewVersion, Plugin
from macaron_local.store.search import (
    HIGHLIGHT_END,
    HIGHLIGHT_START,
    SNIPPET_ELLIPSIS,
    SNIPPET_TOKENS,
    fts_query,
)
from macaron_local.store.transactions import read_transaction, write_transaction

TITLE_LENGTH = 60


def auto_title(text: str) -> str:
    """A conversation's default title: the first user message, one line, about 60 characters."""
    line = " ".join(text.split())
    return line if len(line) <= TITLE_LENGTH else line[: TITLE_LENGTH - 1].rstrip() + "…"


class Store:
    """Conversations, messages, turns, feedback and learning runs in one SQLite file."""

    def __init__(self, db: Database, path: Path) -> None:
        self.db = db
        self.db_path = Path(path)
        self._lock = threading.RLock()

    # ----------------------------------------------------------------- plumbing
    @contextmanager
    def _writing(self) -> Iterator[Database]:
        with self._lock, sqlite_errors(self.db_path), write_transaction(self.db) as db:
            yield db

    @contextmanager
    def _reading(self) -> Iterator[Database]:
        with self._lock, sqlite_errors(self.db_path), read_transaction(self.db) as db:
            yield db

    def _one(self, sql: str, params: Sequence[Any] = ()) -> dict[str, Any] | None:
        return next(self.db.query(sql, list(params)), None)

    def _message_row(self, message_id: str) -> dict[str, Any]:
        row = self._one("SELECT * FROM messages WHERE id = ?", [message_id])
        if row is None:
            raise InvalidInputError(f"no message with id {message_id}")
        return row

    def _conversation_row(self, conversation_id: str) -> dict[str, Any]:
        row = self._one("SELECT * FROM conversations WHERE id = ?", [conversation_id])
        if row is None:
            raise InvalidInputError(f"no conversation with id {conversation_id}")
        return row

    # ----------------------------------------------------------------- writing a conversation
    def new_conversation(self, model: str, system_prompt: str = "", title: str | None = None) -> str:
        """Create an empty conversation; its title defaults to the first user message."""
        conversation_id, now = new_id(), now_iso()
        with self._writing() as db:
            db.execute(
                "INSERT INTO conversations (id, title, model, system_prompt, created_at, updated_at,"
                " current_leaf_id) VALUES (?, ?, ?, ?, ?, ?, NULL)",
                [conversation_id, title, model, system_prompt, now, now],
            )
        return conversation_id

    def add_message(self, conversation_id: str, role: str, content: str, parent_id: str | None = None) -> str:
        """Append a message under `parent_id` (None: a new root) and make it the current leaf.

        A second child under the same parent is how an edit or a regenerated reply branches.
        """
        with self._writing():
            return self._insert_message(conversation_id, role, content, parent_id)

    def _insert_message(self, conversation_id: str, role: str, content: str, parent_id: str | None) -> str:
        if role not in ROLES:
            raise InvalidInputError(f"message role must be one of {', '.join(ROLES)} (got {role!r})")
        if not isinstance(content, str):
            raise InvalidInputError("message content must be text")
        conversation = self._conversation_row(conversation_id)
        if parent_id is not None and self._message_row(parent_id)["conversation_id"] != conversation_id:
            raise InvalidInputError(f"message {parent_id} belongs to another conversation")
        message_id, now = new_id(), now_iso()
        self.db.execute(
            "INSERT INTO messages (id, conversation_id, parent_id, role, content, created_at)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            [message_id, conversation_id, parent_id, role, content, now],
        )
        title = conversation["title"]
        if title is None and role == "user" and content.strip():
            title = auto_title(content)
        self.db.execute(
            "UPDATE conversations SET current_leaf_id = ?, updated_at = ?, title = ? WHERE id = ?",
            [message_id, now, title, conversation_id],
        )
        return message_id

    def record_turn(
        self,
        conversation_id: str,
        message_id: str,
        *,
        model: str,
        expert: str | None = None,
        route_method: str | None = None,
        route_reason: str | None = None,
        adapters: Sequence[str] = (),
        sampling: Mapping[str, Any] | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        ttft_ms: float | None = None,
        total_ms: float | None = None,
        finish_reason: str | None = None,
        route_raw: str | None = None,
        route_ms: float | None = None,
        summary: str | None = None,
        summary_ms: float | None = None,
        thinking: str | None = None,
    ) -> str:
        """Record how an assistant message was produced (routing, adapters, sampling, timings):
        the learner needs to know which expert and adapter versions said what."""
        with self._writing():
            message = self._message_row(message_id)
            if message["conversation_id"] != conversation_id:
                raise InvalidInputError(f"message {message_id} belongs to another conversation")
            if message["role"] != "assistant":
                raise InvalidInputError(f"a turn records a reply; message {message_id} is a {message['role']}")
            turn_id = new_id()
            self.db.execute(
                "INSERT INTO turns (id, conversation_id, message_id, model, expert, route_method,"
                " route_reason, adapters, sampling, prompt_tokens, completion_tokens, ttft_ms, total_ms,"
                " finish_reason, created_at, route_raw, route_ms, summary, summary_ms, thinking)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    turn_id,
                    conversation_id,
                    message_id,
                    model,
                    expert,
                    route_method,
                    route_reason,
                    rows.dump_json(list(adapters)),
                    rows.dump_json(dict(sampling or {})),
                    prompt_tokens,
                    completion_tokens,
                    ttft_ms,
                    total_ms,
                    finish_reason,
                    now_iso(),
                    route_raw,
                    route_ms,
                    summary,
                    summary_ms,
                    thinking,
                ],
            )
            return turn_id

    def set_turn_summary(self, message_id: str, summary: str, summary_ms: float | None) -> None:
        """Attach the hidden summary hop's text to the turn of the reply that closed a task (the
        summary runs after the reply is stored, so a crash during it loses no reply)."""
        with self._writing() as db:
            cursor = db.execute(
                "UPDATE turns SET summary = ?, summary_ms = ? WHERE message_id = ?", [summary, summary_ms, message_id]
            )
            if cursor.rowcount == 0:
                raise InvalidInputError(f"no turn for message {message_id}")

    def set_turn_tool_calls(self, message_id: str, calls: Sequence[Mapping[str, Any]]) -> None:
        """Record the tool calls the reply `message_id` made and what became of each."""
        with self._writing() as db:
            cursor = db.execute(
                "UPDATE turns SET tool_calls = ? WHERE message_id = ?",
                [rows.dump_json([dict(c) for c in calls]), message_id],
            )
            if cursor.rowcount == 0:
                raise InvalidInputError(f"no turn for message {message_id}")

    def add_reply(self, conversation_id: str, parent_id: str, content: str, turn: Mapping[str, Any]) -> tuple[str, str]:
        """Store a finished reply and its turn together: never a reply without its provenance.

        `turn` holds `record_turn`'s keyword arguments. Returns (message_id, turn_id).
        """
        unknown = set(turn) - set(TURN_FIELDS)
        if unknown:
            raise TypeError(f"unknown turn fields: {', '.join(sorted(unknown))}")
        with self._writing():
            message_id = self._insert_message(conversation_id, "assistant", content, parent_id)
            turn_id = self.record_turn(conversation_id, message_id, **turn)
        return message_id, turn_id

    # ----------------------------------------------------------------- feedback
    def add_feedback(self, message_id: str, kind: str, value: int | None = None, text: str | None = None) -> int:
        """Record a correction, a +1/-1 rating or a regenerate on a reply; returns its id.

        This runs while the user is waiting on the UI, so it is one INSERT in one short
        transaction (no reads first on the happy path).
        """
        _check_feedback(kind, value, text)
        with self._writing() as db:
            cursor = db.execute(
                "INSERT INTO feedback (conversation_id, message_id, kind, value, text, created_at)"
                " SELECT conversation_id, id, ?, ?, ?, ? FROM messages WHERE id = ? AND role = 'assistant'",
                [kind, value, text, now_iso(), message_id],
            )
            if cursor.rowcount != 1:
                role = self._message_row(message_id)["role"]  # raises for an unknown id
                raise InvalidInputError(f"feedback is for replies; message {message_id} is a {role} message")
            return int(cursor.lastrowid or 0)

    # ----------------------------------------------------------------- reading the tree
    def get_message(self, message_id: str) -> Message:
        with self._reading():
            return rows.message(self._message_row(message_id))

    def path(self, message_id: str) -> list[Message]:
        """The branch from the root down to `message_id`, oldest first: what the model saw."""
        with self._reading() as db:
            found = list(
                db.query(
                    """WITH RECURSIVE up(id, depth) AS (
                        SELECT id, 0 FROM messages WHERE id = ?
                        UNION ALL
                        SELECT m.parent_id, up.depth + 1 FROM messages m JOIN up ON m.id = up.id
                        WHERE m.parent_id IS NOT NULL
                    )
                    SELECT messages.* FROM up JOIN messages ON messages.id = up.id ORDER BY up.depth DESC""",
                    [message_id],
                )
            )
        if not found:
            raise InvalidInputError(f"no message with id {message_id}")
        return [rows.message(row) for row in found]

    def children(self, message_id: str) -> list[Message]:
        """Direct replies to `message_id`, oldest first (several when it was regenerated)."""
        with self._reading() as db:
            self._message_row(message_id)
            found = db.query("SELECT * FROM messages WHERE parent_id = ? ORDER BY created_at, id", [message_id])
            return [rows.message(row) for row in found]

    def siblings(self, message_id: str) -> list[Message]:
        """All alternatives at this point of the tree, `message_id` included, oldest first."""
        with self._reading() as db:
            row = self._message_row(message_id)
            found = db.query(
                "SELECT * FROM messages WHERE conversation_id = ? AND parent_id IS ? ORDER BY created_at, id",
                [row["conversation_id"], row["parent_id"]],
            )
            return [rows.message(r) for r in found]

    def set_current_leaf(self, conversation_id: str, message_id: str, *, descend: bool = False) -> str:
        """Make the branch through `message_id` current; returns the leaf id now current.

        With `descend=True` it follows the newest child down to a leaf, which is what a UI
        wants when the user flips to another sibling.
        """
        with self._writing() as db:
            if self._message_row(message_id)["conversation_id"] != conversation_id:
                raise InvalidInputError(f"message {message_id} is not in conversation {conversation_id}")
            leaf = message_id
            while descend:
                child = self._one(
                    "SELECT id FROM messages WHERE parent_id = ? ORDER BY created_at DESC, id DESC LIMIT 1",
                    [leaf],
                )
                if child is None:
                    break
                leaf = child["id"]
            db.execute(
                "UPDATE conversations SET current_leaf_id = ?, updated_at = ? WHERE id = ?",
                [leaf, now_iso(), conversation_id],
            )
            return leaf

    def current_path(self, conversation_id: str) -> list[Message]:
        """The branch the user is looking at, root first (empty for a new conversation)."""
        with self._reading():
            leaf = self._conversation_row(conversation_id)["current_leaf_id"]
            return self.path(leaf) if leaf else []

    # ----------------------------------------------------------------- conversations
    def get_conversation(self, conversation_id: str) -> Conversation:
        """One conversation with every branch's messages, turns and feedback."""
        with self._reading():
            return rows.conversation(self.db, self._conversation_row(conversation_id))

    def resolve_conversation_id(self, id_or_prefix: str) -> str:
        """The full id for an id or a unique prefix of one (at least 4 characters)."""
        with self._reading() as db:
            if self._one("SELECT id FROM conversations WHERE id = ?", [id_or_prefix]):
                return id_or_prefix
            if len(id_or_prefix) >= 4:
                pattern = id_or_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
                found = [
                    r["id"]
                    for r in db.query("SELECT id FROM conversations WHERE id LIKE ? ESCAPE '\\' LIMIT 2", [pattern])
                ]
                if len(found) == 1:
                    return found[0]
                if len(found) > 1:
                    raise InvalidInputError(f"{id_or_prefix!r} matches several conversations; give more of the id")
        raise InvalidInputError(f"no conversation with id {id_or_prefix}")

    def list_conversations(self, limit: int = 50, offset: int = 0) -> list[ConversationSummary]:
        """Conversations, most recently updated first, with their message counts."""
        if limit < 0 or offset < 0:
            raise InvalidInputError("limit and offset must not be negative")
        with self._reading() as db:
            found = db.query(
                """SELECT c.id, c.title, c.model, c.updated_at,
                    (SELECT count(*) FROM messages m WHERE m.conversation_id = c.id) AS messages
                FROM conversations c ORDER BY c.updated_at DESC, c.id DESC LIMIT ? OFFSET ?""",
                [limit, offset],
            )
            return [ConversationSummary(**row) for row in found]

    def rename(self, conversation_id: str, title: str) -> None:
        """Set a conversation's title (blank titles are refused: the list needs something)."""
        title = " ".join(str(title).split())
        if not title:
            raise InvalidInputError("the title is empty")
        with self._writing() as db:
            self._conversation_row(conversation_id)
            db.execute("UPDATE conversations SET title = ? WHERE id = ?", [title, conversation_id])

    def search(self, query: str, limit: int = 20) -> list[SearchHit]:
        """Full-text search over every message, best match first.

        The user's words are quoted before they reach FTS5, so `"`, `*`, `AND`, `NEAR(` and
        friends are searched for as text instead of failing as query syntax.
        """
        match = fts_query(query)
        if match is None or limit <= 0:
            return []
        with self._reading() as db:
            found = db.query(
                """SELECT m.conversation_id, m.id AS message_id, m.role, m.created_at, c.title,
                    snippet(messages_fts, 0, ?, ?, ?, ?) AS snippet
                FROM messages_fts
                JOIN messages m ON m.rowid = messages_fts.rowid
                JOIN conversations c ON c.id = m.conversation_id
                WHERE messages_fts MATCH ? ORDER BY rank LIMIT ?""",
                [HIGHLIGHT_START, HIGHLIGHT_END, SNIPPET_ELLIPSIS, SNIPPET_TOKENS, match, limit],
            )
            return [SearchHit(**row) for row in found]

    # ----------------------------------------------------------------- for the learner
    def feedback_rows(self, since_id: int = 0, kinds: Sequence[str] | None = None) -> list[FeedbackItem]:
        """Feedback with id > `since_id`, oldest first, each with the path root..rated message.

        For a correction the path ends with the reply the user rejected; `feedback.text` is
        what it should have said.
        """
        kinds = tuple(kinds or FEEDBACK_KINDS)
        marks = ", ".join("?" for _ in kinds)
        with self._reading() as db:
            found = list(
                db.query(
                    f"""SELECT f.*, c.system_prompt, c.model FROM feedback f
                    JOIN conversations c ON c.id = f.conversation_id
                    WHERE f.id > ? AND f.kind IN ({marks}) ORDER BY f.id""",
                    [since_id, *kinds],
                )
            )
            return [
                FeedbackItem(
                    feedback=rows.feedback(row),
                    system_prompt=row["system_prompt"],
                    model=row["model"],
                    path=self.path(row["message_id"]),
                )
                for row in found
            ]

    def corrections(self, since_id: int = 0) -> list[FeedbackItem]:
        """Only the corrections: the strongest learning signal."""
        return self.feedback_rows(since_id, kinds=("correction",))

    def record_learning_run(
        self,
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
        """Record a learning run and the feedback ids it learned from, so `forget` can find it."""
        with self._writing() as db:
            return learning.record_run(
                db,
                slot=slot,
                status=status,
                feedback_ids=feedback_ids,
                decision=decision,
                reason=reason,
                metrics=metrics,
                adapter_version=adapter_version,
                started_at=started_at,
                finished_at=finished_at,
            )

    def set_learning_run_adapter(self, run_id: str, version_id: str) -> None:
        """Link a run to the adapter version it produced (registered after the run's record)."""
        with self._writing() as db:
            db.execute("UPDATE learning_runs SET adapter_version = ? WHERE id = ?", [version_id, run_id])

    def learning_runs(self) -> list[LearningRun]:
        """Every learning run, oldest first."""
        with self._reading() as db:
            return learning.runs(db)

    # ----------------------------------------------------------------- adapter registry
    @property
    def adapters_dir(self) -> Path:
        """Content-addressed adapter files live next to the database."""
        return self.db_path.parent / "adapters"

    def register_adapter(
        self, path: Path, *, slot: str, base_model: str, rank: int, peft_dir: Path | None = None, **details: Any
    ) -> AdapterVersion:
        """Copy `path` into the registry (content-addressed, atomic) and record a new version.

        `peft_dir`, the same adapter as a PEFT folder, is kept as its companion
        (`adapters/<sha256>.peft/`) for an engine that loads PEFT (vLLM)."""
        digest, stored = registry.store_file(Path(path), self.adapters_dir)
        if peft_dir is not None:
            registry.store_companion(Path(peft_dir), digest, self.adapters_dir)
        with self._writing() as db:
            # Again under the write lock: a garbage collection may have taken the files since.
            registry.ensure_file(Path(path), digest, self.adapters_dir)
            if peft_dir is not None:
                registry.store_companion(Path(peft_dir), digest, self.adapters_dir)
            version_id = registry.register(
                db, slot=slot, base_model=base_model, rank=rank, sha256=digest, path=stored, **details
            )
            return registry.get(db, version_id)

    def register_adapters(self, versions: Sequence[NewVersion]) -> list[str]:
        """Register many versions in one transaction (all or none); returns their ids in order.

        Each distinct file is hashed and copied once, before the write lock is taken.
        """
        stored = registry.store_files([v.file for v in versions], self.adapters_dir)
        with self._writing() as db:
            registry.ensure_files([(source, digest) for source, (digest, _) in stored.items()], self.adapters_dir)
            return registry.register_many(db, versions, stored)

    def adapter_lineage(self, version_id: str, limit: int | None = registry.PAGE) -> list[AdapterVersion]:
        """A version and its ancestors, newest first (at most `limit`)."""
        with self._reading() as db:
            return registry.lineage(db, version_id, limit)

    def slot_lineage(self, slot: str, base_model: str, limit: int | None = registry.PAGE) -> list[AdapterVersion]:
        """The deployed version of a slot and its ancestors, newest first."""
        with self._reading() as db:
            return registry.slot_lineage(db, slot, base_model, limit)

    def find_adapters(
        self,
        *,
        tag: str | None = None,
        base_model: str | None = None,
        limit: int = registry.PAGE,
        before: str | None = None,
    ) -> list[AdapterVersion]:
        """One page of versions with `tag` or for `base_model`, newest first."""
        if (tag is None) == (base_model is None):
            raise InvalidInputError("find adapters by a tag or by a base model")
        with self._reading() as db:
            if tag is not None:
                return registry.find_by_tag(db, tag, limit, before)
            return registry.find_by_base(db, base_model, limit, before)

    def tag_adapter(self, version_id: str, *tags: str) -> list[str]:
        """Add tags to a version; returns all of its tags."""
        with self._writing() as db:
            registry.get(db, version_id)
            registry.add_tags(db, version_id, tags)
            return registry.tags_of(db, version_id)

    def adapter_tags(self, version_id: str) -> list[str]:
        with self._reading() as db:
            return registry.tags_of(db, version_id)

    def collect_garbage(self, *, dry_run: bool = False, stale_temp_s: float = registry.STALE_TEMP_S) -> GcReport:
        """Delete adapter files no version references, deciding under the write lock."""
        with self._writing() as db:
            return registry.collect_garbage(db, self.adapters_dir, dry_run=dry_run, stale_temp_s=stale_temp_s)

    def damaged_adapter_files(self, *, deep: bool = False) -> list[tuple[str, str]]:
        """(sha256, problem) for each referenced adapter file that is missing or damaged."""
        with self._reading() as db:
            return registry.missing_files(db, self.adapters_dir, deep=deep)

    def add_plugin(self, path: Path, *, name: str, slot: str, base_model: str, rank: int, **row: Any) -> Plugin:
        """Register an imported adapter as a candidate version tagged `plugin:<name>`, and its
        plugin row, in one transaction."""
        digest, stored = registry.store_file(Path(path), self.adapters_dir)
        with self._writing() as db:
            registry.ensure_file(Path(path), digest, self.adapters_dir)
            if db.execute("SELECT 1 FROM plugins WHERE name = ?", [name]).fetchone():
                raise InvalidInputError(f"a plugin named {name!r} is already imported; remove it first")
            version_id = registry.register(
                db,
                slot=slot,
                base_model=base_model,
                rank=rank,
                sha256=digest,
                path=stored,
                tags=["plugin", f"plugin:{name}"],
                evaluations={"plugin": name, "validated": bool(row.get("validated"))},
            )
            registry.add_plugin(db, name=name, version_id=version_id, slot=slot, base_model=base_model, **row)
            return registry.get_plugin(db, name)

    def plugins(self) -> list[Plugin]:
        with self._reading() as db:
            return registry.plugins(db)

    def remove_plugin(self, name: str) -> tuple[Plugin, GcReport]:
        """Forget a plugin and its version, and delete its file unless another version uses it."""
        with self._writing() as db:
            plugin = registry.remove_plugin(db, name)
            return plugin, registry.collect_garbage(db, self.adapters_dir, only={plugin.sha256})

    def deploy_adapter(self, version_id: str) -> AdapterVersion:
        with self._writing() as db:
            return registry.deploy(db, version_id)

    def rollback_adapter(self, slot: str, base_model: str) -> AdapterVersion | None:
        with self._writing() as db:
            return registry.rollback(db, slot, base_model)

    def deployed_adapter(self, slot: str, base_model: str) -> AdapterVersion | None:
        with self._reading() as db:
            return registry.deployed(db, slot, base_model)

    def adapter_version(self, version_id: str) -> AdapterVersion:
        with self._reading() as db:
            return registry.get(db, version_id)

    def adapter_versions(
        self,
        slot: str | None = None,
        base_model: str | None = None,
        newest: int | None = None,
        learning_run_id: str | None = None,
    ) -> list[AdapterVersion]:
        with self._reading() as db:
            return registry.versions(db, slot, base_model, newest, learning_run_id)

    # ----------------------------------------------------------------- forgetting
    def forget(self, conversation_id: str) -> ForgetResult:
        """Delete a conversation everywhere and mark every learning run that learned from it.

        Messages, turns, feedback and search rows go in one transaction (cascades and FTS
        triggers). An adapter trained on the conversation still remembers it, so its runs are
        marked tainted and returned: the learner must retrain or drop those adapter versions.
        """
        with self._writing() as db:
            self._conversation_row(conversation_id)
            result = learning.forget(db, conversation_id)
        for digest in result.deleted_files:  # after the commit: a rolled-back forget keeps its files
            (self.adapters_dir / f"{digest}.gguf").unlink(missing_ok=True)
            registry.remove_companion(self.adapters_dir, digest)  # the same weights, as PEFT
        return result

    def forgotten_reason(self, version_id: str) -> str | None:
        """Why a version no longer has its file (it learned from a forgotten conversation)."""
        with self._reading() as db:
            return learning.forgotten_reason(db, version_id)

    # ----------------------------------------------------------------- export / import
    def export_jsonl(self, out: TextIO, conversation_ids: Sequence[str] | None = None) -> int:
        """Write one JSON line per conversation (everything, ids kept); returns how many."""
        with self._reading():
            return jsonl.export(self.db, out, conversation_ids)

    def import_jsonl(self, inp: IO[bytes] | IO[str]) -> ImportResult:
        """Import an export: all or nothing. Bad JSON or UTF-8 names its line; existing
        conversation ids are skipped and reported."""
        records = jsonl.parse(inp)  # validate everything before taking the write lock
        with self._writing():
            return jsonl.insert(self.db, records)

    # ----------------------------------------------------------------- upkeep
    def integrity_check(self) -> str:
        """SQLite's integrity check plus the search index's; "ok" when both pass."""
        with self._lock, sqlite_errors(self.db_path):
            result = "; ".join(str(r[0]) for r in self.db.execute("PRAGMA integrity_check").fetchall())
            try:
                self.db.execute("INSERT INTO messages_fts (messages_fts, rank) VALUES ('integrity-check', 1)")
            except sqlite3.DatabaseError as exc:  # FTS5 reports a mismatch as an error
                detail = f"search index: {exc}"
                return detail if result == "ok" else f"{result}; {detail}"
            return result

    def close(self) -> None:
        """Close the connection (SQLite checkpoints the WAL into the main file)."""
        with self._lock:
            self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_feedback(kind: str, value: int | None, text: str | None) -> None:
    """Validate feedback before touching the database (InvalidInputError says what is wrong)."""
    if kind not in FEEDBACK_KINDS:
        raise InvalidInputError(f"feedback kind must be one of {', '.join(FEEDBACK_KINDS)} (got {kind!r})")
    if kind == "rating":
        if isinstance(value, bool) or value not in (1, -1):
            raise InvalidInputError(f"a rating is +1 or -1 (got {value!r})")
    elif value is not None:
        raise InvalidInputError(f"a {kind} takes no value (got {value!r})")
    if text is not None and not isinstance(text, str):
        raise InvalidInputError("feedback text must be text")
    if kind == "correction" and not (text or "").strip():
        raise InvalidInputError("a correction needs the corrected reply")
