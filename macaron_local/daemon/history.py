"""What recent `macaron daemon run`s did: ran and deployed, ran and rejected, or did not run and why.

The store records each learning run (per slot, with its metrics); this file also remembers the
nights it *did not* learn, which is what a user asks about. It is a short JSON list (the last
`KEEP` entries) in the data directory, rewritten atomically under its own small lock so a run
and a concurrent "lock held" exit never interleave.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock

from macaron_local.settings import Settings, write_private_atomic

HISTORY_FILENAME = "daemon-runs.json"
KEEP = 50


@dataclass(frozen=True)
class DaemonRun:
    """One `daemon run`: outcome is learned | skipped | failed."""

    started_at: str
    finished_at: str
    outcome: str
    reasons: list[str] = field(default_factory=list)
    slots: list[dict[str, Any]] = field(default_factory=list)  # slot, decision, version_id, reason
    forced: bool = False  # --now: the window was not checked
    wall_s: float = 0.0

    @property
    def summary(self) -> str:
        if self.outcome == "learned":
            return "; ".join(f"{s['slot']} {s['decision']}" for s in self.slots) or "learned"
        return "; ".join(self.reasons) or self.outcome


def history_path(settings: Settings) -> Path:
    return settings.data_dir / HISTORY_FILENAME


def read_history(settings: Settings) -> list[DaemonRun]:
    """Every remembered run, oldest first (an unreadable file counts as empty: it is a log)."""
    path = history_path(settings)
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        return [DaemonRun(**entry) for entry in entries]
    except (OSError, ValueError, TypeError):
        return []


def record(settings: Settings, run: DaemonRun) -> None:
    settings.ensure_dirs()
    path = history_path(settings)
    with FileLock(path.with_name(f".{path.name}.lock"), mode=0o600, thread_local=False, timeout=10):
        entries = [asdict(r) for r in read_history(settings)][-(KEEP - 1) :]
        entries.append(asdict(run))
        write_private_atomic(path, json.dumps(entries, indent=1).encode("utf-8"))
