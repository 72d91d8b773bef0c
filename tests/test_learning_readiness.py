"""What macaron says after a correction is true for the machine: checked in child processes whose
Python cannot import a trainer (a sitecustomize on PYTHONPATH blocks torch and mlx, the way
`sys.modules[name] = None` blocks any import), and in ones that can, with and without the
schedule's files. The state machine's other answers (paused, not enough feedback, the next
window) are checked in process on the real readiness function."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from datetime import datetime
from pathlib import Path

import pytest
from conftest import run_cli

from macaron_local.daemon.config import DaemonConfig, Window
from macaron_local.learning_setup.status import describe_when, next_start, readiness
from macaron_local.learning_setup.trainer import Trainer
from macaron_local.store import open_default_store

BLOCKER = """
import sys
for name in ("torch", "mlx", "mlx_lm"):
    sys.modules[name] = None  # `import torch` now raises ImportError, find_spec finds nothing
"""

#: In the child: store a reply, correct it through the session, print what the app would say.
CHILD = textwrap.dedent(
    """
    import json, sys
    from macaron_local.session import Session
    from macaron_local.settings import Settings

    settings = Settings.load()
    settings.ensure_dirs()
    with Session(settings) as session:
        store = session.store
        conversation = store.new_conversation("embedded")
        question = store.add_message(conversation, "user", "Name a colour.")
        reply, _ = store.add_reply(conversation, question, "Blue.", {"model": "embedded", "expert": "L0"})
        session.correct(reply, "Teal.")
        status = session.learning_setup.readiness(store, ask_os=sys.argv[1] == "ask-os")
        print(json.dumps({"state": status.state, "app": status.notice("Correction saved."),
                          "cli": status.notice("Correction saved.", where="cli"), "trainer": status.trainer}))
    """
)


def correction_notice(tmp_path: Path, *, block_trainers: bool, ask_os: bool = True) -> dict:
    env = {**os.environ, "MACARON_HOME": str(tmp_path / "home"), "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    if block_trainers:
        blocker = tmp_path / "blocker"
        blocker.mkdir(exist_ok=True)
        (blocker / "sitecustomize.py").write_text(BLOCKER)
        env["PYTHONPATH"] = os.pathsep.join([str(blocker), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-c", CHILD, "ask-os" if ask_os else "no-os"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_without_a_trainer_the_notice_says_learning_is_not_set_up_and_how(tmp_path):
    said = correction_notice(tmp_path, block_trainers=True)
    assert said["trainer"] is None and said["state"] == "not_set_up"
    assert said["app"].startswith(
        "Correction saved. macaron will not learn from it, because learning is not set up on this computer: "
        "there is no trainer (PyTorch or MLX) and no nightly schedule."
    )
    assert said["app"].endswith("Set it up: Ctrl+L, then Set up learning.")
    assert said["cli"].endswith("Set it up: `macaron setup`.")
    assert "tonight" not in said["app"]


def test_with_a_trainer_and_no_schedule_the_notice_says_so(tmp_path):
    said = correction_notice(tmp_path, block_trainers=False)
    assert said["trainer"] in ("torch", "mlx") and said["state"] == "no_schedule"
    assert "will not learn from it, because the nightly schedule is not installed" in said["app"]
    assert said["cli"].endswith("Install it: `macaron setup`.")


def test_with_a_trainer_and_the_schedule_the_notice_names_the_next_window(tmp_path):
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    (home / "config" / "settings.toml").write_text("[daemon]\nmin_feedback = 1\n")
    xdg = str(tmp_path / "xdg")
    installed = run_cli("setup", "--yes", "--no-enable", "--no-trainer", home=home, XDG_CONFIG_HOME=xdg)
    assert installed.returncode == 0, installed.stderr
    assert (tmp_path / "xdg" / "systemd" / "user" / "macaron-learn.timer").is_file()
    # ask_os=False: on a machine with a user systemd, files written without --now are "inactive",
    # which is its own (tested) answer; here the point is the window.
    said = correction_notice(tmp_path, block_trainers=False, ask_os=False)
    assert said["state"] == "ready", said
    assert re.search(r"will learn from it (tonight|today|tomorrow) at \d\d:\d\d \(window 02:00-06:00", said["app"])
    assert said["app"] == said["cli"]  # nothing to fix, so nothing worded for one front end


def test_the_blocker_really_blocks_the_import(tmp_path):
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCKER)
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    done = subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "import of torch halted" in done.stderr


# ----------------------------------------------------------------- in process: the other answers
TORCH = Trainer("torch", "auto")


@pytest.fixture
def scheduled(home, tmp_path, monkeypatch):
    """A home whose schedule files exist (written where the OS would look, redirected to tmp)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    folder = tmp_path / "xdg" / "systemd" / "user"
    folder.mkdir(parents=True)
    for name in ("macaron-learn.service", "macaron-learn.timer"):
        (folder / name).write_text("[Unit]\n")
    return home


def feedback(store, count: int) -> None:
    conversation = store.new_conversation("embedded")
    for n in range(count):
        question = store.add_message(conversation, "user", f"q{n}")
        reply, _ = store.add_reply(conversation, question, f"a{n}", {"model": "embedded", "expert": "L0"})
        store.add_feedback(reply, "rating", value=1)


@pytest.mark.skipif(not sys.platform.startswith(("linux", "darwin")), reason="the daemon's platforms")
def test_paused_then_too_little_feedback_then_ready(scheduled):
    now = datetime(2026, 3, 1, 14, 0)
    with open_default_store(scheduled) as store:
        feedback(store, 3)
        scheduled.save(learning_paused=True)
        paused = readiness(scheduled, store, trainer=TORCH, now=now, ask_os=False)
        assert paused.state == "paused" and paused.action_app == "Resume it: Ctrl+L, then p."
        scheduled.save(learning_paused=False)
        waiting = readiness(scheduled, store, trainer=TORCH, now=now, ask_os=False)
        assert waiting.state == "needs_feedback" and not waiting.will_learn
        assert "once 7 more corrections, ratings or regenerations are given" in waiting.sentence()
        feedback(store, 7)
        ready = readiness(scheduled, store, trainer=TORCH, now=now, ask_os=False)
        assert ready.state == "ready" and ready.will_learn and ready.pending_feedback == 10
        assert ready.next_start == "2026-03-02T02:00" and "tonight at 02:00 (window 02:00-06:00" in ready.sentence()


def test_a_declined_setup_is_worded_as_the_users_choice(home, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    home.save(learning_setup="declined")
    with open_default_store(home) as store:
        said = readiness(home, store, trainer=TORCH, ask_os=False)
    assert said.choice == "declined" and said.sentence().startswith(
        "macaron will not learn from your feedback, because you chose not to set up learning, so the nightly schedule"
    )


def test_a_broken_daemon_table_is_reported_not_raised(home, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    home.save(daemon={"window": "2am"})
    with open_default_store(home) as store:
        said = readiness(home, store, trainer=TORCH, ask_os=False)
    assert said.state == "settings_error" and "window must look like" in said.reason


@pytest.mark.parametrize(
    ("now", "window", "expected_start", "words"),
    [
        (datetime(2026, 3, 1, 14, 0), "02:00-06:00", datetime(2026, 3, 2, 2, 0), "tonight at 02:00"),
        (datetime(2026, 3, 1, 3, 10), "02:00-06:00", datetime(2026, 3, 1, 3, 30), "tonight at 03:30"),
        (datetime(2026, 3, 1, 6, 0), "02:00-06:00", datetime(2026, 3, 2, 2, 0), "tonight at 02:00"),
        (datetime(2026, 3, 1, 9, 0), "12:00-13:00", datetime(2026, 3, 1, 12, 0), "today at 12:00"),
        (datetime(2026, 3, 1, 12, 45), "12:00-13:00", datetime(2026, 3, 2, 12, 0), "tomorrow at 12:00"),
        (datetime(2026, 3, 1, 21, 0), "23:00-01:00", datetime(2026, 3, 1, 23, 0), "tonight at 23:00"),
    ],
)
def test_next_start_and_its_words(now, window, expected_start, words):
    config = DaemonConfig(window=Window.parse(window))
    start = next_start(config, now)
    assert start == expected_start and describe_when(now, start) == words
