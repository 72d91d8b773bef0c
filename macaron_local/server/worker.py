"""The one thread that owns the session: every turn of every client runs here, in order.

The engine generates one reply at a time and the session keeps one open conversation, so the
server does not share them between threads: each request becomes a `TurnRequest` handed to a
single-thread executor. A turn opens (or starts) its conversation, records the history the
client sent that the store does not have yet, and streams the reply through `Session.send`,
which routes it, applies the deployed adapters and records it. Feedback runs on a second,
engine-less session of its own, so a correction never waits behind a long generation.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from macaron_local.errors import InvalidInputError
from macaron_local.router import Route
from macaron_local.session import Session
from macaron_local.tools.spec import ToolSpec as OfferedTool

T = TypeVar("T")


class NotFoundError(Exception):
    """A conversation or message id the store does not have (answered with 404)."""


@dataclass
class TurnRequest:
    """One chat request, reduced to what the session needs."""

    conversation_id: str | None
    messages: list[tuple[str, str]]  # (role, text) of the client's conversation, system excluded
    system_prompt: str | None  # None: the conversation's own (or the default for a new one)
    tools: list[OfferedTool]  # what the request offers the model (run by the client, not here)
    tool_choice: str  # auto | required | none | a tool's name
    expert: str | None
    overrides: dict[str, Any]  # GenerationParams fields the request set
    max_tokens_cap: int
    cancel: threading.Event = field(default_factory=threading.Event)


@dataclass
class TurnResult:
    conversation_id: str
    message_id: str | None
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    expert: str


def new_messages(stored: list[tuple[str, str]], sent: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """What the client sent that the stored branch does not have. A client may send the whole
    conversation (as OpenAI clients do) or only the new messages: the sent list is taken as
    the whole conversation when it is longer than the stored branch and its roles match it."""
    if len(sent) > len(stored) and [r for r, _ in sent[: len(stored)]] == [r for r, _ in stored]:
        return sent[len(stored) :]
    return sent


def _route_of_last_reply(session: Session) -> Route | None:
    """How the branch's last reply was routed (a reopened conversation does not remember it)."""
    if session.conversation_id is None or session.leaf_id is None:
        return None
    turns = {t.message_id: t for t in session.store.get_conversation(session.conversation_id).turns}
    for message in reversed(session.store.path(session.leaf_id)):
        if message.role == "assistant" and message.id in turns:
            turn = turns[message.id]
            return Route(turn.expert or "L0", turn.route_method or "default", turn.route_reason or "")
    return None


class SessionWorker:
    def __init__(self, make_session: Callable[[], Session]) -> None:
        self._make_session = make_session
        self._turns = ThreadPoolExecutor(1, thread_name_prefix="macaron-turns")
        self._feedback = ThreadPoolExecutor(1, thread_name_prefix="macaron-feedback")
        self._session: Session | None = None
        self._feedback_session: Session | None = None

    @property
    def session(self) -> Session:
        """The turn session; only touched from the turn thread."""
        if self._session is None:
            self._session = self._make_session()
        return self._session

    async def call(self, fn: Callable[[Session], T]) -> T:
        """Run `fn(session)` on the turn thread."""
        return await asyncio.get_running_loop().run_in_executor(self._turns, lambda: fn(self.session))

    async def feedback(self, fn: Callable[[Session], T]) -> T:
        """Run `fn(session)` on the feedback thread's own session (it never loads the model)."""

        def run() -> T:
            if self._feedback_session is None:
                self._feedback_session = self._make_session()
            return fn(self._feedback_session)

        return await asyncio.get_running_loop().run_in_executor(self._feedback, run)

    def submit_turn(
        self,
        request: TurnRequest,
        emit: Callable[[str, Any], None],
        finished: Callable[[], None],
    ) -> None:
        """Queue `request`; `emit` (called on the turn thread) gets ("started", conversation id),
        then ("piece", text) for each piece, then ("done", TurnResult) or ("error", exception).
        `finished` runs last, whatever happened."""

        def job() -> None:
            try:
                if request.cancel.is_set():
                    emit("error", ConnectionAbortedError("the client left before its turn began"))
                    return
                emit("done", self._turn(request, emit))
            except Exception as exc:  # handed to the request; the worker keeps serving
                emit("error", exc)
            finally:
                finished()

        self._turns.submit(job)

    def _turn(self, request: TurnRequest, emit: Callable[[str, Any], None]) -> TurnResult:
        session = self.session
        if request.conversation_id:
            try:
                session.open_conversation(request.conversation_id)
            except InvalidInputError:
                raise NotFoundError(f"no conversation with id {request.conversation_id}") from None
            default = session.store.get_conversation(request.conversation_id).system_prompt
        else:
            session.new_conversation()
            default = str(session.settings.get("system_prompt"))
        system = default if request.system_prompt is None else request.system_prompt
        session.system_prompt = system
        params = replace(session.default_params(), **request.overrides)
        params.max_tokens = min(params.max_tokens, request.max_tokens_cap)
        stored = [(m["role"], m["content"]) for m in session.messages]
        fresh = new_messages(stored, request.messages)
        if not fresh:
            raise InvalidInputError("messages holds nothing to answer (only system messages)")
        *history, (role, text) = fresh
        if role not in ("user", "tool"):
            raise InvalidInputError("the last message must be from the user or a tool")
        session.add_history([{"role": r, "content": t} for r, t in history])
        if role == "tool" and request.conversation_id and not history:
            session.last_route = _route_of_last_reply(session)  # the result goes back to the caller
        reply = session.send(
            text,
            role=role,
            expert=request.expert,
            params=params,
            cancel=request.cancel,
            tools=request.tools,
            tool_choice=request.tool_choice,
        )
        emit("started", reply.conversation_id)
        for piece in reply:
            emit("piece", piece)
        done = reply.completion
        return TurnResult(
            conversation_id=reply.conversation_id,
            message_id=reply.message_id,
            text=done.text,
            prompt_tokens=done.prompt_tokens,
            completion_tokens=len(done.tokens),
            finish_reason=done.finish_reason or "cancelled",
            expert=reply.route.slot,
        )

    def close(self) -> None:
        self._turns.submit(lambda: self._session.close() if self._session else None).result()
        self._feedback.submit(lambda: self._feedback_session.close() if self._feedback_session else None).result()
        self._turns.shutdown()
        self._feedback.shutdown()
