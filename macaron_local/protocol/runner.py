"""One model's protocol, put together for the session: which route a turn takes, the prompt its
expert answers from, how a reply is split and whether it closes its task, and the summary hop.

The session stays the front ends' thin API; everything here is about one turn's hops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from macaron_local.catalog import Manifest
from macaron_local.engine import AdapterHandle, Engine
from macaron_local.engine.template import Message
from macaron_local.learn.episodes import latest_corrections
from macaron_local.protocol.features import ends_in_tool_call, family_for, split_reasoning
from macaron_local.protocol.options import ProtocolOptions, protocol_options, resolve_profile
from macaron_local.protocol.profile import RoutingProfile
from macaron_local.protocol.route import run_route_hop
from macaron_local.protocol.summary import SummaryHop, run_summary_hop
from macaron_local.protocol.views import Step, Task, own_view, tasks_of
from macaron_local.router import Route, route
from macaron_local.store import Store


@dataclass(frozen=True)
class SplitReply:
    """A finished reply as the protocol sees it."""

    content: str  # what is stored, shown and fed back as the reply
    thinking: str  # the reasoning block, kept apart
    tool_call: bool  # ends in a tool call: the task stays open, no summary


class Protocol:
    """Route, answer, summarize for one model (its profile, options and model family)."""

    def __init__(
        self,
        manifest: Manifest,
        *,
        routing: str = "model",
        profile_files: Mapping[str, Path] | None = None,
    ) -> None:
        self.options: ProtocolOptions = protocol_options(manifest)
        self.profile: RoutingProfile = resolve_profile(manifest, profile_files)
        self.family = family_for(manifest.architecture, self.options.family)
        self.routing = routing

    # ----------------------------------------------------------------- the branch
    def steps(self, store: Store, conversation_id: str, leaf_id: str) -> list[Step]:
        """The branch ending at `leaf_id` with each reply's expert and summary (corrections
        applied: the model reads the user's corrected text)."""
        conversation = store.get_conversation(conversation_id)
        corrected = latest_corrections(conversation.feedback)
        turns = {t.message_id: t for t in conversation.turns}
        steps = []
        for message in store.path(leaf_id):
            content = corrected.get(message.id, message.content)
            turn = turns.get(message.id)
            if message.role == "assistant":
                steps.append(
                    Step(
                        "assistant",
                        content,
                        expert=(turn.expert if turn else None) or "L0",
                        summary=turn.summary if turn else None,
                        tool_call=ends_in_tool_call(message.content, self.family),
                    )
                )
            else:
                steps.append(Step(message.role, content))
        return steps

    @staticmethod
    def pending_expert(steps: Sequence[Step]) -> str | None:
        """A tool result goes back to the expert that replied just before it (the call)."""
        if len(steps) >= 2 and steps[-1].role == "tool":
            for step in reversed(steps[:-1]):
                if step.role == "assistant":
                    return step.expert
        return None

    # ----------------------------------------------------------------- hops
    def route(
        self,
        engine: Engine,
        text: str,
        l0_adapters: Sequence[AdapterHandle],
        *,
        explicit: str | None = None,
        pending: str | None = None,
    ) -> Route:
        def hop(request: str):
            return run_route_hop(engine, self.profile, request, l0_adapters, max_tokens=self.options.route_max_tokens)

        return route(
            text,
            explicit=explicit,
            pending_slot=pending,
            hop=hop,
            mode=self.routing,
            default=self.profile.default_label,
        )

    def answer_view(self, steps: Sequence[Step], expert: str, system_prompt: str) -> list[Message]:
        return own_view(steps, expert, system_prompt, self.profile)

    def split(self, text: str) -> SplitReply:
        thinking, content = split_reasoning(text)
        return SplitReply(content, thinking, ends_in_tool_call(content, self.family))

    def closing_task(self, steps: Sequence[Step]) -> Task | None:
        """The task the last step (a final answer) closes, when a summary should be made."""
        if not self.options.summaries:
            return None
        tasks = tasks_of(steps)
        return tasks[-1] if tasks and tasks[-1].closed else None

    def summarize(
        self, engine: Engine, task: Task, system_prompt: str, adapters: Sequence[AdapterHandle]
    ) -> SummaryHop:
        return run_summary_hop(
            engine, self.profile, task, system_prompt, adapters, max_tokens=self.options.summary_max_tokens
        )
