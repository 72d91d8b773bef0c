"""Cross-process locks between the app and the daemon, both in the data directory.

- `single_instance`: only one `macaron daemon run` learns at a time (a second one exits saying
  so). A plain exclusive file lock: the OS drops it if the run is killed, so a crash never
  leaves a stale lock behind the way a pid file would.
- `GeneratingMarker`: a session holds a *shared* lock on `generating.lock` while a reply
  streams; `chat_generating` asks for an exclusive lock without waiting, which fails exactly
  while any process (or thread) is generating. Shared locks let two chats generate at once
  without one's end hiding the other's. POSIX only (fcntl); elsewhere nobody is seen generating.
- `AppOpenMarker`: the same shared lock on `app-open.lock`, held by every open session (a chat
  app) for its whole life, so the memory plan counts the app's own engine even while it idles;
  the OS drops it when the app exits or dies.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from macaron_local.settings import Settings

try:
    import fcntl
except ImportError:  # Windows: no flock; the daemon is for macOS and Linux
    fcntl = None  # type: ignore[assignment]

DAEMON_LOCK = "daemon.lock"
GENERATING_LOCK = "generating.lock"
APP_OPEN_LOCK = "app-open.lock"


def daemon_lock_path(settings: Settings) -> Path:
    return settings.data_dir / DAEMON_LOCK


def generating_lock_path(settings: Settings) -> Path:
    return settings.data_dir / GENERATING_LOCK


@contextlib.contextmanager
def single_instance(settings: Settings) -> Iterator[bool]:
    """Yield True while holding the daemon's lock, False (at once) if another run holds it."""
    settings.ensure_dirs()
    lock = FileLock(daemon_lock_path(settings), mode=0o600, thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def daemon_running(settings: Settings) -> bool:
    """Is a `daemon run` holding the lock right now?"""
    with single_instance(settings) as acquired:
        return not acquired


def _open_private(path: Path) -> int:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o600)


class GeneratingMarker:
    """Held (shared) by one streaming reply; `release` is idempotent."""

    lock_name = GENERATING_LOCK

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    @classmethod
    def hold(cls, settings: Settings, wait_s: float = 1.0) -> GeneratingMarker:
        """Take the shared lock. The daemon's probe holds the exclusive one for microseconds,
        so a short retry always gets it; if it cannot (no flock), chat goes on unmarked."""
        if fcntl is None:
            return cls(None)
        try:
            fd = _open_private(settings.data_dir / cls.lock_name)
        except OSError:
            return cls(None)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return cls(fd)
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    return cls(None)
                time.sleep(0.005)
            except OSError:
                os.close(fd)
                return cls(None)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the descriptor drops its lock

    def __del__(self) -> None:  # a reply dropped unread must not mark the chat busy forever
        self.release()


class AppOpenMarker(GeneratingMarker):
    """Held (shared) by one open session from its start to its `close`."""

    lock_name = APP_OPEN_LOCK


def chat_generating(settings: Settings) -> bool:
    """True while any session anywhere holds the generating marker."""
    return _held_shared(generating_lock_path(settings))


def chat_app_open(settings: Settings) -> bool:
    """True while any session (a chat app, `macaron ask`) is open anywhere on this data dir."""
    return _held_shared(settings.data_dir / APP_OPEN_LOCK)


def _held_shared(path: Path) -> bool:
    """Does any process hold a shared lock on `path`? (An exclusive try that fails says so.)"""
    if fcntl is None or not path.exists():
        return False
    fd = _open_private(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # a filesystem without locks: nobody can be seen generating
    finally:
        os.close(fd)
    return False
