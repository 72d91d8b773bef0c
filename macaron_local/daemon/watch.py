"""The app's watchdog on the store: notice at once when another process (the daemon, `macaron
adapters rollback`) changes what is deployed.

Deploying moves a pointer in the SQLite registry, so the signal is a write to the database
file or its WAL next to it. Writes come in bursts (several pages per commit), so callbacks are
debounced: one call per quiet period. The callback only says "look again"; the session then
re-reads the four deployment pointers, which is what decides. If the OS refuses a watch (out of
inotify watches), the session still re-reads the pointers at every turn; only the instant
notice is lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer

DEBOUNCE_S = 0.2
_WRITES = ("modified", "created", "moved", "closed", "deleted")

log = logging.getLogger(__name__)


class _StopRace(logging.Filter):
    """watchdog's inotify emitter logs an error when an event arrives while its thread is being
    stopped (it then drops the event, which is what stopping means). With no logging set up,
    Python prints that to stderr: a full CI run once saw `macaron ask` end with that stray line.
    Only that message is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "called when the thread is inactive" not in record.getMessage()


logging.getLogger("watchdog.observers.inotify").addFilter(_StopRace())


class _Handler(FileSystemEventHandler):
    def __init__(self, prefix: str, fire: Callable[[], None]) -> None:
        self.prefix = prefix
        self.fire = fire

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type not in _WRITES:
            return  # opens and read-only closes happen on every query
        names = [Path(str(event.src_path)).name, Path(str(getattr(event, "dest_path", "") or "")).name]
        if any(name.startswith(self.prefix) for name in names):
            self.fire()


class StoreWatcher:
    """Calls `on_change` (from a background thread) shortly after the database file changes."""

    def __init__(self, db_path: Path, on_change: Callable[[], None], debounce_s: float = DEBOUNCE_S) -> None:
        self.db_path = Path(db_path)
        self.on_change = on_change
        self.debounce_s = debounce_s
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()
        self._observer: Observer | None = None  # type: ignore[valid-type]

    def start(self) -> bool:
        """Begin watching; False (and a log line) when the OS will not let us."""
        observer = Observer()
        observer.daemon = True
        try:
            observer.schedule(_Handler(self.db_path.name, self._fire), str(self.db_path.parent), recursive=False)
            observer.start()
        except OSError as exc:
            log.warning("cannot watch %s for deployed adapters: %s", self.db_path.parent, exc)
            return False
        self._observer = observer
        return True

    @property
    def running(self) -> bool:
        return self._observer is not None

    def _fire(self) -> None:
        with self._lock:
            if self._timer is not None:
                return
            self._timer = threading.Timer(self.debounce_s, self._deliver)
            self._timer.daemon = True
            self._timer.start()

    def _deliver(self) -> None:
        with self._lock:
            self._timer = None
        try:
            self.on_change()
        except Exception:  # a listener's bug must not kill the watcher thread
            log.exception("store change listener failed")

    def stop(self) -> None:
        observer, self._observer = self._observer, None
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if observer is not None:
            observer.stop()
            observer.join(timeout=5)
