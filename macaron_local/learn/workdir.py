"""Scratch space for one learning run, next to the store (`learn-work/run-<pid>-<n>`), private.

A run killed at any point (kill -9, power cut) cannot clean up after itself, and its rollout
and candidate files can be large; the next run removes every scratch folder whose process is
gone before it starts, so it always starts clean. Nothing in here is ever served: the registry
copies a candidate in atomically before it can be deployed.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

_counter = itertools.count()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process: leave its folder alone
    return True


def remove_stale(root: Path) -> list[Path]:
    """Delete scratch folders left by runs whose process no longer exists; returns them."""
    removed = []
    for folder in root.glob("run-*") if root.is_dir() else ():
        try:
            pid = int(folder.name.split("-")[1])
        except (IndexError, ValueError):
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


@contextlib.contextmanager
def run_workdir(root: Path) -> Iterator[Path]:
    """A fresh private folder for this run, removed when the run ends (stale ones first)."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    remove_stale(root)
    folder = root / f"run-{os.getpid()}-{next(_counter)}"
    folder.mkdir(mode=0o700)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
