"""A killed learning run leaves scratch files behind; the next run removes them and starts clean."""

from __future__ import annotations

import os
import subprocess
import sys

from macaron_local.learn.workdir import remove_stale, run_workdir


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_folders_of_dead_runs_go_and_live_ones_stay(tmp_path):
    root = tmp_path / "learn-work"
    stale = root / f"run-{dead_pid()}-0"
    (stale / "rollout-6.gguf").parent.mkdir(parents=True)
    (stale / "rollout-6.gguf").write_bytes(b"x" * 1000)
    live_child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        live = root / f"run-{live_child.pid}-0"
        live.mkdir()
        unrelated = root / "notes"
        unrelated.mkdir()
        with run_workdir(root) as mine:
            assert mine.is_dir() and oct(mine.stat().st_mode & 0o777) == "0o700"
            assert not stale.exists() and live.exists() and unrelated.exists()
            (mine / "candidate.gguf").write_bytes(b"y")
        assert not mine.exists()  # removed when the run ends
        assert remove_stale(root) == [] and live.exists()
    finally:
        live_child.kill()
        live_child.wait()
    assert remove_stale(root) == [live]


def test_own_folder_is_never_taken_for_stale(tmp_path):
    root = tmp_path / "w"
    with run_workdir(root) as mine:
        assert remove_stale(root) == [] and mine.exists()
        assert mine.name.startswith(f"run-{os.getpid()}-")
