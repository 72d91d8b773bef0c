"""Explicit transactions: every write is all-or-nothing, and writers take the lock up front.

A plain `BEGIN` starts as a reader and upgrades to a writer at its first write; under WAL that
upgrade fails at once with SQLITE_BUSY (no waiting) when another connection committed in
between. `BEGIN IMMEDIATE` takes the write lock first, so the busy timeout applies and a write
either waits its turn or fails cleanly before changing anything. Nested blocks become
savepoints (via sqlite-utils' `atomic`), so helpers compose into one transaction.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlite_utils import Database


@contextmanager
def write_transaction(db: Database) -> Iterator[Database]:
    """Run the block in one write transaction (BEGIN IMMEDIATE); roll back on any exception."""
    if db.conn.in_transaction:
        with db.atomic():
            yield db
        return
    db.conn.execute("BEGIN IMMEDIATE")
    try:
        yield db
    except BaseException:
        if db.conn.in_transaction:
            db.conn.execute("ROLLBACK")
        raise
    try:
        db.conn.execute("COMMIT")
    except BaseException:
        if db.conn.in_transaction:
            db.conn.execute("ROLLBACK")
        raise


@contextmanager
def read_transaction(db: Database) -> Iterator[Database]:
    """Run several reads against one consistent snapshot (a deferred BEGIN that never writes)."""
    if db.conn.in_transaction:
        yield db
        return
    db.conn.execute("BEGIN")
    try:
        yield db
    finally:
        if db.conn.in_transaction:
            db.conn.execute("COMMIT")
