"""An open session follows the registry: another process deploys, rolls back or deploys a broken
file, and the session's watchdog tells its listeners at once; the next turn serves exactly what
is deployed, says what changed once, and a version that cannot load never breaks a turn."""

from __future__ import annotations

import threading

import pytest
from conftest import write_random_adapter

from macaron_local.catalog import Catalog
from macaron_local.engine import GenerationParams
from macaron_local.session import Session
from macaron_local.store import open_default_store

PARAMS = GenerationParams(max_tokens=4, temperature=0.0)
TURN = {"model": "tiny", "expert": "L0", "route_method": "default"}


@pytest.fixture
def tiny_home(home, tiny_model):
    model = tiny_model("llama", False)
    Catalog(home).add_local("tiny", model.path)
    home.save(model="tiny")
    return home, model


def feedback_ids(store) -> list[int]:
    """Two corrections and a rating, as a learning run would have used them."""
    ids = []
    for i in range(2):
        conversation = store.new_conversation("tiny")
        question = store.add_message(conversation, "user", f"q{i}")
        reply, _ = store.add_reply(conversation, question, "r", TURN)
        ids.append(store.add_feedback(reply, "correction", text="better"))
        if i == 0:
            ids.append(store.add_feedback(reply, "rating", value=1))
    return ids


def deploy_elsewhere(home, path, parent=None, ids=()):
    """Register and deploy from another connection, as the daemon's process does."""
    with open_default_store(home) as other:
        version = other.register_adapter(
            path, slot="L0", base_model="tiny", rank=2, parent_id=parent, feedback_ids=list(ids)
        )
        other.deploy_adapter(version.id)
        return version


def test_the_watchdog_tells_listeners_and_the_next_turn_serves_the_new_version(tiny_home, tmp_path):
    home, model = tiny_home
    with Session(home, engine_config={"n_ctx": 128}) as session:
        assert session.send("hello", params=PARAMS).wait().adapters == ()
        told = threading.Event()
        unsubscribe = session.on_adapters_changed(told.set)
        ids = feedback_ids(session.store)
        told.wait(5)
        told.clear()
        version = deploy_elsewhere(home, write_random_adapter(tmp_path / "a.gguf", model, 2, seed=1), ids=ids)
        assert told.wait(10), "no watchdog notice"
        assert session.pending_updates() == ["L0 Chat updated: learned from 2 corrections and 1 rating"]
        assert session.pending_updates() == []  # told once
        reply = session.send("hello again", params=PARAMS).wait()
        assert reply.adapters == (f"personal {version.id}",) and reply.notices == ()
        [*_, turn] = session.store.get_conversation(reply.conversation_id).turns
        assert turn.adapters == [f"personal {version.id}"]
        unsubscribe()
        assert session._watcher is not None and session._watcher.running
    assert session._watcher is None  # closing the session stops the watchdog


def test_rollbacks_elsewhere_are_served_and_told(tiny_home, tmp_path):
    home, model = tiny_home
    first = deploy_elsewhere(home, write_random_adapter(tmp_path / "a.gguf", model, 2, seed=1))
    with Session(home, engine_config={"n_ctx": 128}) as session:
        assert session.send("one", params=PARAMS).wait().adapters == (f"personal {first.id}",)
        second = deploy_elsewhere(home, write_random_adapter(tmp_path / "b.gguf", model, 2, seed=2), parent=first.id)
        reply = session.send("two", params=PARAMS).wait()
        assert reply.adapters == (f"personal {second.id}",)
        assert reply.notices == (f"L0 Chat updated to learned version {second.id}",)
        with open_default_store(home) as other:
            other.rollback_adapter("L0", "tiny")
        reply = session.send("three", params=PARAMS).wait()
        assert reply.adapters == (f"personal {first.id}",)
        assert reply.notices == (f"L0 Chat rolled back to learned version {first.id}",)
        with open_default_store(home) as other:
            other.rollback_adapter("L0", "tiny")
        reply = session.send("four", params=PARAMS).wait()
        assert reply.adapters == ()
        assert reply.notices == (f"L0 Chat: learned version {first.id} rolled back; the expert answers as shipped",)


def test_a_deployed_file_that_cannot_load_never_breaks_a_turn(tiny_home, tmp_path, tiny_model):
    home, model = tiny_home
    good = deploy_elsewhere(home, write_random_adapter(tmp_path / "a.gguf", model, 2, seed=1))
    other_model = tiny_model("qwen3", False)  # an adapter for another architecture
    with Session(home, engine_config={"n_ctx": 128}) as session:
        session.send("one", params=PARAMS).wait()
        bad = deploy_elsewhere(home, write_random_adapter(tmp_path / "b.gguf", other_model, 2, seed=2), parent=good.id)
        reply = session.send("two", params=PARAMS).wait()
        assert reply.adapters == (f"personal {good.id}",) and reply.text is not None
        [notice] = reply.notices
        assert notice.startswith("L0: the new version could not be loaded") and "old one still serves" in notice
        assert session.send("three", params=PARAMS).wait().notices == ()  # not repeated every turn
        assert session.store.deployed_adapter("L0", "tiny").id == bad.id


def test_replaced_versions_are_freed_night_after_night(tiny_home, tmp_path):
    """Five nights of new versions: llama.cpp holds the one being served (and at most the one
    the last turn used, until the next change), never the whole history."""
    home, model = tiny_home
    parent = None
    # 256: each answer's system message also carries the identity instruction (the tiny model
    # spells it letter by letter) and the conversation runs six turns.
    with Session(home, engine_config={"n_ctx": 256}) as session:
        for night in range(5):
            path = write_random_adapter(tmp_path / f"{night}.gguf", model, 2, seed=night)
            parent = deploy_elsewhere(home, path, parent=parent.id if parent else None)
            reply = session.send(f"night {night}", params=PARAMS).wait()
            assert reply.adapters == (f"personal {parent.id}",)
            assert len(session.engine.loaded) <= 2, session.engine.loaded
        assert parent.path in map(str, session.engine.loaded)
        with open_default_store(home) as other:
            restored = other.rollback_adapter("L0", "tiny")
        reply = session.send("after rollback", params=PARAMS).wait()
        assert reply.adapters == (f"personal {restored.id}",)  # a freed file loads again when rolled back to


def test_watchdogs_stop_race_is_not_printed_but_its_other_errors_are():
    """An event that lands while the watcher stops made watchdog log an error, which Python printed
    on stderr at the end of `macaron ask` (seen once in a full CI run)."""
    import logging

    import macaron_local.daemon.watch  # noqa: F401  (installs the filter)

    inotify = logging.getLogger("watchdog.observers.inotify")

    def record(message: str) -> logging.LogRecord:
        return inotify.makeRecord(inotify.name, logging.ERROR, __file__, 1, message, None, None)

    assert not inotify.filter(record("InotifyEmitter.queue_events() called when the thread is inactive"))
    assert inotify.filter(record("inotify watch limit reached"))
