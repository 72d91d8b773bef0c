"""`macaron setup` and the terminal's first-run question: consent first, answers remembered, a
dry run that writes and remembers nothing, and one clear line when no one can be asked."""

from __future__ import annotations

from conftest import run_cli

from macaron_local.cli.setup import interactive_setup
from macaron_local.learning_setup import LearningSetup
from macaron_local.settings import Settings


def test_without_a_terminal_setup_asks_for_yes_or_decline_in_one_line(tmp_path):
    done = run_cli("setup", home=tmp_path / "home", input="", XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: macaron setup asks before installing anything: add --yes (or --decline)"
    ]


def test_dry_run_prints_the_units_and_remembers_nothing_decline_is_remembered(tmp_path):
    home, xdg = tmp_path / "home", tmp_path / "xdg"
    dry = run_cli("setup", "--dry-run", home=home, XDG_CONFIG_HOME=str(xdg))
    assert dry.returncode == 0, dry.stderr
    assert "OnCalendar=*-*-* 02,03,04,05:00,30:00" in dry.stdout and "dry run: would write" in dry.stdout
    assert not xdg.exists() and "learning_setup" not in Settings.load(home).configured()
    declined = run_cli("setup", "--decline", home=home, XDG_CONFIG_HOME=str(xdg))
    assert declined.returncode == 0 and "remembered" in declined.stdout
    assert Settings.load(home).configured()["learning_setup"] == "declined"


def test_the_terminal_question_declines_or_sets_up(home, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    asked = []
    assert interactive_setup(home, LearningSetup(home, schedule_mode="dry-run"), lambda q: asked.append(q) or "") == 0
    assert asked == ["Set up learning now? [y/N] "]  # the default is no: nothing without consent
    assert Settings.load().configured()["learning_setup"] == "declined"
    shown = capsys.readouterr().out
    assert "schedule: not installed" in shown and "trainer:" in shown
    setup = LearningSetup(home, schedule_mode="files")
    assert interactive_setup(home, setup, lambda q: "y", with_trainer=False) == 0  # never a real download
    assert Settings.load().configured()["learning_setup"] == "accepted"
    assert (tmp_path / "xdg" / "systemd" / "user" / "macaron-learn.timer").is_file()
    assert "wrote the systemd user service and timer (not started)" in capsys.readouterr().out
