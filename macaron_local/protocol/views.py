"""Each expert's own view of the conversation, and the summary hop's view of one task.

A task is one routed request: the user's message, then the expert's replies, tool calls and
tool results, up to its final answer. An expert sees
- the system message (the user's system prompt, then the profile's identity instruction),
- its own earlier tasks verbatim (tool calls and results included),
- every other expert's task as the request and one assistant message carrying the task's
  summary (the final reply itself when there is no summary: summaries turned off), or
  verbatim when the task itself is no longer than that (a short answer from a small model
  can be shorter than its summary: a hand-off is there to save tokens, never to add them),
- the current task.
Everything in a view is either stored and never rewritten or derived from stored text, so a
view only ever grows at its end: the KV the engine saved for that expert stays a prefix and
only the new tail is prefilled. (A correction rewrites a reply on purpose; the views that hold
it change from there on.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from macaron_local.engine.template import Message
from macaron_local.protocol.profile import RoutingProfile


@dataclass(frozen=True)
class Step:
    """One message of the current branch with what the protocol needs about it."""

    role: str
    content: str
    expert: str | None = None  # replies: the expert that wrote it
    summary: str | None = None  # a reply that closed its task: that task's summary
    tool_call: bool = False  # a reply that ended in a tool call (its task stays open)


@dataclass(frozen=True)
class Task:
    owner: str | None  # the expert that answered it; None while nobody has
    steps: list[Step] = field(default_factory=list)

    @property
    def closed(self) -> bool:
        last = self.steps[-1]
        return last.role == "assistant" and not last.tool_call

    @property
    def summary(self) -> str | None:
        return self.steps[-1].summary if self.closed else None

    def messages(self) -> list[Message]:
        return [{"role": s.role, "content": s.content} for s in self.steps]


def tasks_of(steps: Sequence[Step]) -> list[Task]:
    """Split a branch into tasks: each user message starts one (system messages are skipped:
    the view writes its own)."""
    tasks: list[Task] = []
    for step in steps:
        if step.role == "system":
            continue
        if step.role == "user" or not tasks:
            tasks.append(Task(owner=None, steps=[step]))
            continue
        task = tasks[-1]
        owner = task.owner or (step.expert if step.role == "assistant" else None)
        tasks[-1] = Task(owner=owner, steps=[*task.steps, step])
    return tasks


def system_message(system_prompt: str, profile: RoutingProfile) -> Message:
    """The user's system prompt with the identity instruction after it (or alone)."""
    content = f"{system_prompt}\n\n{profile.intro}" if system_prompt else profile.intro
    return {"role": "system", "content": content}


def own_view(steps: Sequence[Step], expert: str, system_prompt: str, profile: RoutingProfile) -> list[Message]:
    """What `expert` reads to answer the last step of `steps`."""
    messages = [system_message(system_prompt, profile)]
    tasks = tasks_of(steps)
    for index, task in enumerate(tasks):
        current = index == len(tasks) - 1
        if current or task.owner in (None, expert):
            messages += task.messages()
            continue
        request, last = task.steps[0], task.steps[-1]
        handoff = profile.handoff_text(task.summary) if task.summary else last.content
        condensed = [{"role": request.role, "content": request.content}, {"role": "assistant", "content": handoff}]
        verbatim = task.messages()
        messages += verbatim if _length(verbatim) <= _length(condensed) else condensed
    return messages


def _length(messages: Sequence[Message]) -> int:
    """Characters of content: decides between a task and its hand-off from stored text alone,
    so the choice never changes once made and the view stays byte-stable."""
    return sum(len(m["content"]) for m in messages)


def transcript_view(steps: Sequence[Step], system_prompt: str, profile: RoutingProfile) -> list[Message]:
    """The whole transcript, verbatim: what every expert read before own views (the baseline)."""
    return [system_message(system_prompt, profile), *(t for task in tasks_of(steps) for t in task.messages())]


def summary_view(task: Task, system_prompt: str, profile: RoutingProfile) -> list[Message]:
    """The summary hop's view: the finished task's full trace, then the summary instruction."""
    return [
        system_message(system_prompt, profile),
        *task.messages(),
        {"role": "user", "content": profile.summary_instruction},
    ]
