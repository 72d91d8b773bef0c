"""`macaron daemon run` decides with the real decision code; only the machine's facts (clock,
power, idle time, load) are simulated. Every "no" must come with its reason, in the output,
the log and the run history. Locks and the generating marker are real (other processes hold
them)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
import textwrap
from datetime import datetime
from pathlib import Path

import pytest
from conftest import run_cli

from macaron_local.daemon import history
from macaron_local.daemon.conditions import Probes, check
from macaron_local.daemon.config import DaemonConfig, Window, daemon_config
from macaron_local.daemon.locks import GeneratingMarker, chat_generating, daemon_running
from macaron_local.daemon.logs import daemon_logger, log_path
from macaron_local.daemon.probes import linux_on_ac, parse_ioreg_idle, parse_loginctl_user, parse_pmset
from macaron_local.daemon.runner import LOCK_HELD, run_once
from macaron_local.store import open_default_store

TURN = {"model": "tiny", "expert": "L0", "route_method": "default"}
QUIET = Probes(
    now=lambda: datetime(2026, 3, 1, 3, 0),
    on_ac=lambda: True,
    user_idle_s=lambda: 3600.0,
    load_per_core=lambda minutes: 0.05,
    generating=lambda settings: False,
)


def seed_feedback(settings, n: int) -> None:
    with open_default_store(settings) as store:
        for i in range(n):
            conversation = store.new_conversation("tiny")
            question = store.add_message(conversation, "user", f"question {i}")
            reply, _ = store.add_reply(conversation, question, "a reply", TURN)
            store.add_feedback(reply, "correction", text=f"a better reply {i}")


def verdict(settings, probe: Probes = QUIET, **kw):
    with open_default_store(settings) as store:
        return check(settings, daemon_config(settings), store, probe, **kw)


@pytest.fixture
def ready(home):
    """Settings whose every condition holds under QUIET: 10 new corrections, default window."""
    seed_feedback(home, 10)
    return home


def test_a_quiet_machine_inside_the_window_with_new_feedback_may_learn(ready):
    result = verdict(ready)
    assert result.ok and result.reasons == []
    assert {c.name for c in result.checks} == {"window", "power", "user idle", "load", "chat", "feedback"}


@pytest.mark.parametrize(
    ("change", "name", "reason"),
    [
        ({"on_ac": lambda: False}, "power", "on battery power"),
        ({"load_per_core": lambda minutes: 1.7}, "load", "the machine is busy: load 1.70 per core over 15 min"),
        ({"user_idle_s": lambda: 120.0}, "user idle", "you were active 2 min ago"),
        ({"now": lambda: datetime(2026, 3, 1, 14, 5)}, "window", "14:05 is outside the learning window 02:00-06:00"),
        ({"generating": lambda settings: True}, "chat", "a chat reply is being generated"),
    ],
)
def test_each_unmet_condition_is_the_reason_given(ready, change, name, reason):
    result = verdict(ready, dataclasses.replace(QUIET, **change))
    assert not result.ok
    [failed] = [c for c in result.checks if not c.ok]
    assert failed.name == name and reason in failed.detail
    run = run_once(ready, probe=dataclasses.replace(QUIET, **change))
    assert run.outcome == "skipped" and any(reason in r for r in run.reasons)
    assert history.read_history(ready)[-1] == run
    assert reason in log_path(ready).read_text()


def test_every_reason_is_reported_at_once(ready):
    probe = dataclasses.replace(QUIET, on_ac=lambda: False, load_per_core=lambda m: 3.0)
    result = verdict(ready, probe)
    assert [c.name for c in result.checks if not c.ok] == ["power", "load"]


def test_now_skips_only_the_window(ready):
    evening = dataclasses.replace(QUIET, now=lambda: datetime(2026, 3, 1, 19, 0))
    assert verdict(ready, evening, skip_window=True).ok
    on_battery = dataclasses.replace(evening, on_ac=lambda: False)
    assert verdict(ready, on_battery, skip_window=True).reasons == ["on battery power (learning waits for AC power)"]


def test_a_window_past_midnight(ready):
    ready.save(daemon={"window": "23:00-01:30"})
    for hour, minute, inside in [(23, 0, True), (0, 45, True), (1, 30, False), (22, 59, False)]:
        probe = dataclasses.replace(QUIET, now=lambda h=hour, m=minute: datetime(2026, 3, 1, h, m))
        assert verdict(ready, probe).ok is inside, (hour, minute)


def test_battery_is_allowed_when_the_user_says_so(ready):
    ready.save(daemon={"require_ac": False})
    assert verdict(ready, dataclasses.replace(QUIET, on_ac=lambda: False)).ok


def test_unknown_idle_time_leaves_the_decision_to_the_load(ready):
    unknown = dataclasses.replace(QUIET, user_idle_s=lambda: None)
    assert verdict(ready, unknown).ok
    assert not verdict(ready, dataclasses.replace(unknown, load_per_core=lambda m: 0.9)).ok


def test_nothing_new_to_learn(home):
    run = run_once(home, probe=QUIET)
    assert run.outcome == "skipped"
    assert run.reasons == ["nothing new to learn: no feedback since the last run"]


def test_too_little_new_feedback_and_feedback_already_learned_from(home):
    seed_feedback(home, 3)
    assert verdict(home).reasons == ["only 3 new piece(s) of feedback since the last run (needs 10)"]
    home.save(daemon={"min_feedback": 3})
    assert verdict(home).ok
    with open_default_store(home) as store:
        used = [item.feedback.id for item in store.feedback_rows()]
        store.record_learning_run(slot="L0", status="done", feedback_ids=used, decision="rejected", reason="test")
    assert verdict(home).reasons == ["nothing new to learn: no feedback since the last run"]
    seed_feedback(home, 3)
    assert verdict(home).ok


def test_paused_learning_does_not_run(ready):
    ready.save(learning_paused=True)
    assert verdict(ready).reasons == ["learning is paused (resume it in the app's learning panel)"]


HOLD_LOCK = textwrap.dedent(
    """
    import sys, time
    from macaron_local.settings import Settings
    from macaron_local.daemon.locks import single_instance
    with single_instance(Settings.load()) as got:
        print("held" if got else "busy", flush=True)
        time.sleep(60)
    """
)


def test_a_second_run_exits_while_another_holds_the_lock(ready):
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert daemon_running(ready)
        run = run_once(ready, probe=QUIET)
        assert run.outcome == "skipped" and run.reasons == [LOCK_HELD]
        done = run_cli("daemon", "run", "--now", home=os.environ["MACARON_HOME"])
        assert done.returncode == 0, done.stderr
        assert f"not learning: {LOCK_HELD}" in done.stdout
    finally:
        holder.kill()
        holder.wait()
    assert not daemon_running(ready)  # the OS dropped the killed holder's lock: nothing stale
    assert run_once(ready, probe=dataclasses.replace(QUIET, on_ac=lambda: False)).reasons != [LOCK_HELD]


CHECK_GENERATING = (
    "from macaron_local.settings import Settings; from macaron_local.daemon.locks import chat_generating;"
    " print(chat_generating(Settings.load()))"
)


def test_a_streaming_reply_holds_the_generating_marker(home, tiny_model):
    from macaron_local.catalog import Catalog
    from macaron_local.engine import GenerationParams
    from macaron_local.session import Session

    model = tiny_model("llama", False)
    Catalog(home).add_local("tiny", model.path)

    def seen_by_another_process() -> bool:
        done = subprocess.run([sys.executable, "-c", CHECK_GENERATING], capture_output=True, text=True, timeout=60)
        return done.stdout.strip() == "True"

    with Session(home, model="tiny", engine_config={"n_ctx": 128}) as session:
        reply = session.send("ab", params=GenerationParams(max_tokens=8, temperature=0.0))
        assert chat_generating(home) and seen_by_another_process()
        seed_feedback(home, 10)
        assert verdict(home, dataclasses.replace(QUIET, generating=chat_generating)).reasons == [
            "a chat reply is being generated"
        ]
        reply.wait()
        assert not chat_generating(home) and not seen_by_another_process()
        assert verdict(home, dataclasses.replace(QUIET, generating=chat_generating)).ok


def test_two_generations_both_count_until_the_last_ends(home):
    first, second = GeneratingMarker.hold(home), GeneratingMarker.hold(home)
    assert first.held and second.held and chat_generating(home)
    first.release()
    assert chat_generating(home)
    second.release()
    assert not chat_generating(home)


# ----------------------------------------------------------------- the real probes' formats
def supply(root: Path, name: str, **files: str) -> None:
    folder = root / name
    folder.mkdir(parents=True)
    for key, value in files.items():
        (folder / key).write_text(value + "\n")


@pytest.mark.parametrize(
    ("supplies", "expected"),
    [
        ({}, True),  # a desktop or VM: no battery at all
        ({"AC": {"type": "Mains", "online": "1"}, "BAT0": {"type": "Battery", "status": "Charging"}}, True),
        ({"AC": {"type": "Mains", "online": "0"}, "BAT0": {"type": "Battery", "status": "Discharging"}}, False),
        ({"AC": {"type": "Mains", "online": "0"}, "BAT0": {"type": "Battery", "status": "Unknown"}}, False),
        ({"BAT0": {"type": "Battery", "status": "Full"}}, True),
        ({"BAT0": {"type": "Battery", "status": "Discharging"}, "ucsi": {"type": "USB", "online": "1"}}, False),
        ({"hidpp": {"type": "Battery", "status": "Discharging", "scope": "Device"}}, True),  # a mouse
    ],
)
def test_linux_power_from_sysfs(tmp_path, supplies, expected):
    root = tmp_path / "power_supply"
    root.mkdir()
    for name, files in supplies.items():
        supply(root, name, **files)
    assert linux_on_ac(root) is expected


def test_power_and_idle_output_formats():
    assert parse_pmset("Now drawing from 'AC Power'\n -InternalBattery-0 (id=1)\t100%; charged;") is True
    assert parse_pmset("Now drawing from 'Battery Power'\n -InternalBattery-0 (id=1)\t80%; discharging;") is False
    assert parse_pmset("garbage") is None
    ioreg = '    |   "HIDIdleTime" = 125000000000\n    |   "HIDIdleTimeDelta" = 0'
    assert parse_ioreg_idle(ioreg) == pytest.approx(125.0)
    now = 1_700_000_600.0
    idle = "IdleHint=yes\nIdleSinceHint=1700000000000000\nDisplay=2\n"
    assert parse_loginctl_user(idle, now) == pytest.approx(600.0)
    assert parse_loginctl_user("IdleHint=no\nIdleSinceHint=0\nDisplay=2\n", now) == 0.0
    assert parse_loginctl_user("IdleHint=no\nIdleSinceHint=0\nDisplay=\n", now) is None  # no desktop session


def test_the_real_probes_answer_on_this_machine():
    from macaron_local.daemon import probes

    assert probes.on_ac_power() in (True, False, None)
    load = probes.load_per_core(15)
    assert load is None or load >= 0
    idle = probes.user_idle_seconds()
    assert idle is None or idle >= 0


def test_the_run_command_lowers_its_own_priority(home):
    done = run_cli("daemon", "run", home=os.environ["MACARON_HOME"])
    assert done.returncode == 0, done.stderr
    assert "not learning:" in done.stdout
    log = log_path(home).read_text()
    if sys.platform.startswith("linux"):
        assert "priority: nice 19, idle CPU class True, idle IO class True" in log
    else:
        assert "priority: nice 19" in log
    home.save(daemon={"low_priority": False})
    assert run_cli("daemon", "run", home=os.environ["MACARON_HOME"]).returncode == 0
    last = [line for line in log_path(home).read_text().splitlines() if "priority:" in line][-1]
    assert f"priority: nice {os.getpriority(os.PRIO_PROCESS, 0)}," in last  # unchanged: inherited from us


def test_the_log_rotates_stays_private_and_masks_tokens(home):
    logger = daemon_logger(home)
    secret = "hf_" + "a1B2" * 9
    logger.info("downloading with token %s", secret)
    try:
        raise RuntimeError(f"boom {secret}")
    except RuntimeError:
        logger.exception("failed")
    for i in range(2500):
        logger.info("line %d %s", i, "x" * 500)
    files = sorted(home.log_dir.glob("daemon.log*"))
    assert len(files) >= 2 and all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files)
    assert all(f.stat().st_size <= 1_100_000 for f in files)
    text = "".join(f.read_text() for f in files)
    assert secret not in text and "hf_***" in text and "boom" in text


def test_bad_daemon_settings_are_recorded_and_one_line(home):
    home.save(daemon={"window": "soon"})
    done = run_cli("daemon", "run", "--now", home=os.environ["MACARON_HOME"])
    assert done.returncode == 2 and done.stderr.startswith("error: ") and "Traceback" not in done.stderr
    assert history.read_history(home)[-1].outcome == "failed"


def test_status_shows_conditions_and_recent_runs(ready):
    run_once(ready, probe=dataclasses.replace(QUIET, on_ac=lambda: False))
    done = run_cli("daemon", "status", "--json", home=os.environ["MACARON_HOME"])
    assert done.returncode == 0, done.stderr
    status = json.loads(done.stdout)
    assert status["window"] == "02:00-06:00" and status["running"] is False
    assert status["recent"][0]["outcome"] == "skipped"
    assert "on battery power" in status["recent"][0]["reasons"][0]
    assert {c["name"] for c in status["conditions"]} >= {"power", "load", "chat", "feedback"}
    assert status["log_file"].endswith("daemon.log")


def test_config_window_and_schedule():
    config = DaemonConfig(window=Window.parse("23:30-00:30"), every_minutes=15)
    assert config.fire_times() == [(23, 30), (23, 45), (0, 0), (0, 15)]
    assert str(config.window) == "23:30-00:30"
