"""The nightly memory plan with injected figures (no machine is really run out of memory), and
the daemon condition that reads it: an open chat app makes the run wait, never gets killed."""

from __future__ import annotations

import dataclasses

from test_daemon_conditions import QUIET, verdict

from macaron_local.learn.memory_plan import GIB, Footprint, plan_memory

TALL_ENGINE = 30 * GIB  # planning figures of a Tall-sized night, injected (bench/tall_nightly.py estimates them)
TALL_TRAINER = 34 * GIB


def test_a_large_machine_keeps_both_and_a_64_gb_mac_runs_sequentially():
    assert plan_memory(Footprint(TALL_ENGINE, TALL_TRAINER), 128 * GIB).mode == "together"
    mac = plan_memory(Footprint(TALL_ENGINE, TALL_TRAINER), 64 * GIB)
    assert mac.mode == "sequential" and mac.close_engine_while_training and mac.can_run
    assert mac.peak_bytes == TALL_TRAINER <= mac.budget_bytes
    assert "engine is closed while the trainer steps" in mac.reason


def test_an_open_chat_app_makes_the_run_wait_or_take_the_smaller_plan():
    app = TALL_ENGINE
    wait = plan_memory(Footprint(TALL_ENGINE, TALL_TRAINER, app_bytes=app), 64 * GIB)
    assert wait.mode == "wait" and not wait.can_run and "chat app" in wait.reason
    small = Footprint(2 * GIB, 3 * GIB, app_bytes=2 * GIB)  # a small model: everything fits
    assert plan_memory(small, 16 * GIB).mode == "together"
    assert plan_memory(small, 12 * GIB).mode == "sequential"  # 7 GiB together, 5 GiB in turns
    assert plan_memory(Footprint(TALL_ENGINE, TALL_TRAINER), 32 * GIB).mode == "too_small"


def test_the_daemon_condition_knows_the_plan(home):
    from test_daemon_conditions import seed_feedback

    seed_feedback(home, 10)
    assert verdict(home).ok  # no plan computed: the other conditions decide
    for total, app, ok, word in ((64, 0, True, "sequential"), (64, TALL_ENGINE, False, "wait")):
        plan = plan_memory(Footprint(TALL_ENGINE, TALL_TRAINER, app_bytes=app), total * GIB)
        result = verdict(home, dataclasses.replace(QUIET, memory_plan=lambda settings, p=plan: p))
        assert result.ok is ok
        memory = next(c for c in result.checks if c.name == "memory")
        assert word in memory.detail and memory.ok is ok
        if not ok:
            assert any("chat app" in r for r in result.reasons)


def test_the_plan_for_a_registered_tall_shaped_model(home, tmp_path):
    """The active model's own files decide the figures (the tiny qwen3_5_moe with its trainer
    checkpoint and PEFT experts); only the machine's RAM is injected. Small dense models get no plan."""
    import sys
    from pathlib import Path

    from macaron_local.learn.memory_plan import machine_memory_plan

    assert machine_memory_plan(home, total_bytes=64 * GIB) is None  # the embedded model: always fits
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import tiny_tall

    tiny_tall.register(home, tiny_tall.build(tmp_path / "tall"))
    roomy = machine_memory_plan(home, total_bytes=64 * GIB)
    assert roomy is not None and roomy.mode == "together"
    # Engine (3 GiB runtime allowance + files) and trainer (2 GiB allowance + files) in turns.
    assert machine_memory_plan(home, total_bytes=10 * GIB).mode == "sequential"
    assert machine_memory_plan(home, total_bytes=10 * GIB, app_bytes=4 * GIB).mode == "wait"


OPEN_SESSION = """
import sys
from macaron_local.session import Session
session = Session()
print("open", flush=True)
sys.stdin.readline()
"""


def test_an_open_chat_app_in_another_process_makes_the_night_wait(home, tmp_path):
    """A real second process holds a Session open (no reply generating): the plan counts its
    engine and the daemon's memory condition says wait; when the app dies (killed, no clean
    close) the OS frees its lock and the same machine runs the sequential plan."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from test_daemon_conditions import seed_feedback

    from macaron_local.daemon.locks import chat_app_open, chat_generating
    from macaron_local.learn.memory_plan import machine_memory_plan

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import tiny_tall

    tiny_tall.register(home, tiny_tall.build(tmp_path / "tall"))
    seed_feedback(home, 10)
    small = dataclasses.replace(QUIET, memory_plan=lambda settings: machine_memory_plan(settings, 10 * GIB))
    assert not chat_app_open(home) and verdict(home, small).ok
    app = subprocess.Popen(
        [sys.executable, "-c", OPEN_SESSION], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ
    )
    try:
        assert app.stdout.readline().strip() == "open"
        assert chat_app_open(home) and not chat_generating(home)
        assert machine_memory_plan(home, total_bytes=10 * GIB).mode == "wait"
        result = verdict(home, small)
        memory = next(c for c in result.checks if c.name == "memory")
        assert not result.ok and not memory.ok and "wait" in memory.detail and "chat app" in memory.detail
    finally:
        app.kill()
        app.wait(timeout=30)
    assert not chat_app_open(home)
    assert machine_memory_plan(home, total_bytes=10 * GIB).mode == "sequential" and verdict(home, small).ok


def test_a_session_in_this_process_marks_the_app_open_until_closed(home):
    from macaron_local.daemon.locks import chat_app_open
    from macaron_local.session import Session

    with Session(home):
        assert chat_app_open(home)
    assert not chat_app_open(home)


def test_the_run_takes_its_mode_from_the_plan(home, tmp_path, monkeypatch):
    """`nightly_mode` is the one place the run's mode comes from: only this machine's RAM is injected."""
    import sys
    from pathlib import Path

    from macaron_local import fit
    from macaron_local.learn.memory_plan import nightly_mode

    monkeypatch.setattr(fit, "machine_ram_bytes", lambda: 10 * GIB)
    assert nightly_mode(home) == "together"  # the embedded model: no plan needed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import tiny_tall

    tiny_tall.register(home, tiny_tall.build(tmp_path / "tall"))
    assert nightly_mode(home) == "sequential"
    monkeypatch.setattr(fit, "machine_ram_bytes", lambda: 64 * GIB)
    assert nightly_mode(home) == "together"
