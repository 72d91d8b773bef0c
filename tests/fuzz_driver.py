"""Run many `macaron` command lines in one process, each as the real `main()` runs it.

A fresh interpreter costs about a second here, so the fuzz suite sends a batch of cases (JSON
on stdin) to one child process running this file. Each case gets its own MACARON_HOME, fresh
captured stdout/stderr, every warning shown (never deduplicated), and a SIGALRM deadline, so a
hang is reported as a hang rather than stalling the batch. For each case it reports the exit
code, stderr, a traceback if `main()` raised, the seconds taken, and a digest of the store
before and after, so the caller can check that a refused input changed nothing.

The suite still runs a smaller set through real `python -m macaron_local` subprocesses.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import signal
import sqlite3
import sys
import time
import traceback
import warnings
from pathlib import Path


class Hang(BaseException):
    """Raised by the alarm: not an Exception, so nothing in macaron can swallow it."""


def _alarm(signum, frame):  # noqa: ANN001
    raise Hang()


def store_digest(home: str) -> str:
    """A digest of every row of every table (and the files of the data folder but SQLite's)."""
    path = Path(home) / "data" / "macaron.db"
    digest = hashlib.sha256()
    data = Path(home) / "data"
    if data.is_dir():
        for entry in sorted(data.rglob("*")):
            if entry.is_file() and not entry.name.startswith("macaron.db"):
                digest.update(f"{entry.relative_to(data)}:{entry.stat().st_size}\n".encode())
    if not path.is_file():
        return digest.hexdigest() + ":nostore"
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        for table in tables:
            if table.startswith(("messages_fts", "sqlite_stat")):
                continue
            digest.update(table.encode())
            for row in conn.execute(f'SELECT * FROM "{table}" ORDER BY 1'):
                digest.update(repr(row).encode())
    finally:
        conn.close()
    return digest.hexdigest()


def run_case(case: dict) -> dict:
    from macaron_local.cli import main

    home = case["home"]
    os.environ["MACARON_HOME"] = home
    os.environ["HF_HUB_OFFLINE"] = "1"
    before = store_digest(home) if case.get("digest", True) else ""
    # Byte-backed, like a real terminal's streams: `logs export` writes to sys.stdout.buffer.
    out_bytes, err_bytes = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_bytes, encoding="utf-8", errors="backslashreplace", write_through=True)
    err = io.TextIOWrapper(err_bytes, encoding="utf-8", errors="backslashreplace", write_through=True)
    result: dict = {"name": case["name"], "rc": None, "traceback": "", "hang": False}
    start = time.perf_counter()
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, float(case.get("timeout", 10)))
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("always")
            try:
                result["rc"] = int(main(case["argv"]) or 0)
            except SystemExit as exc:  # argparse
                result["rc"] = exc.code if isinstance(exc.code, int) else 2
    except Hang:
        result["hang"] = True
    except BaseException:
        result["traceback"] = traceback.format_exc()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    result["seconds"] = time.perf_counter() - start
    out.flush()
    err.flush()
    result["stdout"] = out_bytes.getvalue().decode("utf-8", "backslashreplace")[-2000:]
    result["stderr"] = err_bytes.getvalue().decode("utf-8", "backslashreplace")[-4000:]
    if case.get("digest", True):
        try:
            result["changed"] = store_digest(home) != before
        except sqlite3.Error as exc:
            result["changed"] = f"store unreadable afterwards: {exc}"
    return result


def main() -> None:
    cases = json.load(sys.stdin)
    # Import the command before the first deadline starts: the interpreter's start and imports
    # are the same for every case and are not what a case measures.
    from macaron_local.cli import build_parser

    build_parser()
    results = [run_case(case) for case in cases]
    sys.stdout.write(json.dumps(results))


if __name__ == "__main__":
    main()
