"""Export and import: one JSON object per conversation per line, everything kept, ids included.

The format is the store's own rows (a conversation, its message tree as a flat list with
`parent_id`, its turns and feedback), so export -> import into an empty store -> export is
byte-identical. Import is all or nothing: the whole file is read, decoded and checked first,
then written in one transaction; any bad line is reported by number and nothing is imported.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, TextIO

from sqlite_utils import Database

from macaron_local.errors import InvalidInputError
from macaron_local.store.models import FEEDBACK_KINDS, ROLES, TURN_FIELDS, ImportResult
from macaron_local.store.rows import dump_json
from macaron_local.untrusted import load_json

RECORD_TYPE = "macaron-local/conversation"
FORMAT_VERSION = 1
CONVERSATION_KEYS = ("id", "title", "model", "system_prompt", "created_at", "updated_at", "current_leaf_id")
MESSAGE_KEYS = ("id", "parent_id", "role", "content", "created_at")
TURN_KEYS = ("id", "message_id", *TURN_FIELDS, "created_at", "tool_calls")
FEEDBACK_KEYS = ("id", "message_id", "kind", "value", "text", "created_at")
#: The largest feedback id an import may keep. Ids above it are reserved: a row at SQLite's
#: limit (2^63 - 1) would leave AUTOINCREMENT no id to give the next correction.
MAX_IMPORTED_ID = 2**53 - 1


# ----------------------------------------------------------------- export
def export(db: Database, out: TextIO, conversation_ids: Sequence[str] | None = None) -> int:
    """Write the conversations (all, oldest first, or the ones named) to `out`; returns the count."""
    if conversation_ids is None:
        ids = [r[0] for r in db.execute("SELECT id FROM conversations ORDER BY created_at, id")]
    else:
        ids = list(dict.fromkeys(conversation_ids))
        marks = ", ".join("?" for _ in ids)
        known = {r[0] for r in db.execute(f"SELECT id FROM conversations WHERE id IN ({marks})", ids)}
        missing = [cid for cid in ids if cid not in known]
        if missing:
            raise InvalidInputError(f"no conversation with id {', '.join(missing)}")
    for cid in ids:
        out.write(_standard_json(_record(db, cid)) + "\n")
    return len(ids)


def _standard_json(record: dict[str, Any]) -> str:
    """One line of standard JSON: a non-finite timing stored by an older version becomes null
    instead of the `NaN`/`Infinity` tokens other JSON readers refuse."""
    try:
        return json.dumps(record, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_finite(record), ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _record(db: Database, cid: str) -> dict[str, Any]:
    def rows(sql: str) -> list[dict[str, Any]]:
        return list(db.query(sql, [cid]))

    (conversation,) = rows(f"SELECT {', '.join(CONVERSATION_KEYS)} FROM conversations WHERE id = ?")
    turns = rows(f"SELECT {', '.join(TURN_KEYS)} FROM turns WHERE conversation_id = ? ORDER BY created_at, id")
    for turn in turns:
        turn["adapters"] = json.loads(turn["adapters"])
        turn["sampling"] = json.loads(turn["sampling"])
        turn["tool_calls"] = json.loads(turn["tool_calls"]) if turn["tool_calls"] is not None else None
    return {
        "type": RECORD_TYPE,
        "version": FORMAT_VERSION,
        "conversation": conversation,
        "messages": rows(
            f"SELECT {', '.join(MESSAGE_KEYS)} FROM messages WHERE conversation_id = ? ORDER BY created_at, id"
        ),
        "turns": turns,
        "feedback": rows(f"SELECT {', '.join(FEEDBACK_KEYS)} FROM feedback WHERE conversation_id = ? ORDER BY id"),
    }


# ----------------------------------------------------------------- parse and check
@dataclass
class Record:
    """One validated line of an export, messages in insertable (parents first) order."""

    line: int
    conversation: dict[str, Any]
    messages: list[dict[str, Any]]
    turns: list[dict[str, Any]]
    feedback: list[dict[str, Any]]

    @property
    def id(self) -> str:
        return self.conversation["id"]


def parse(inp: IO[bytes] | IO[str]) -> list[Record]:
    """Decode and check every line; InvalidInputError naming the first bad line."""
    records = []
    for line, text in _lines(inp):
        if not text.strip():
            continue
        # Standard JSON only, nested at most untrusted.MAX_DEPTH, integers within SQLite's 64 bits,
        # no NaN/Infinity (SQLite would store them as NULL), no lone surrogates (SQLite cannot store them).
        data = load_json(text, f"line {line}")
        records.append(_check_record(data, line))
    return records


def _lines(inp: Iterable[bytes] | Iterable[str]) -> Iterator[tuple[int, str]]:
    """Number and decode lines ourselves: a binary file gives exact line numbers for bad UTF-8."""
    iterator = iter(inp)
    line = 0
    while True:
        try:
            raw = next(iterator)
        except StopIteration:
            return
        except UnicodeDecodeError:
            raise InvalidInputError(f"line {line + 1} (or near it): not valid UTF-8 text") from None
        line += 1
        if isinstance(raw, bytes):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidInputError(
                    f"line {line}: not valid UTF-8 text (bad byte at position {exc.start + 1})"
                ) from None
        else:
            text = raw
        yield line, text.removeprefix("\ufeff") if line == 1 else text


class _Checker:
    """Type checks for one line, with errors that say where."""

    def __init__(self, line: int) -> None:
        self.line = line

    def fail(self, what: str) -> InvalidInputError:
        return InvalidInputError(f"line {self.line}: {what}")

    def obj(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(f"{where} must be a JSON object")
        return value

    def items(self, data: dict[str, Any], key: str) -> list[dict[str, Any]]:
        value = data.get(key, [])
        if not isinstance(value, list):
            raise self.fail(f"{key!r} must be a list")
        return [self.obj(v, f"each of {key!r}") for v in value]

    def pick(self, data: dict[str, Any], keys: Sequence[str], where: str, types: dict[str, tuple]) -> dict:
        out = {}
        for key in keys:
            value = data.get(key)
            allowed = types.get(key, (str, type(None)))
            ok = isinstance(value, allowed) and not (isinstance(value, bool) and bool not in allowed)
            if not ok:
                raise self.fail(f"{where} field {key!r} has the wrong type ({type(value).__name__})")
            out[key] = value
        return out


_STR = (str,)
_OPT_INT = (int, type(None))
_OPT_NUM = (int, float, type(None))


def _check_record(data: Any, line: int) -> Record:
    check = _Checker(line)
    data = check.obj(data, "each line")
    if data.get("type", RECORD_TYPE) != RECORD_TYPE:
        raise check.fail(f"not a macaron-local conversation (type {data.get('type')!r})")
    version = data.get("version", FORMAT_VERSION)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise check.fail(f"written by a newer macaron-local (format version {version!r}); upgrade macaron-local")
    conversation = check.pick(
        check.obj(data.get("conversation"), "'conversation'"),
        CONVERSATION_KEYS,
        "conversation",
        {"id": _STR, "created_at": _STR, "updated_at": _STR},
    )
    if not conversation["id"]:
        raise check.fail("the conversation id is empty")
    messages = [
        check.pick(m, MESSAGE_KEYS, "message", {"id": _STR, "role": _STR, "content": _STR, "created_at": _STR})
        for m in check.items(data, "messages")
    ]
    turns = [
        check.pick(
            t,
            TURN_KEYS,
            "turn",
            {
                "id": _STR,
                "message_id": _STR,
                "created_at": _STR,
                "adapters": (list,),
                "sampling": (dict,),
                "prompt_tokens": _OPT_INT,
                "completion_tokens": _OPT_INT,
                "ttft_ms": _OPT_NUM,
                "total_ms": _OPT_NUM,
                "route_ms": _OPT_NUM,
                "summary_ms": _OPT_NUM,
                "tool_calls": (list, type(None)),
            },
        )
        for t in check.items(data, "turns")
    ]
    feedback = [
        check.pick(
            f,
            FEEDBACK_KEYS,
            "feedback",
            {"id": (int,), "message_id": _STR, "kind": _STR, "value": _OPT_INT, "created_at": _STR},
        )
        for f in check.items(data, "feedback")
    ]
    for raw in check.items(data, "messages"):
        if raw.get("conversation_id", conversation["id"]) != conversation["id"]:
            raise check.fail(f"message {raw.get('id')} names another conversation")
    by_id = {m["id"]: m for m in messages}
    if len(by_id) != len(messages):
        raise check.fail("a message id appears twice")
    for m in messages:
        if m["role"] not in ROLES:
            raise check.fail(f"message {m['id']} has an unknown role {m['role']!r}")
        if m["parent_id"] is not None and m["parent_id"] not in by_id:
            raise check.fail(f"message {m['id']} has a parent {m['parent_id']} that is not in this conversation")
    leaf = conversation["current_leaf_id"]
    if leaf is not None and leaf not in by_id:
        raise check.fail(f"current_leaf_id {leaf} is not one of the conversation's messages")
    for t in turns:
        if by_id.get(t["message_id"], {}).get("role") != "assistant":
            raise check.fail(f"turn {t['id']} does not belong to a reply of this conversation")
        if not all(isinstance(a, str) for a in t["adapters"]):
            raise check.fail(f"turn {t['id']} adapters must be a list of names")
    for f in feedback:
        if f["message_id"] not in by_id:
            raise check.fail(f"feedback {f['id']} is on a message that is not in this conversation")
        if f["kind"] not in FEEDBACK_KINDS:
            raise check.fail(f"feedback {f['id']} has an unknown kind {f['kind']!r}")
        if f["value"] not in (None, 1, -1) or (f["kind"] == "rating") != (f["value"] is not None):
            raise check.fail(f"feedback {f['id']} has an invalid value {f['value']!r}")
        if not 0 < f["id"] <= MAX_IMPORTED_ID:
            raise check.fail(f"feedback id {f['id']} must be from 1 to {MAX_IMPORTED_ID} (larger ids are reserved)")
    return Record(line, conversation, _parents_first(messages, check), turns, feedback)


def _parents_first(messages: list[dict[str, Any]], check: _Checker) -> list[dict[str, Any]]:
    """Order messages so each parent is inserted before its children (and refuse cycles)."""
    by_id = {m["id"]: m for m in messages}
    depth: dict[str, int] = {}
    for m in messages:
        chain = []
        node: str | None = m["id"]
        while node is not None and node not in depth:
            chain.append(node)
            if len(chain) > len(messages):
                raise check.fail(f"message {m['id']} is its own ancestor")
            node = by_id[node]["parent_id"]
        base = -1 if node is None else depth[node]
        for offset, mid in enumerate(reversed(chain), start=1):
            depth[mid] = base + offset
    return sorted(messages, key=lambda m: depth[m["id"]])


# ----------------------------------------------------------------- insert
def insert(db: Database, records: list[Record]) -> ImportResult:
    """Insert checked records inside the caller's transaction.

    Conversations whose id already exists are skipped. Feedback ids are kept when this store
    never used them; otherwise they get new ids, because a used id may still be named by a
    learning run (ids are never reused, even after `forget`).
    """
    imported: list[str] = []
    skipped: list[str] = []
    seen = {r[0] for r in db.execute("SELECT id FROM conversations")}
    last_used = db.execute(
        "SELECT max(coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'feedback'), 0),"
        " coalesce((SELECT max(id) FROM feedback), 0))"
    ).fetchone()[0]
    kept_ids: set[int] = set()
    renumber: list[tuple[Record, dict[str, Any]]] = []
    for record in records:
        if record.id in seen:
            skipped.append(record.id)
            continue
        seen.add(record.id)
        try:
            _insert_record(db, record)
            for f in record.feedback:
                if f["id"] > last_used and f["id"] not in kept_ids:
                    kept_ids.add(f["id"])
                    _insert_feedback(db, record.id, f, keep_id=True)
                else:
                    renumber.append((record, f))
        except sqlite3.IntegrityError as exc:
            raise InvalidInputError(
                f"line {record.line}: conflicts with what is already stored ({exc}); nothing was imported"
            ) from None
        imported.append(record.id)
    for record, f in renumber:
        _insert_feedback(db, record.id, f, keep_id=False)
    return ImportResult(imported=imported, skipped=skipped, renumbered_feedback=len(renumber))


def _insert_record(db: Database, record: Record) -> None:
    cid = record.id
    clash = [m["id"] for m in record.messages if _exists(db, "messages", m["id"])]
    if clash:
        raise InvalidInputError(
            f"line {record.line}: message {clash[0]} already exists in another conversation; nothing was imported"
        )
    c = record.conversation
    db.execute(
        _insert_sql("conversations", CONVERSATION_KEYS),
        [c[k] for k in CONVERSATION_KEYS],
    )
    db.conn.executemany(
        _insert_sql("messages", ("conversation_id", *MESSAGE_KEYS)),
        [[cid, *(m[k] for k in MESSAGE_KEYS)] for m in record.messages],
    )
    json_keys = {"adapters", "sampling", "tool_calls"}
    db.conn.executemany(
        _insert_sql("turns", ("conversation_id", *TURN_KEYS)),
        [
            [cid, *(dump_json(t[k]) if k in json_keys and t[k] is not None else t[k] for k in TURN_KEYS)]
            for t in record.turns
        ],
    )


def _insert_feedback(db: Database, cid: str, f: dict[str, Any], *, keep_id: bool) -> None:
    keys = FEEDBACK_KEYS if keep_id else FEEDBACK_KEYS[1:]
    db.execute(
        _insert_sql("feedback", ("conversation_id", *keys)),
        [cid, *(f[k] for k in keys)],
    )


def _exists(db: Database, table: str, row_id: str) -> bool:
    return db.execute(f"SELECT 1 FROM {table} WHERE id = ?", [row_id]).fetchone() is not None


def _insert_sql(table: str, keys: Sequence[str]) -> str:
    return f"INSERT INTO {table} ({', '.join(keys)}) VALUES ({', '.join('?' for _ in keys)})"
