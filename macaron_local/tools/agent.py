"""The agent loop: a request, the expert's tool calls, the user's approval, the tools' results
back to the same expert, until it answers in text or reaches the step limit.

Each call is recorded on the turn of the reply that made it (tool, arguments, how it was
approved, status, time, and the id of the tool message holding its result), so the whole
trajectory lives in the conversation tree, is exported with it, and reaches the nightly run.

Experience teaches: a call the user denied, or one that failed, is rated -1 on the reply that
made it (the comment says why); a call the user approved that ran is rated +1. These are
ratings like the user's own, so the nightly run pushes away from calls the user turns down.
The tool's result is a `tool` message: context for the episodes, never trained as the model's
own output.
A call the sandbox refuses is refused before the user is asked; a denied call runs nothing
and the model is told so as the tool's result.
A request that is stopped (the user pressed Esc or left) runs no further call and is not
rated: a call turned down because the user left says nothing about the call.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from macaron_local.engine import GenerationParams
from macaron_local.protocol.features import ToolCall, parse_tool_calls
from macaron_local.tools.approval import Approvals, request_for
from macaron_local.tools.config import ToolsConfig
from macaron_local.tools.spec import ToolOutcome, ToolRefused, ToolSpec


@dataclass(frozen=True)
class ToolStep:
    """One call of a trajectory, as stored on its turn."""

    name: str
    arguments: dict[str, Any]
    approval: str  # read-only | always | approved | edited | denied | no one to ask | refused
    status: str  # ok | error | refused | denied | timeout
    result: str
    ms: float
    call_message_id: str
    result_message_id: str = ""

    def record(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "arguments": self.arguments,
            "approval": self.approval,
            "status": self.status,
            "ms": round(self.ms, 3),
            "result_message_id": self.result_message_id,
        }


@dataclass
class AgentTurn:
    reply: Any  # the session's Reply that ended the request (text, or the last call at the limit)
    steps: list[ToolStep] = field(default_factory=list)
    stopped_at_limit: bool = False
    cancelled: bool = False


def experience(steps: Sequence[ToolStep]) -> tuple[int, str] | None:
    """The rating one reply's calls earned: -1 when any was denied or failed, +1 when the user
    approved them and they ran, none for read-only calls nobody was asked about."""
    bad = [s for s in steps if s.status != "ok"]
    if bad:
        return -1, f"tool call {bad[0].name} {bad[0].status}: {bad[0].result[:120]}"
    if any(s.approval in ("approved", "always", "edited") for s in steps):
        return 1, f"tool call {steps[0].name} approved by the user"
    return None


def one_line(text: str) -> str:
    return " ".join(str(text).split()) or "failed"


class Agent:
    """Runs requests through a session with a set of tools and the user's approvals."""

    def __init__(
        self,
        session,
        tools: Sequence[ToolSpec],
        approvals: Approvals,
        config: ToolsConfig,
        on_step: Callable[[ToolStep], None] | None = None,
    ) -> None:
        self.session, self.tools, self.approvals, self.config = session, list(tools), approvals, config
        self.by_name = {t.name: t for t in self.tools}
        self.on_step = on_step

    def run(
        self,
        text: str,
        *,
        expert: str | None = None,
        params: GenerationParams | None = None,
        tool_choice: str = "auto",
        after_result: str = "auto",
        role: str = "user",
        cancel: threading.Event | None = None,
    ):
        """Answer `text`, running the tools it calls; returns an AgentTurn. Once `cancel` is set
        the reply being written stops, no further call runs and nothing is rated."""
        session = self.session
        stopped = cancel.is_set if cancel is not None else lambda: False
        reply = session.send(
            text, expert=expert, params=params, tools=self.tools, tool_choice=tool_choice, role=role, cancel=cancel
        )
        reply.wait()
        steps: list[ToolStep] = []
        for step_number in range(self.config.max_steps):
            calls = [] if stopped() else self.calls_in(reply)
            if not calls:
                break
            done = [self.execute(call, reply.message_id) for call in calls]
            judged = not stopped()  # a call denied because the user left was not judged
            for index, step in enumerate(done[:-1]):
                session.add_history([{"role": "tool", "content": step.result}])
                done[index] = replace(step, result_message_id=session.leaf_id)
            choice = "none" if step_number + 1 == self.config.max_steps else after_result
            reply = session.send(
                done[-1].result, role="tool", params=params, tools=self.tools, tool_choice=choice, cancel=cancel
            )
            reply.wait()
            done[-1] = replace(done[-1], result_message_id=reply.user_message_id)
            session.record_tool_calls(done[0].call_message_id, [s.record() for s in done])
            signal = experience(done)
            if signal is not None and judged:
                session.rate(done[0].call_message_id, *signal)
            steps += done
        cancelled = stopped()
        at_limit = not cancelled and bool(self.calls_in(reply))  # calls left only when max_steps ran out
        return AgentTurn(reply, steps, stopped_at_limit=at_limit, cancelled=cancelled)

    def calls_in(self, reply) -> list[ToolCall]:
        protocol = self.session.protocol
        if not protocol.split(reply.content).tool_call:
            return []
        return parse_tool_calls(reply.content, protocol.family)

    def execute(self, call: ToolCall, call_message_id: str) -> ToolStep:
        started = time.perf_counter()
        approval, outcome, arguments = self._run(call, call_message_id)
        step = ToolStep(
            call.name,
            dict(arguments),
            approval,
            outcome.status,
            outcome.text,
            (time.perf_counter() - started) * 1000,
            call_message_id,
        )
        if self.on_step is not None:
            self.on_step(step)
        return step

    def _run(self, call: ToolCall, call_message_id: str) -> tuple[str, ToolOutcome, dict[str, Any]]:
        """(how it was approved, what it gave, the arguments it ran with)."""
        arguments = dict(call.arguments)
        tool = self.by_name.get(call.name)
        if tool is None:
            return "refused", ToolOutcome("refused", f"no tool is named {call.name!r}"), arguments
        refused = self._refusal(tool, arguments)
        if refused is not None:
            return "refused", refused, arguments
        workdir = self.config.write_folders[0] if self.config.write_folders else None
        decision = self.approvals.decide(request_for(tool, arguments, workdir))
        if not decision.approved:
            why = "the user denied it" if decision.how == "denied" else "nobody was there to approve it"
            return decision.how, ToolOutcome("denied", f"{call.name} was not run: {why}."), arguments
        if decision.arguments is not None:  # the user corrected the call: learned like any correction
            arguments = decision.arguments
            if self.session is not None:
                self.session.correct(call_message_id, call_markup(call.name, arguments, self.session.protocol.family))
            refused = self._refusal(tool, arguments)
            if refused is not None:
                return decision.how, refused, arguments
        assert tool.run is not None
        try:
            return decision.how, ToolOutcome("ok", tool.run(arguments)), arguments
        except ToolRefused as exc:
            return decision.how, ToolOutcome("refused", f"refused: {one_line(exc)}"), arguments
        except TimeoutError as exc:
            return decision.how, ToolOutcome("timeout", one_line(exc)), arguments
        except Exception as exc:  # a tool's own failure goes back to the model as its result
            return decision.how, ToolOutcome("error", f"{call.name} failed: {one_line(exc)}"), arguments

    @staticmethod
    def _refusal(tool: ToolSpec, arguments: dict[str, Any]) -> ToolOutcome | None:
        try:
            if tool.check is not None:
                tool.check(arguments)
        except ToolRefused as exc:
            return ToolOutcome("refused", f"refused: {one_line(exc)}")
        return None


def call_markup(name: str, arguments: dict[str, Any], family: str) -> str:
    """A call as the model family writes it (what a corrected call teaches)."""
    if family == "qwen3_coder":
        parameters = "".join(
            f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
            for key, value in arguments.items()
        )
        return f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"
