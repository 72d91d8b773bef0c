"""A reply's tag names a learned version by when it was learned, and says when it has since
been forgotten; an expert's file keeps its name (macaron_local.adapter_names)."""

from __future__ import annotations

import time

import pytest
from conftest import write_random_adapter

from macaron_local.adapter_names import learned_when, shown_adapter, shown_adapters
from macaron_local.store import open_default_store
from macaron_local.transcript import build_transcript

TURN = {"model": "tiny", "expert": "L0", "route_method": "default"}


@pytest.fixture
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_learned_when_reads_the_registry_timestamp_in_local_time(utc, monkeypatch):
    assert learned_when("2026-12-05T03:12:45.123456Z") == "5 Dec 03:12"
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    assert learned_when("2026-12-05T20:00:00.000000Z") == "6 Dec 05:00"
    assert learned_when("not a time") == "not a time"  # shown as it is, never an error


def test_a_learned_version_is_named_by_its_date_until_it_is_forgotten(home, tiny_model, tmp_path, utc):
    model = tiny_model("llama", False)
    with open_default_store(home) as store:
        conversation = store.new_conversation("tiny")
        question = store.add_message(conversation, "user", "What is my dog called?")
        reply, _ = store.add_reply(conversation, question, "I do not know.", TURN)
        feedback = store.add_feedback(reply, "correction", text="Your dog is called Biscuit.")
        path = write_random_adapter(tmp_path / "a.gguf", model, 2, seed=3)
        version = store.register_adapter(path, slot="personal", base_model="tiny", rank=2, feedback_ids=[feedback])
        store.record_learning_run(
            slot="personal", status="done", feedback_ids=[feedback], decision="deployed", adapter_version=version.id
        )
        recorded = f"personal {version.id}"

        shown = shown_adapter(store, recorded)
        assert shown == f"personal, learned {learned_when(version.created_at)}"
        assert version.id not in shown
        assert shown_adapters(store, ["L0-chat.gguf", recorded]) == ["L0-chat.gguf", shown]
        assert shown_adapter(store, "personal 01ZZZZZZZZZZZZZZZZZZZZZZZZ") == "personal, since removed"

        store.forget(conversation)
        assert shown_adapter(store, recorded) == "personal, since forgotten"


def test_the_transcript_tag_shows_the_name_not_the_id(home, tiny_model, tmp_path, utc):
    model = tiny_model("llama", False)
    with open_default_store(home) as store:
        path = write_random_adapter(tmp_path / "a.gguf", model, 2, seed=4)
        version = store.register_adapter(path, slot="personal", base_model="tiny", rank=2)
        conversation = store.new_conversation("tiny")
        question = store.add_message(conversation, "user", "hello")
        turn = {**TURN, "adapters": ["L0-chat.gguf", f"personal {version.id}"]}
        reply, _ = store.add_reply(conversation, question, "hi", turn)
        [_, item] = build_transcript(store, conversation, reply)
        assert item.tag == f"L0 Chat · L0-chat.gguf, personal, learned {learned_when(version.created_at)}"
