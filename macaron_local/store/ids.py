"""Identifiers and timestamps for stored rows.

IDs are ULID-shaped (26 Crockford base32 characters: 48 bits of milliseconds, then 80 bits that
start random and count up within one millisecond), so they sort in creation order: exports,
listings and sibling order stay stable even when two rows share a timestamp. A tiny generator
here keeps the store free of a dependency for something this small.
"""

from __future__ import annotations

import secrets
import threading
import time
from datetime import UTC, datetime

_ALPHABET = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_RANDOM_BITS = 80
_lock = threading.Lock()
_last_ms = -1
_last_random = 0


def _encode(value: int, length: int) -> str:
    chars = []
    for _ in range(length):
        value, index = divmod(value, 32)
        chars.append(_ALPHABET[index])
    return "".join(reversed(chars))


def new_id() -> str:
    """A new time-ordered unique id; strictly increasing within this process."""
    global _last_ms, _last_random
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms <= _last_ms:
            # Same millisecond (or the clock stepped back): keep order by counting up.
            ms = _last_ms
            _last_random += 1
            if _last_random >> _RANDOM_BITS:
                ms, _last_random = ms + 1, secrets.randbits(_RANDOM_BITS - 1)
        else:
            # Top bit clear leaves room to count up without overflowing.
            _last_random = secrets.randbits(_RANDOM_BITS - 1)
        _last_ms = ms
        return _encode(ms, 10) + _encode(_last_random, 16)


def now_iso() -> str:
    """The current UTC time as ISO-8601 with microseconds and a `Z`: sorts as text."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
