"""What a front end shows for the adapters that wrote a reply.

A turn records each adapter by what identifies it for good: an expert's file name, or
`personal <version id>` for the user's learned adapter (forgetting and rollback trace turns by
it). A 26-character id means nothing to a reader, so a reply's tag names a learned version by
when it was learned, in the reader's local time, and says when it has since been forgotten.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime

from macaron_local.errors import MacaronError
from macaron_local.store import Store

PERSONAL_PREFIX = "personal "


def learned_when(created_at: str) -> str:
    """'5 Dec 03:12' in local time for a registry timestamp (ISO-8601 UTC); the text as it is
    when it does not parse."""
    try:
        moment = datetime.fromisoformat(created_at.replace("Z", "+00:00"))
    except ValueError:
        return created_at
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    local = moment.astimezone()
    return f"{local.day} {local:%b %H:%M}"


def shown_adapter(store: Store, recorded: str) -> str:
    """One recorded adapter as a reader sees it: an expert's file name as it is; a learned
    version as 'personal, learned 5 Dec 03:12' (or 'personal, since forgotten')."""
    if not recorded.startswith(PERSONAL_PREFIX):
        return recorded
    version_id = recorded.removeprefix(PERSONAL_PREFIX)
    try:
        version = store.adapter_version(version_id)
    except MacaronError:
        return "personal, since removed"
    if store.forgotten_reason(version_id) is not None:
        return "personal, since forgotten"
    return f"personal, learned {learned_when(version.created_at)}"


def shown_adapters(store: Store, recorded: Iterable[str]) -> list[str]:
    return [shown_adapter(store, label) for label in recorded]
