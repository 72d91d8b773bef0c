"""The rows the store hands out: plain frozen dataclasses, so front ends never see SQLite."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
FEEDBACK_KINDS = ("correction", "rating", "regenerate")


@dataclass(frozen=True)
class Message:
    """One node of a conversation tree; `parent_id` is None for a first message (a root)."""

    id: str
    conversation_id: str
    parent_id: str | None
    role: str
    content: str
    created_at: str


@dataclass(frozen=True)
class Turn:
    """How one assistant message was produced: routing, adapters, sampling and timings."""

    id: str
    conversation_id: str
    message_id: str
    model: str
    expert: str | None
    route_method: str | None
    route_reason: str | None
    adapters: list[str]
    sampling: dict[str, Any]
    prompt_tokens: int | None
    completion_tokens: int | None
    ttft_ms: float | None
    total_ms: float | None
    finish_reason: str | None
    created_at: str
    route_raw: str | None = None  # what the route hop generated (None: no hop ran)
    route_ms: float | None = None
    summary: str | None = None  # the hidden summary of the task this reply closed
    summary_ms: float | None = None
    thinking: str | None = None  # the reasoning block, kept out of the reply and the history
    tool_calls: list[dict[str, Any]] | None = None  # the calls this reply made and what became of them


@dataclass(frozen=True)
class Feedback:
    """A user signal on an assistant message: a correction, a +1/-1 rating, or a regenerate."""

    id: int
    conversation_id: str
    message_id: str
    kind: str
    value: int | None
    text: str | None
    created_at: str


@dataclass(frozen=True)
class Conversation:
    """A whole conversation: every branch's messages, their turns and feedback, oldest first."""

    id: str
    title: str | None
    model: str | None
    system_prompt: str | None
    created_at: str
    updated_at: str
    current_leaf_id: str | None
    messages: list[Message] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    feedback: list[Feedback] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ConversationSummary:
    """One line of a conversation listing."""

    id: str
    title: str | None
    model: str | None
    updated_at: str
    messages: int


@dataclass(frozen=True)
class SearchHit:
    """A message matching a search, with a short snippet around the match."""

    conversation_id: str
    message_id: str
    role: str
    snippet: str
    title: str | None
    created_at: str


@dataclass(frozen=True)
class FeedbackItem:
    """A feedback row with what the learner needs: the conversation path up to the message."""

    feedback: Feedback
    system_prompt: str | None
    model: str | None
    path: list[Message]


@dataclass(frozen=True)
class LearningRun:
    """One nightly learning attempt and which feedback it learned from."""

    id: str
    started_at: str
    finished_at: str | None
    slot: str | None
    status: str | None
    decision: str | None
    reason: str | None
    feedback_ids: list[int]
    metrics: dict[str, Any]
    adapter_version: str | None
    tainted: bool
    tainted_reason: str | None


@dataclass(frozen=True)
class ForgetResult:
    """What `forget` deleted, and which learning runs (and adapter versions) it marked tainted."""

    conversation_id: str
    messages: int
    feedback: int
    tainted_runs: list[str]
    adapter_versions: list[str]
    #: "slot@base" -> the version served instead (None: the bare expert), for every deployment
    #: that had learned from the conversation.
    rolled_back: dict[str, str | None] = field(default_factory=dict)
    deleted_files: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line saying what happened, for the app and the CLI."""
        line = f"forgot conversation {self.conversation_id}: {self.messages} messages, {self.feedback} feedback entries"
        if not self.tainted_runs:
            return line + "; no learning run had learned from it"
        if not self.adapter_versions:
            return line + f"; {len(self.tainted_runs)} learning run(s) that used it will not count"
        served = ", ".join(
            f"{key.split('@')[0]} now serves {version or 'the bare expert'}"
            for key, version in self.rolled_back.items()
        )
        return (
            f"{line}; {len(self.adapter_versions)} learned version(s) that knew it removed "
            f"({len(self.deleted_files)} file(s) deleted){'; ' + served if served else ''}; "
            "the next learning run retrains without it"
        )


@dataclass(frozen=True)
class ImportResult:
    """What an import did: conversations added, ids skipped because they already exist, and how
    many feedback ids had to be renumbered (ids are never reused; learning runs refer to them)."""

    imported: list[str]
    skipped: list[str]
    renumbered_feedback: int = 0


#: What a turn records about a reply (`record_turn`'s keyword arguments, and the keys an
#: `add_reply` turn dict may carry); exports list them in this order.
TURN_FIELDS = (
    "model",
    "expert",
    "route_method",
    "route_reason",
    "adapters",
    "sampling",
    "prompt_tokens",
    "completion_tokens",
    "ttft_ms",
    "total_ms",
    "finish_reason",
    "route_raw",
    "route_ms",
    "summary",
    "summary_ms",
    "thinking",
)
