"""A store that cannot take writes says why, in one line, instead of claiming the disk is full;
imports cannot put it in that state; and reading commands never open it for writing."""

from __future__ import annotations

import io
import json

import pytest

from macaron_local.errors import InvalidInputError
from macaron_local.store import StoreError, open_store
from macaron_local.store.jsonl import MAX_IMPORTED_ID


def _reply(store) -> str:
    cid = store.new_conversation("tiny", "")
    question = store.add_message(cid, "user", "hi", None)
    answer, _ = store.add_reply(cid, question, "hello", {"model": "tiny"})
    return answer


def test_an_exhausted_id_is_not_called_a_full_disk(tmp_path):
    with open_store(tmp_path / "m.db") as store:
        answer = _reply(store)
        store.db.execute(  # what an older import could do: a feedback row at SQLite's limit
            "INSERT INTO feedback (id, conversation_id, message_id, kind, value, created_at)"
            " SELECT ?, conversation_id, id, 'rating', 1, created_at FROM messages WHERE id = ?",
            [2**63 - 1, answer],
        )
        with pytest.raises(StoreError) as caught:
            store.add_feedback(answer, "rating", -1)
    message = str(caught.value)
    assert "not its disk" in message and "row id" in message and "\n" not in message


def test_an_import_cannot_take_the_last_ids(tmp_path):
    with open_store(tmp_path / "a.db") as store:
        store.add_feedback(_reply(store), "rating", 1)
        buffer = io.StringIO()
        store.export_jsonl(buffer)
    record = json.loads(buffer.getvalue())
    for bad in (2**63 - 1, MAX_IMPORTED_ID + 1):
        record["feedback"][0]["id"] = bad
        with open_store(tmp_path / f"b{bad}.db") as target, pytest.raises(InvalidInputError, match="reserved"):
            target.import_jsonl(io.BytesIO(json.dumps(record).encode()))
        with open_store(tmp_path / f"b{bad}.db") as target:
            assert target.list_conversations() == []  # nothing imported
            target.add_feedback(_reply(target), "rating", 1)  # and the store still takes feedback


def test_a_read_only_open_writes_nothing(tmp_path):
    path = tmp_path / "m.db"
    with open_store(path, readonly=True) as store:  # no store yet: reads as empty, creates nothing
        assert store.list_conversations() == []
    assert not path.exists() and list(tmp_path.iterdir()) == []
    with open_store(path) as store:
        _reply(store)
    before = path.read_bytes()
    with open_store(path, readonly=True) as store:
        assert len(store.list_conversations()) == 1
        with pytest.raises(StoreError, match="read-only"):
            store.add_feedback(store.get_conversation(store.list_conversations()[0].id).messages[-1].id, "rating", 1)
    assert path.read_bytes() == before
