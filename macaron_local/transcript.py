"""The current branch of a conversation as a front end shows it: each reply's expert tag, the
feedback given on it, its position among its siblings, and its reasoning block (kept apart
from the reply, shown folded)."""

from __future__ import annotations

from dataclasses import dataclass, field

from macaron_local.adapter_names import shown_adapters
from macaron_local.catalog import SLOTS
from macaron_local.learn.episodes import latest_corrections
from macaron_local.store import Store


@dataclass(frozen=True)
class TranscriptItem:
    """One message of the current branch, as a front end shows it."""

    message_id: str
    role: str
    content: str
    tag: str = ""  # which expert and adapters wrote a reply
    marks: list[str] = field(default_factory=list)  # feedback given and branch position
    branch: tuple[int, int] = (1, 1)  # (this sibling's number, how many siblings)
    thinking: str = ""  # the reply's reasoning block (never part of the reply itself)


def build_transcript(store: Store, conversation_id: str, leaf_id: str) -> list[TranscriptItem]:
    conversation = store.get_conversation(conversation_id)
    turns = {t.message_id: t for t in conversation.turns}
    feedback: dict[str, list] = {}
    for item in conversation.feedback:
        feedback.setdefault(item.message_id, []).append(item)
    corrected = latest_corrections(conversation.feedback)
    by_parent: dict[str | None, list[str]] = {}
    for message in conversation.messages:
        by_parent.setdefault(message.parent_id, []).append(message.id)
    # Each learned version named once, not once per reply it wrote (two lookups each).
    recorded = sorted({label for turn in turns.values() for label in turn.adapters or []})
    names = dict(zip(recorded, shown_adapters(store, recorded), strict=True))
    items = []
    for message in store.path(leaf_id):
        siblings = by_parent.get(message.parent_id, [message.id])
        position = (siblings.index(message.id) + 1, len(siblings))
        marks = []
        ratings = [f.value for f in feedback.get(message.id, []) if f.kind == "rating"]
        if ratings:
            marks.append("[green]+1[/green]" if ratings[-1] > 0 else "[red]-1[/red]")
        if message.id in corrected:
            marks.append("[yellow]corrected by you[/yellow]")
        if position[1] > 1:
            marks.append(f"[dim]branch {position[0]}/{position[1]}[/dim]")
        tag = ""
        turn = turns.get(message.id)
        if message.role == "assistant" and turn is not None:
            expert = turn.expert or "L0"
            tag = f"{expert} {SLOTS.get(expert, '')}".strip()
            if turn.adapters:
                tag += " · " + ", ".join(names[label] for label in turn.adapters)
        content = corrected.get(message.id, message.content)
        thinking = (turn.thinking or "") if turn is not None else ""
        items.append(TranscriptItem(message.id, message.role, content, tag, marks, position, thinking))
    return items
