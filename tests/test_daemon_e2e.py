"""End to end: corrections in the store -> `macaron daemon run --now` (another process) -> a new
version deployed -> a session opened *before* the run serves it at its next turn, without a
restart, records it with that turn and tells the user what changed.

The tiny random model learns a plain English sentence as its correction: held-out replies move
toward it and, because the regression passages are English too, passage NLL falls. So the real
gate (held-out win, NLL, factual answers, parity) deploys it every time, in seconds.
"""

from __future__ import annotations

import os
import threading

import pytest
from conftest import run_cli

pytest.importorskip("torch")
pytest.importorskip("peft")

from macaron_local.catalog import Catalog  # noqa: E402
from macaron_local.daemon import history  # noqa: E402
from macaron_local.engine import GenerationParams  # noqa: E402
from macaron_local.session import Session  # noqa: E402

CORRECTION = "the sun is in the sea and the rain is on the land"
PARAMS = GenerationParams(max_tokens=8, temperature=0.0)
LEARN = {"steps": 10, "lr": 5e-3, "episodes_per_step": 2, "group_size": 2, "max_new_tokens": 4, "refresh_every": 10}
# idle_minutes 0 and a huge max_load: this test shares two busy CPU cores; low_priority off, or
# the run would wait for them. Every other condition is checked for real.
DAEMON = {"min_feedback": 8, "idle_minutes": 0, "max_load": 1000.0, "low_priority": False}


def test_daemon_run_deploys_and_an_open_session_uses_it_at_its_next_turn(home, tiny_model):
    model = tiny_model("llama", False, n_ctx_train=2048)
    Catalog(home).add_local("tiny", model.path)
    home.save(model="tiny", learn=LEARN, daemon=DAEMON)
    with Session(home, engine_config={"n_ctx": 256}) as session:
        before = session.send("ab", params=PARAMS).wait()
        assert before.adapters == () and before.notices == ()
        for _ in range(8):
            session.new_conversation()
            reply = session.send("ab", params=PARAMS).wait()
            session.correct(reply.message_id, CORRECTION)
        noticed = threading.Event()
        session.on_adapters_changed(noticed.set)

        done = run_cli("daemon", "run", "--now", home=os.environ["MACARON_HOME"], timeout=600)
        assert done.returncode == 0, done.stderr + done.stdout
        version = session.store.deployed_adapter("personal", "tiny")
        assert version is not None, done.stdout
        assert f"personal: deployed as {version.id}" in done.stdout
        assert noticed.wait(10), "the watchdog did not see the deployment"

        session.new_conversation()
        after = session.send("ab", params=PARAMS).wait()
        label = f"personal {version.id}"
        assert after.adapters == (label,)
        assert after.notices == ("Your personal adapter (every expert) updated: learned from 8 corrections",)
        [turn] = session.store.get_conversation(after.conversation_id).turns
        assert turn.adapters == [label]
        assert after.text != before.text  # the adapter really is in the forward pass

        again = session.send("and again?", params=PARAMS).wait()
        assert again.adapters == (label,) and again.notices == ()  # told once

    [run] = history.read_history(home)
    assert run.outcome == "learned" and run.forced
    assert run.slots == [
        {"slot": "personal", "decision": "deployed", "version_id": version.id, "reason": run.slots[0]["reason"]}
    ]
    status = run_cli("daemon", "status", home=os.environ["MACARON_HOME"])
    assert f"personal deployed {version.id}" in status.stdout and "learned: personal deployed" in status.stdout
