"""The experience store against real SQLite files: schema, trees, feedback, search, forget,
export/import, and the failures a user can run into (read-only, locked, foreign, newer)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import sqlite3
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from macaron_local.errors import InvalidInputError
from macaron_local.store import Store, StoreError, open_store
from macaron_local.store.ids import new_id
from macaron_local.store.migrations import MIGRATIONS, migrate
from macaron_local.store.search import fts_query

TURN = {
    "model": "embedded",
    "expert": "L2",
    "route_method": "keywords",
    "route_reason": "matched 'python'",
    "adapters": ["L2-coding.gguf", "personal-v3"],
    "sampling": {"temperature": 0.0, "top_p": 0.95, "max_tokens": 512},
    "prompt_tokens": 31,
    "completion_tokens": 12,
    "ttft_ms": 41.5,
    "total_ms": 180.25,
    "finish_reason": "stop",
}


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "data" / "macaron.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[Store]:
    with open_store(db_path) as opened:
        yield opened


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def chat(store: Store, user: str = "How do I reverse a list in python?", reply: str = "Use reversed().") -> tuple:
    cid = store.new_conversation("embedded", "You are helpful.")
    question = store.add_message(cid, "user", user, None)
    answer, turn = store.add_reply(cid, question, reply, TURN)
    return cid, question, answer, turn


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


# ----------------------------------------------------------------- schema and migrations
def test_migrations_are_recorded_once_and_rerunning_is_a_no_op(db_path: Path) -> None:
    with open_store(db_path) as store:
        first = store.db.execute("SELECT name, applied_at FROM _migrations").fetchall()
        assert [name for name, _ in first] == [fn.__name__ for fn in MIGRATIONS]
        assert first[0][0] == "m001_initial"
        assert migrate(store.db) == []
    with open_store(db_path) as store:
        assert store.db.execute("SELECT name, applied_at FROM _migrations").fetchall() == first
        tables = set(store.db.table_names())
    assert {"conversations", "messages", "turns", "feedback", "learning_runs", "messages_fts"} <= tables


def test_a_store_from_a_newer_version_is_refused_and_left_unchanged(db_path: Path) -> None:
    open_store(db_path).close()
    with raw(db_path) as conn:
        conn.execute("INSERT INTO _migrations VALUES ('m099_from_the_future', '2099-01-01T00:00:00Z')")
    conn.close()
    before = sha256(db_path)
    with pytest.raises(StoreError) as caught:
        open_store(db_path)
    message = str(caught.value)
    assert "newer macaron-local" in message and "m099_from_the_future" in message and "upgrade" in message
    assert "\n" not in message
    assert sha256(db_path) == before


def test_files_are_private_and_the_connection_is_configured(tmp_path: Path) -> None:
    path = tmp_path / "fresh" / "nested" / "macaron.db"
    old = os.umask(0)  # even a permissive umask must not leak the store
    try:
        store = open_store(path)
        cid, *_ = chat(store)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE((tmp_path / "fresh").stat().st_mode) == 0o700
        for name in ("macaron.db", "macaron.db-wal", "macaron.db-shm"):
            assert stat.S_IMODE((path.parent / name).stat().st_mode) == 0o600, name
        pragma = {
            key: store.db.execute(f"PRAGMA {key}").fetchone()[0]
            for key in ("journal_mode", "foreign_keys", "synchronous", "busy_timeout")
        }
        assert pragma == {"journal_mode": "wal", "foreign_keys": 1, "synchronous": 1, "busy_timeout": 5000}
    finally:
        store.close()


def test_two_programs_creating_the_store_at_once_both_succeed(db_path: Path) -> None:
    opened: list[Store] = []
    errors: list[BaseException] = []

    def open_it() -> None:
        try:
            opened.append(open_store(db_path))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(opened) == 4
    assert opened[0].db.execute("SELECT count(*) FROM _migrations").fetchone()[0] == len(MIGRATIONS)
    for store in opened:
        store.close()


def test_ids_are_unique_and_sort_in_creation_order() -> None:
    ids = [new_id() for _ in range(20_000)]
    assert len(set(ids)) == len(ids)
    assert ids == sorted(ids)
    assert all(len(i) == 26 for i in ids)


# ----------------------------------------------------------------- conversations as trees
def test_edit_and_regenerate_add_siblings_and_nothing_is_overwritten(store: Store) -> None:
    cid, question, answer, _ = chat(store)
    # Regenerate: a second reply to the same question.
    again, _ = store.add_reply(cid, question, "Use list[::-1].", TURN)
    store.add_feedback(answer, "regenerate")
    assert [m.id for m in store.siblings(answer)] == [answer, again]
    assert [m.id for m in store.children(question)] == [answer, again]
    assert [m.id for m in store.current_path(cid)] == [question, again]
    # Edit the question: a sibling root, answered afresh.
    edited = store.add_message(cid, "user", "How do I reverse a tuple?", None)
    reply, _ = store.add_reply(cid, edited, "tuple(reversed(t))", TURN)
    assert [m.id for m in store.siblings(question)] == [question, edited]
    assert [m.content for m in store.current_path(cid)] == ["How do I reverse a tuple?", "tuple(reversed(t))"]
    # Going back to the first branch follows its newest reply down to a leaf.
    assert store.set_current_leaf(cid, question, descend=True) == again
    assert [m.id for m in store.current_path(cid)] == [question, again]
    assert store.set_current_leaf(cid, answer) == answer
    assert [m.id for m in store.path(answer)] == [question, answer]
    conversation = store.get_conversation(cid)
    contents = {m.content for m in conversation.messages}
    assert contents == {
        "How do I reverse a list in python?",
        "Use reversed().",
        "Use list[::-1].",
        "How do I reverse a tuple?",
        "tuple(reversed(t))",
    }
    assert conversation.current_leaf_id == answer
    assert len(conversation.turns) == 3 and conversation.turns[0].adapters == TURN["adapters"]
    assert conversation.turns[0].sampling == TURN["sampling"]
    assert conversation.title == "How do I reverse a list in python?"


def test_title_defaults_to_the_first_user_message_and_rename_changes_it(store: Store) -> None:
    cid = store.new_conversation("embedded")
    store.add_message(cid, "user", "  word " * 40, None)
    title = store.get_conversation(cid).title
    assert title is not None and len(title) <= 60 and title.startswith("word word") and title.endswith("…")
    store.rename(cid, "  Lists   and tuples ")
    assert store.list_conversations()[0].title == "Lists and tuples"
    with pytest.raises(InvalidInputError):
        store.rename(cid, "   ")


def test_list_conversations_newest_first_with_counts(store: Store) -> None:
    first, *_ = chat(store, "first")
    second, *_ = chat(store, "second")
    store.add_message(first, "user", "more", store.current_path(first)[-1].id)
    listed = store.list_conversations()
    assert [c.id for c in listed] == [first, second]
    assert [c.messages for c in listed] == [3, 2]
    assert [c.id for c in store.list_conversations(limit=1, offset=1)] == [second]


def test_conversation_ids_resolve_from_unique_prefixes(store: Store) -> None:
    first = store.new_conversation("embedded")
    second = store.new_conversation("embedded")
    shared = os.path.commonprefix([first, second])
    assert len(shared) >= 4  # ids start with the time, so these two share a prefix
    assert store.resolve_conversation_id(first) == first
    assert store.resolve_conversation_id(first[: len(shared) + 1].lower()) == first
    with pytest.raises(InvalidInputError, match="matches several conversations"):
        store.resolve_conversation_id(shared)
    with pytest.raises(InvalidInputError, match="no conversation with id 0%"):
        store.resolve_conversation_id("0%")


def test_add_reply_is_one_transaction(store: Store) -> None:
    cid, question, *_ = chat(store)
    before = store.db.execute("SELECT count(*) FROM messages").fetchone()[0]
    with pytest.raises(TypeError):
        store.add_reply(cid, question, "x", {**TURN, "colour": "blue"})
    with pytest.raises(InvalidInputError):
        store.add_reply(cid, "no-such-parent", "x", TURN)
    other = store.new_conversation("embedded")
    with pytest.raises(InvalidInputError, match="another conversation"):
        store.add_reply(other, question, "x", TURN)
    assert store.db.execute("SELECT count(*) FROM messages").fetchone()[0] == before
    assert store.db.execute("SELECT count(*) FROM turns").fetchone()[0] == 1
    with pytest.raises(InvalidInputError, match="records a reply"):
        store.record_turn(cid, question, **TURN)


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda s: s.add_message("nope", "user", "hi", None), "no conversation"),
        (lambda s: s.add_message(s.new_conversation("m"), "wizard", "hi", None), "role"),
        (lambda s: s.path("nope"), "no message"),
        (lambda s: s.get_conversation("nope"), "no conversation"),
        (lambda s: s.set_current_leaf(s.new_conversation("m"), "nope"), "no message"),
    ],
)
def test_bad_ids_are_invalid_input(store: Store, call, needle: str) -> None:
    with pytest.raises(InvalidInputError, match=needle):
        call(store)


# ----------------------------------------------------------------- feedback
def test_feedback_kinds_are_recorded_for_the_learner(store: Store) -> None:
    cid, question, answer, _ = chat(store)
    up = store.add_feedback(answer, "rating", 1, "nice")
    down = store.add_feedback(answer, "rating", -1)
    regen = store.add_feedback(answer, "regenerate")
    store.add_feedback(answer, "correction", text="Use lst[::-1] or reversed(lst).")
    assert up < down < regen
    assert store.current_path(cid)[-1].id == answer  # a correction is feedback: the tree is untouched
    kinds = [(f.kind, f.value, f.text) for f in store.get_conversation(cid).feedback]
    assert kinds == [
        ("rating", 1, "nice"),
        ("rating", -1, None),
        ("regenerate", None, None),
        ("correction", None, "Use lst[::-1] or reversed(lst)."),
    ]
    (item,) = store.corrections()
    assert [m.id for m in item.path] == [question, answer]
    assert item.feedback.text == "Use lst[::-1] or reversed(lst)." and item.system_prompt == "You are helpful."
    assert [i.feedback.id for i in store.feedback_rows(since_id=down)] == [regen, item.feedback.id]


@pytest.mark.parametrize(
    ("kind", "value", "text", "needle"),
    [
        ("like", None, None, "kind must be one of"),
        ("rating", None, None, r"\+1 or -1"),
        ("rating", 5, None, r"\+1 or -1"),
        ("rating", True, None, r"\+1 or -1"),
        ("regenerate", 1, None, "takes no value"),
        ("correction", None, None, "needs the corrected reply"),
        ("correction", None, "   ", "needs the corrected reply"),
        ("correction", -1, "x", "takes no value"),
    ],
)
def test_feedback_is_validated(store: Store, kind: str, value, text, needle: str) -> None:
    _, _, answer, _ = chat(store)
    with pytest.raises(InvalidInputError, match=needle):
        store.add_feedback(answer, kind, value, text)
    assert store.db.execute("SELECT count(*) FROM feedback").fetchone()[0] == 0


def test_feedback_needs_an_existing_reply(store: Store) -> None:
    _, question, _, _ = chat(store)
    with pytest.raises(InvalidInputError, match="no message"):
        store.add_feedback("missing", "rating", 1)
    with pytest.raises(InvalidInputError, match="for replies"):
        store.add_feedback(question, "rating", 1)


def test_one_store_is_safe_to_share_between_threads(store: Store) -> None:
    cid, question, answer, _ = chat(store)
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(25):
                if n % 2:
                    store.add_feedback(answer, "rating", 1)
                else:
                    store.add_reply(cid, question, f"reply {n}-{i}", TURN)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    conversation = store.get_conversation(cid)
    assert len(conversation.feedback) == 50 and len(conversation.turns) == 51


# ----------------------------------------------------------------- search
def test_search_finds_words_with_snippets(store: Store) -> None:
    cid, question, answer, _ = chat(store, "Tell me about the Eiffel tower", "It is in Paris, built in 1889.")
    chat(store, "Something else", "Nothing to see")
    (hit,) = store.search("paris")
    assert (hit.conversation_id, hit.message_id, hit.role) == (cid, answer, "assistant")
    assert "**Paris**" in hit.snippet and hit.title == "Tell me about the Eiffel tower"
    assert [h.message_id for h in store.search("eiff*")] == [question]
    assert store.search("paris tower") == []  # every word must appear in the message


@pytest.mark.parametrize(
    "query",
    [
        '"unbalanced',
        "AND OR",
        "*",
        "NEAR(",
        "NEAR(a b",
        "a:b",
        "col:",
        "-",
        "^",
        '""',
        "(",
        ")",
        "a AND",
        "'",
        "_",
        "__*",
        "\\",
        "{a b}",
        "NOT",
        "+",
        "🙂",
        "\x00",
        "   ",
        "",
        "a*b*",
        "**x",
        "x**",
    ],
)
def test_hostile_search_queries_never_crash(store: Store, query: str) -> None:
    chat(store, 'An "unbalanced quote, AND OR NEAR( and a * star', "fine")
    hits = store.search(query)
    assert isinstance(hits, list)


def test_search_quoting_finds_operator_words_as_text(store: Store) -> None:
    cid, question, *_ = chat(store, 'An "unbalanced quote, AND OR NEAR( a star', "fine")
    assert [h.message_id for h in store.search('"unbalanced')] == [question]
    assert [h.message_id for h in store.search("AND OR")] == [question]
    assert [h.message_id for h in store.search("NEAR(")] == [question]


def test_random_search_input_never_crashes(store: Store) -> None:
    chat(store)
    rng = random.Random(7)
    alphabet = "abcXYZ019 \"*():^-+_.,'{}[]NEARORANDNOT\\é☃🙂\t"
    for _ in range(400):
        query = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
        store.search(query)


def test_fts_query_quotes_every_word() -> None:
    assert fts_query('say "hi" now*') == '"say" """hi""" "now"*'
    assert fts_query("* ** -- ()") is None


def test_a_one_megabyte_message_stores_and_searches(store: Store) -> None:
    words = [f"w{i}" for i in range(150_000)]
    content = " ".join(words)[:1_000_000] + " needleword"
    cid = store.new_conversation("embedded")
    question = store.add_message(cid, "user", "big paste", None)
    answer, _ = store.add_reply(cid, question, content, TURN)
    assert len(store.get_message(answer).content) == len(content) >= 1_000_000
    (hit,) = store.search("needleword")
    assert hit.message_id == answer and "**needleword**" in hit.snippet
    assert store.integrity_check() == "ok"


# ----------------------------------------------------------------- forget
def test_forget_deletes_everything_and_taints_the_runs_that_learned_from_it(store: Store) -> None:
    cid, question, answer, _ = chat(store, "secret plans zebra", "zebra reply")
    keep, _, keep_answer, _ = chat(store, "keep this", "kept")
    f1 = store.add_feedback(answer, "rating", -1)
    f2 = store.add_feedback(answer, "correction", text="better zebra")
    f3 = store.add_feedback(keep_answer, "rating", 1)
    tainted = store.record_learning_run(slot="L2", status="done", feedback_ids=[f1, f3], adapter_version="L2-v7")
    also = store.record_learning_run(slot="L0", status="rejected", feedback_ids=[f2])
    clean = store.record_learning_run(slot="L2", status="done", feedback_ids=[f3], adapter_version="L2-v8")

    result = store.forget(cid)

    assert result.conversation_id == cid and result.messages == 2 and result.feedback == 2
    assert result.tainted_runs == [tainted, also]
    assert result.adapter_versions == ["L2-v7"]
    runs = {r.id: r for r in store.learning_runs()}
    assert runs[tainted].tainted and runs[also].tainted and not runs[clean].tainted
    assert runs[tainted].tainted_reason == f"learned from forgotten conversation {cid}"
    for table in ("messages", "turns", "feedback"):
        count = store.db.execute(f"SELECT count(*) FROM {table} WHERE conversation_id = ?", [cid]).fetchone()[0]
        assert count == 0, table
    assert store.search("zebra") == []
    assert [c.id for c in store.list_conversations()] == [keep]
    assert store.integrity_check() == "ok"
    # Feedback ids are never reused: learning runs still name the forgotten ones.
    assert store.add_feedback(keep_answer, "rating", 1) > max(f1, f2, f3)
    with pytest.raises(InvalidInputError, match="no conversation"):
        store.forget(cid)


# ----------------------------------------------------------------- export / import
def build_rich_store(store: Store) -> None:
    cid, question, answer, _ = chat(store, 'Héllo — 日本語 \u2028 and "quotes"\n\ttabs', "réponse 🙂")
    second, _ = store.add_reply(cid, question, "second try", {**TURN, "ttft_ms": None, "adapters": []})
    trajectory = {"name": "write_file", "arguments": {"path": "é.txt"}, "approval": "denied", "status": "denied"}
    store.set_turn_tool_calls(second, [trajectory | {"ms": 0.5, "result_message_id": ""}])  # an agent's step
    store.add_feedback(answer, "rating", 1, "good")
    store.add_feedback(answer, "correction", text="corrected\nreply")
    edited = store.add_message(cid, "user", "edited question", None)
    store.add_message(cid, "tool", '{"result": 42}', edited)
    store.set_current_leaf(cid, answer)
    other, _, other_answer, _ = chat(store, "second conversation", "ok")
    store.add_feedback(other_answer, "regenerate")
    store.new_conversation("embedded", title="empty one")


def export_text(store: Store, ids=None) -> str:
    out = io.StringIO()
    store.export_jsonl(out, ids)
    return out.getvalue()


def test_export_import_export_is_byte_identical(store: Store, tmp_path: Path) -> None:
    build_rich_store(store)
    exported = export_text(store)
    assert exported.count("\n") == 3
    with open_store(tmp_path / "copy" / "macaron.db") as copy:
        result = copy.import_jsonl(io.BytesIO(exported.encode()))
        assert len(result.imported) == 3 and result.skipped == [] and result.renumbered_feedback == 0
        assert export_text(copy) == exported
        again = copy.import_jsonl(io.BytesIO(exported.encode()))
        assert again.imported == [] and len(again.skipped) == 3
        assert export_text(copy) == exported
        assert copy.integrity_check() == "ok"
        (hit,) = copy.search("日本語")
        assert hit.role == "user"
        [with_calls] = [t for t in copy.get_conversation(hit.conversation_id).turns if t.tool_calls]
        assert with_calls.tool_calls[0]["arguments"] == {"path": "é.txt"}  # the trajectory came through


def test_export_of_named_conversations_and_unknown_ids(store: Store) -> None:
    first, *_ = chat(store)
    chat(store)
    (line,) = export_text(store, [first]).splitlines()
    record = json.loads(line)
    assert record["conversation"]["id"] == first and len(record["messages"]) == 2
    assert record["turns"][0]["adapters"] == TURN["adapters"]
    with pytest.raises(InvalidInputError, match="no conversation with id nope"):
        export_text(store, ["nope"])


def test_import_keeps_feedback_ids_that_were_never_used_here(store: Store, tmp_path: Path) -> None:
    build_rich_store(store)
    exported = export_text(store)
    with open_store(tmp_path / "other.db") as other:
        _, _, answer, _ = chat(other)
        for _ in range(5):
            other.add_feedback(answer, "rating", 1)  # ids 1..5 are taken here
        result = other.import_jsonl(io.BytesIO(exported.encode()))
        assert result.renumbered_feedback == 3 and len(result.imported) == 3
        ids = [r[0] for r in other.db.execute("SELECT id FROM feedback ORDER BY id")]
        assert ids == list(range(1, 9))


def test_invalid_utf8_names_the_line_and_imports_nothing(store: Store, tmp_path: Path) -> None:
    build_rich_store(store)
    lines = export_text(store).encode().splitlines(keepends=True)
    bad = lines[0] + lines[1].replace(b"second conversation", b"second \xff conversation") + lines[2]
    with open_store(tmp_path / "target.db") as target:
        with pytest.raises(InvalidInputError, match=r"^line 2: not valid UTF-8") as caught:
            target.import_jsonl(io.BytesIO(bad))
        assert "\n" not in str(caught.value)
        assert target.list_conversations() == []


@pytest.mark.parametrize(
    ("mangle", "needle"),
    [
        (lambda rec: "{not json", "line 2: not valid JSON"),
        (lambda rec: "[1, 2]", "line 2: each line must be a JSON object"),
        (lambda rec: json.dumps({**rec, "version": 99}), "line 2: written by a newer macaron-local"),
        (lambda rec: json.dumps({**rec, "messages": "x"}), "line 2: 'messages' must be a list"),
        (
            lambda rec: json.dumps({**rec, "messages": [{**rec["messages"][0], "parent_id": "ghost"}]}),
            "line 2: message .* has a parent ghost",
        ),
        (
            lambda rec: json.dumps({**rec, "feedback": [{**rec["feedback"][0], "kind": "love"}]}),
            "line 2: feedback .* unknown kind",
        ),
        (
            lambda rec: json.dumps({**rec, "messages": [{**rec["messages"][0], "content": 5}]}),
            "line 2: message field 'content' has the wrong type",
        ),
    ],
)
def test_bad_lines_name_the_line_and_import_nothing(store: Store, tmp_path: Path, mangle, needle: str) -> None:
    build_rich_store(store)
    lines = export_text(store).split("\n")  # not splitlines(): U+2028 inside a message is no line break
    lines[1] = mangle(json.loads(lines[1]))
    with open_store(tmp_path / "target.db") as target:
        with pytest.raises(InvalidInputError, match=needle):
            target.import_jsonl(io.BytesIO("\n".join(lines).encode()))
        assert target.list_conversations() == []


def test_import_refuses_message_ids_owned_by_another_conversation(store: Store, tmp_path: Path) -> None:
    chat(store)
    record = json.loads(export_text(store))
    record["conversation"]["id"] = "a-different-conversation"
    with pytest.raises(InvalidInputError, match="line 1: message .* already exists"):
        store.import_jsonl(io.BytesIO(json.dumps(record).encode()))
    assert len(store.list_conversations()) == 1


# ----------------------------------------------------------------- environment failures
@contextmanager
def read_only(path: Path) -> Iterator[str]:
    """Make `path` really read-only, even for root, and say how.

    As a normal user, chmod does it. Root ignores permission bits, so as root we set the
    filesystem's immutable attribute (chattr +i), which the kernel enforces for root too.
    """
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        os.chmod(path, 0o500 if path.is_dir() else 0o400)
        try:
            yield "chmod"
        finally:
            os.chmod(path, stat.S_IMODE(mode))
        return
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, check=False)
    if done.returncode != 0:
        pytest.skip(f"running as root and chattr +i is not available here: {done.stderr.decode().strip()}")
    try:
        yield "chattr +i"
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


def test_a_read_only_data_directory_is_a_clear_error(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    with read_only(data), pytest.raises(StoreError) as caught:
        open_store(data / "macaron.db")
    message = str(caught.value)
    assert "cannot create the store" in message and "writable" in message and "\n" not in message
    assert not (data / "macaron.db").exists()


def test_a_read_only_store_file_is_a_clear_error_and_unchanged(db_path: Path) -> None:
    with open_store(db_path) as store:
        chat(store)
    before = sha256(db_path)
    with read_only(db_path), pytest.raises(StoreError, match="is read-only"):
        open_store(db_path)
    assert sha256(db_path) == before


def test_a_directory_where_the_store_should_be_is_a_clear_error(db_path: Path) -> None:
    db_path.mkdir(parents=True)
    with pytest.raises(StoreError, match="it is a directory"):
        open_store(db_path)


def test_a_file_that_is_not_sqlite_is_refused_and_unchanged(db_path: Path) -> None:
    db_path.parent.mkdir(parents=True)
    db_path.write_bytes(b"these are my notes, not a database\n" * 200)
    before = sha256(db_path)
    with pytest.raises(StoreError, match="is not a SQLite database"):
        open_store(db_path)
    assert sha256(db_path) == before


def test_a_database_locked_past_the_timeout_is_a_clear_error_and_loses_nothing(db_path: Path) -> None:
    store = open_store(db_path, busy_timeout_ms=200)
    cid, _, answer, _ = chat(store)
    store.add_feedback(answer, "rating", 1)
    locker = raw(db_path)
    locker.execute("BEGIN EXCLUSIVE")
    locker.execute("UPDATE conversations SET title = 'renamed by the other program' WHERE id = ?", [cid])
    try:
        started = time.perf_counter()
        with pytest.raises(StoreError) as caught:
            store.add_feedback(answer, "rating", -1)
        waited = time.perf_counter() - started
        assert "locked" in str(caught.value) and "nothing was changed" in str(caught.value)
        assert 0.15 <= waited < 3
        with pytest.raises(StoreError, match="locked"):
            open_store(db_path, busy_timeout_ms=100)
        # Reads still work while another program writes (WAL).
        assert store.get_conversation(cid).title == "How do I reverse a list in python?"
    finally:
        locker.execute("COMMIT")
        locker.close()
    # The failed write can simply be retried; nothing either side committed was lost.
    store.add_feedback(answer, "rating", -1)
    conversation = store.get_conversation(cid)
    assert [f.value for f in conversation.feedback] == [1, -1]
    assert conversation.title == "renamed by the other program"
    store.close()
    with open_store(db_path) as reopened:
        assert reopened.integrity_check() == "ok"
        assert len(reopened.get_conversation(cid).feedback) == 2
