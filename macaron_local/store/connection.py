"""Opening the store file safely: private permissions, WAL, and checks before any change.

The order matters. We check the file is SQLite and was not written by a newer version before
setting WAL (which rewrites the header), so a refused file is left exactly as it was. Then the
pragmas every connection needs, the migrations, and a rolled-back probe write, so a read-only
store is reported when it is opened rather than when the user's first correction is lost.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import stat
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout
from sqlite_utils import Database

from macaron_local.store.errors import StoreError, sqlite_errors
from macaron_local.store.migrations import MIGRATIONS, applied_migrations, check_not_newer, migrate

DEFAULT_BUSY_TIMEOUT_MS = 5000


def connect(path: Path, *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS) -> Database:
    """Open (creating if needed) the store at `path`, migrated and ready; StoreError if not."""
    path = Path(path)
    _prepare_file(path)
    with sqlite_errors(path):
        conn = sqlite3.connect(
            str(path),
            timeout=busy_timeout_ms / 1000,
            isolation_level=None,  # we issue BEGIN/COMMIT ourselves (transactions.py)
            check_same_thread=False,  # Store serialises its own use of the connection
        )
        try:
            db = Database(conn, execute_plugins=False)
            with _opening_lock(path, busy_timeout_ms):
                _configure(db, busy_timeout_ms)
                migrate(db)
                _probe_writable(db)
        except BaseException:
            conn.close()
            raise
    tighten_sidecars(path)
    return db


def connect_readonly(path: Path, *, busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS) -> Database:
    """Open the store only to read it: nothing is created, chmod-ed, migrated or probed, so
    `logs list` and friends work on a read-only folder or mount.

    A store that does not exist yet reads as an empty one (an in-memory database, migrated). A
    store that needs a migration is opened the writing way, which migrates it or says in one
    line why it cannot."""
    path = Path(path)
    if not os.path.lexists(path):
        db = Database(sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False), execute_plugins=False)
        migrate(db)
        return db
    if path.is_dir():
        raise StoreError(f"cannot open the store {path}: it is a directory, not a database file")
    uri = "file:" + urllib.parse.quote(str(path.resolve())) + "?mode=ro"
    with sqlite_errors(path):
        conn = sqlite3.connect(
            uri, uri=True, timeout=busy_timeout_ms / 1000, isolation_level=None, check_same_thread=False
        )
        try:
            try:
                conn.execute("PRAGMA schema_version").fetchone()
            except sqlite3.OperationalError:
                # A WAL store needs its -shm file, which a read-only folder cannot take. Nothing
                # can write there either, so the file cannot change under us: read it immutable.
                if os.access(path.parent, os.W_OK):
                    raise
                conn.close()
                conn = sqlite3.connect(uri + "&immutable=1", uri=True, isolation_level=None, check_same_thread=False)
            db = Database(conn, execute_plugins=False)
            db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
            db.execute("PRAGMA schema_version").fetchone()
            check_not_newer(db)
            db.execute("PRAGMA foreign_keys = ON")
            pending = set(m.__name__ for m in MIGRATIONS) - set(applied_migrations(db))
        except BaseException:
            conn.close()
            raise
    if pending:
        conn.close()
        return connect(path, busy_timeout_ms=busy_timeout_ms)
    return db


@contextlib.contextmanager
def _opening_lock(path: Path, busy_timeout_ms: int) -> Iterator[None]:
    """Serialise the opening sequence between programs (and threads) opening the same store.

    Switching a new database to WAL needs an exclusive lock, and SQLite answers "busy" at once,
    without waiting, when two connections would otherwise deadlock upgrading their locks; two
    programs creating the store together (the app and the daemon) hit exactly that. A lock file
    beside the database makes them take turns. Where it cannot be created (a read-only folder)
    we go on without it: the store's own checks then report the real problem.
    """
    lock = FileLock(str(path) + ".lock", timeout=busy_timeout_ms / 1000, mode=0o600)
    try:
        lock.acquire()
    except Timeout:
        raise StoreError(
            f"the store {path} is being opened by another program that did not finish in time; try again"
        ) from None
    except OSError:
        yield
        return
    try:
        yield
    finally:
        lock.release()


def _prepare_file(path: Path) -> None:
    """Create missing folders 0700 and the database file 0600 before SQLite sees it."""
    if path.is_dir():
        raise StoreError(f"cannot open the store {path}: it is a directory, not a database file")
    existed = path.exists()
    missing = [p for p in reversed(path.parents) if not p.exists()]
    try:
        for folder in missing:
            try:
                folder.mkdir(mode=0o700)
            except FileExistsError:
                continue  # another process made it just now
            os.chmod(folder, 0o700)  # mkdir's mode is filtered by the umask
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
    except OSError as exc:
        if isinstance(exc, PermissionError) or exc.errno == errno.EROFS:
            what = f"the store {path} is read-only" if existed else f"cannot create the store {path}"
            raise StoreError(
                f"{what} ({exc.strerror}): make it and its folder writable by you, or set MACARON_HOME"
            ) from None
        raise StoreError(f"cannot open the store {path}: {exc.strerror or exc}") from None
    _chmod_private(path)


def _configure(db: Database, busy_timeout_ms: int) -> None:
    # Reading the schema fails with SQLITE_NOTADB for a foreign file before anything is written.
    db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
    db.execute("PRAGMA schema_version").fetchone()
    check_not_newer(db)
    db.execute("PRAGMA foreign_keys = ON")
    # WAL: readers never block the writer (the UI reads while a reply is being saved).
    # synchronous=NORMAL is durable against application crashes and, under WAL, keeps the
    # database consistent after power loss (the last commits may roll back); commits skip fsync,
    # which is what keeps a feedback write in the low milliseconds.
    mode = db.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if str(mode).lower() != "wal":
        raise StoreError(f"the store {_path_of(db)} could not switch to WAL mode (got {mode}); is it read-only?")
    db.execute("PRAGMA synchronous = NORMAL")


def _probe_writable(db: Database) -> None:
    """Fail now, with nothing changed, if this connection cannot write (read-only file or mount)."""
    db.conn.execute("BEGIN IMMEDIATE")
    try:
        version = db.conn.execute("PRAGMA user_version").fetchone()[0]
        db.conn.execute(f"PRAGMA user_version = {int(version)}")
    finally:
        db.conn.execute("ROLLBACK")


def tighten_sidecars(path: Path) -> None:
    """Make the -wal and -shm files private too (SQLite copies the db's mode, but be sure)."""
    for suffix in ("-wal", "-shm"):
        _chmod_private(path.with_name(path.name + suffix))


def _chmod_private(path: Path) -> None:
    try:
        mode = path.stat().st_mode
        if stat.S_IMODE(mode) != 0o600:
            os.chmod(path, 0o600)
    except OSError:
        pass  # not there yet, or not ours to change: SQLite reports real access problems


def _path_of(db: Database) -> str:
    row = db.execute("PRAGMA database_list").fetchone()
    return row[2] if row else "the store"
