"""What one client may ask of the server: body size, queued generations, reply length.

The engine answers one generation at a time, so concurrency is a queue: `Admission` lets in
the one running plus `queue` waiting, and answers 429 past that at once, rather than letting
requests pile up without bound. A request holds its place until its generation has finished
on the worker, even if its client has gone, so the count is what the worker really has to do.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from starlette.requests import Request


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 4 * 1024 * 1024
    queue: int = 16  # generations waiting behind the running one
    max_tokens: int = 2048  # longest reply; a request asking for more gets this many


class TooLargeError(Exception):
    """The body is over the limit (answered with 413)."""


class BusyError(Exception):
    """The queue is full (answered with 429)."""


class Admission:
    """Counts generations admitted and not yet finished; thread-safe (released by the worker)."""

    def __init__(self, queue: int) -> None:
        self.capacity = 1 + queue
        self._held = 0
        self._lock = threading.Lock()

    def enter(self) -> None:
        with self._lock:
            if self._held >= self.capacity:
                raise BusyError(f"the server is busy: {self._held} generations running or queued; retry shortly")
            self._held += 1

    def leave(self) -> None:
        with self._lock:
            self._held -= 1

    @property
    def held(self) -> int:
        return self._held


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing anything over `limit` bytes before reading it (by its
    Content-Length) or as soon as a chunked body passes it."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLargeError(f"the body is {int(declared)} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLargeError(f"the body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
