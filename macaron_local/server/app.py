"""The Starlette app: `/v1/chat/completions` (JSON or SSE, tools), `/v1/models`, `/v1/feedback`.

Every request is checked in this order, so a refused one costs nothing and records nothing:
the bearer token (off loopback), the body size, the JSON shape, the model name, then a place
in the generation queue. Errors are the OpenAI error object with a one-line message.

Conversations continue by id: each response carries `conversation_id` (a body field, and the
`X-Macaron-Conversation-Id` header on the response); a request that sends it back, as the
`conversation_id` field or that header, continues that conversation. The stored reply's id is
`message_id` (in the JSON response, and in the final chunk of a stream); `/v1/feedback` takes
it, or the `chatcmpl-...` id of a response from this server process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from macaron_local.catalog import SLOTS
from macaron_local.errors import InvalidInputError, MacaronError
from macaron_local.protocol.features import family_for
from macaron_local.protocol.options import protocol_options
from macaron_local.server.auth import authorized
from macaron_local.server.limits import Admission, BusyError, Limits, TooLargeError, read_body
from macaron_local.server.schemas import BadRequestError, ChatCompletionRequest, FeedbackRequest, parse
from macaron_local.server.tools import ParsedCall, history_text, offered_tool, parse_tool_calls, streamable
from macaron_local.server.worker import NotFoundError, SessionWorker, TurnRequest, TurnResult
from macaron_local.session import Session

log = logging.getLogger("macaron.serve")
CONVERSATION_HEADER = "x-macaron-conversation-id"
EXPERT_HEADER = "x-macaron-expert"


class UnauthorizedError(Exception):
    pass


def error_response(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> JSONResponse:
    message = " ".join(message.split())
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def response_for(exc: BaseException) -> JSONResponse:
    """The status and one-line error for anything a request can fail with."""
    if isinstance(exc, UnauthorizedError):
        return error_response(401, str(exc), "authentication_error", {"WWW-Authenticate": "Bearer"})
    if isinstance(exc, TooLargeError):
        return error_response(413, str(exc), "invalid_request_error")
    if isinstance(exc, BusyError):
        return error_response(429, str(exc), "rate_limit_error", {"Retry-After": "1"})
    if isinstance(exc, NotFoundError):
        return error_response(404, str(exc), "not_found_error")
    if isinstance(exc, BadRequestError | InvalidInputError):
        return error_response(400, str(exc), "invalid_request_error")
    if isinstance(exc, ConnectionAbortedError):
        return error_response(400, str(exc), "invalid_request_error")  # nobody is left to read it
    if isinstance(exc, MacaronError):
        return error_response(500, str(exc), "server_error")
    log.exception("request failed", exc_info=exc)
    return error_response(500, f"internal error ({type(exc).__name__}); see the server's log", "server_error")


class ChatAPI:
    """The routes, over one `SessionWorker`."""

    def __init__(self, worker: SessionWorker, limits: Limits, token: str | None) -> None:
        self.worker = worker
        self.limits = limits
        self.token = token
        self.admission = Admission(limits.queue)
        self._replies: OrderedDict[str, str] = OrderedDict()  # completion id -> stored message id
        self._model_ids: list[str] | None = None
        self._family = "hermes"  # the model's tool-call markup, read with its manifest

    # ----------------------------------------------------------------- helpers
    def guard(self, request: Request) -> None:
        if not authorized(request.headers.get("authorization"), self.token):
            raise UnauthorizedError("a valid API token is required: send `Authorization: Bearer <token>`")

    async def model_ids(self) -> list[str]:
        """The model, then one id per expert it has (which forces that expert, as vLLM names them)."""
        if self._model_ids is None:
            manifest = await self.worker.feedback(lambda s: s.manifest)
            self._model_ids = [manifest.name, *[slot for slot in SLOTS if slot in manifest.experts]]
            self._family = family_for(manifest.architecture, protocol_options(manifest).family)
        return self._model_ids

    def remember(self, completion_id: str, message_id: str | None) -> None:
        if message_id is not None:
            self._replies[completion_id] = message_id
            while len(self._replies) > 10_000:
                self._replies.popitem(last=False)

    # ----------------------------------------------------------------- routes
    async def models(self, request: Request) -> Response:
        try:
            self.guard(request)
            ids = await self.model_ids()
        except Exception as exc:
            return response_for(exc)
        created = int(time.time())
        data = [{"id": i, "object": "model", "created": created, "owned_by": "macaron-local"} for i in ids]
        return JSONResponse({"object": "list", "data": data})

    async def feedback(self, request: Request) -> Response:
        try:
            self.guard(request)
            body = parse(FeedbackRequest, await read_body(request, self.limits.max_body_bytes))
            if body.correction is None and body.rating is None:
                raise BadRequestError("give a correction, a rating (1 or -1), or both")
            message_id = self._replies.get(body.message_id, body.message_id)
            ids = await self.worker.feedback(lambda s: _record_feedback(s, message_id, body))
        except Exception as exc:
            return response_for(exc)
        return JSONResponse({"message_id": message_id, "feedback_ids": ids})

    async def chat(self, request: Request) -> Response:
        try:
            self.guard(request)
            body = parse(ChatCompletionRequest, await read_body(request, self.limits.max_body_bytes))
            turn, known_tools = self.turn_request(request, body, await self.model_ids())
            self.admission.enter()
        except Exception as exc:
            return response_for(exc)
        events: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self.worker.submit_turn(
            turn,
            lambda kind, value: loop.call_soon_threadsafe(events.put_nowait, (kind, value)),
            self.admission.leave,
        )
        try:
            kind, value = await self.first_event(request, events, turn.cancel)
        except asyncio.CancelledError:
            turn.cancel.set()
            raise
        if kind == "error":
            return response_for(value)
        completion_id = f"chatcmpl-{uuid.uuid4().hex}"
        model = body.model or (await self.model_ids())[0]
        reply = ResponseBuilder(completion_id, model, value, known_tools, self._family)
        headers = {"X-Macaron-Conversation-Id": value}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = self.stream(reply, events, turn.cancel, include_usage)
            return StreamingResponse(stream, media_type="text/event-stream", headers=headers)
        try:
            result = await reply.collect(events)
        except asyncio.CancelledError:
            turn.cancel.set()
            raise
        except Exception as exc:
            return response_for(exc)
        self.remember(completion_id, result.message_id)
        return JSONResponse(reply.whole(result), headers={**headers, "X-Macaron-Message-Id": result.message_id or ""})

    @staticmethod
    async def first_event(request: Request, events: asyncio.Queue, cancel: threading.Event) -> tuple[str, Any]:
        """Wait while the turn is queued (its errors keep their HTTP status); a client that
        leaves meanwhile gives up its place, so the worker never answers nobody."""
        waiting = asyncio.ensure_future(events.get())
        while True:
            done, _ = await asyncio.wait({waiting}, timeout=0.25)
            if done:
                return waiting.result()
            if not cancel.is_set() and await request.is_disconnected():
                cancel.set()  # the worker skips the turn, or stops it at its next token

    def turn_request(
        self, request: Request, body: ChatCompletionRequest, model_ids: list[str]
    ) -> tuple[TurnRequest, set[str]]:
        if body.model and body.model not in model_ids:
            raise NotFoundError(f"no model {body.model!r} here; available: {', '.join(model_ids)}")
        expert = body.expert or request.headers.get(EXPERT_HEADER) or (body.model if body.model in SLOTS else None)
        system, conversation = [], []
        for message in body.messages:
            if message.role in ("system", "developer"):
                system.append(message.text())
            else:
                text = history_text(message) if message.role == "assistant" else message.text()
                conversation.append((message.role, text))
        tools = body.tools or []
        choice = body.tool_choice or "auto"
        if isinstance(choice, dict):  # {"type": "function", "function": {"name": ...}}
            choice = str((choice.get("function") or {}).get("name") or "auto")
        overrides: dict[str, Any] = {}
        if body.max_completion_tokens or body.max_tokens:
            overrides["max_tokens"] = body.max_completion_tokens or body.max_tokens
        for name in ("temperature", "top_p", "seed"):
            if getattr(body, name) is not None:
                overrides[name] = getattr(body, name)
        turn = TurnRequest(
            conversation_id=body.conversation_id or request.headers.get(CONVERSATION_HEADER),
            messages=conversation,
            system_prompt="\n\n".join(system) if system else None,
            tools=[offered_tool(t) for t in tools],
            tool_choice=choice,
            expert=expert,
            overrides=overrides,
            max_tokens_cap=self.limits.max_tokens,
        )
        return turn, {t.function.name for t in tools} if choice != "none" else set()

    async def stream(
        self, reply: ResponseBuilder, events: asyncio.Queue, cancel: threading.Event, include_usage: bool
    ) -> AsyncIterator[str]:
        """SSE chunks; a client that leaves mid-stream cancels the generation (what was said is
        stored, marked cancelled)."""
        try:
            yield reply.sse(reply.chunk({"role": "assistant", "content": ""}))
            held = ""  # text that is, or may turn out to be, a tool call
            backlog: list[tuple[str, Any]] = []
            while True:
                kind, value = backlog.pop() if backlog else await events.get()
                if kind == "piece":
                    held += value
                    # Pieces that arrived while the last chunk was written go out in one chunk:
                    # on a busy machine the stream keeps up with llama.cpp instead of falling behind.
                    while not events.empty():
                        following = events.get_nowait()
                        if following[0] != "piece":
                            backlog.append(following)
                            break
                        held += following[1]
                    ready = streamable(held) if reply.tools else len(held)
                    if ready:
                        text, held = held[:ready], held[ready:]
                        yield reply.sse(reply.chunk({"content": text}))
                elif kind == "done":
                    result: TurnResult = value
                    self.remember(reply.id, result.message_id)
                    for chunk in reply.closing(result, held):
                        yield reply.sse(chunk)
                    if include_usage:
                        yield reply.sse({**reply.chunk(None), "choices": [], "usage": reply.usage(result)})
                    yield "data: [DONE]\n\n"
                    return
                else:  # the turn failed after it started: say so in the stream
                    yield reply.sse(json.loads(response_for(value).body))
                    return
        finally:
            cancel.set()  # a no-op once the turn is done; stops it when the client has gone


def _record_feedback(session: Session, message_id: str, body: FeedbackRequest) -> list[int]:
    ids = []
    try:
        if body.correction is not None:
            ids.append(session.correct(message_id, body.correction))
        if body.rating is not None:
            ids.append(session.rate(message_id, body.rating, body.comment))
    except InvalidInputError as exc:
        if str(exc).startswith("no message"):
            raise NotFoundError(str(exc)) from None
        raise
    return ids


class ResponseBuilder:
    """Builds one response's JSON objects (whole, or as stream chunks)."""

    def __init__(
        self, completion_id: str, model: str, conversation_id: str, tools: set[str], family: str = "hermes"
    ) -> None:
        self.id = completion_id
        self.model = model
        self.conversation_id = conversation_id
        self.tools = tools
        self.family = family
        self.created = int(time.time())
        self.pieces: list[str] = []

    async def collect(self, events: asyncio.Queue) -> TurnResult:
        while True:
            kind, value = await events.get()
            if kind == "done":
                return value
            if kind == "error":
                raise value

    def split(self, text: str) -> tuple[str, list[ParsedCall]]:
        return parse_tool_calls(text, self.tools, self.family) if self.tools else (text, [])

    def whole(self, result: TurnResult) -> dict[str, Any]:
        content, calls = self.split(result.text)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = [_call_json(c) for c in calls]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "message": message, "finish_reason": _finish(result, calls)}],
            "usage": self.usage(result),
            "conversation_id": result.conversation_id,
            "message_id": result.message_id,
            "expert": result.expert,
        }

    def closing(self, result: TurnResult, held: str) -> list[dict[str, Any]]:
        """The last chunks: text held back (or the tool calls it was), then the finish reason."""
        chunks = []
        content, calls = self.split(held) if held else ("", [])
        if calls:
            deltas = [{"index": i, **_call_json(c)} for i, c in enumerate(calls)]
            chunks.append(self.chunk({"content": content or None, "tool_calls": deltas}))
        elif held:
            chunks.append(self.chunk({"content": held}))
        final = self.chunk({}, _finish(result, calls))
        final.update(message_id=result.message_id, expert=result.expert)
        chunks.append(final)
        return chunks

    def chunk(self, delta: dict[str, Any] | None, finish_reason: str | None = None) -> dict[str, Any]:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish_reason}]
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "conversation_id": self.conversation_id,
        }

    @staticmethod
    def usage(result: TurnResult) -> dict[str, int]:
        total = result.prompt_tokens + result.completion_tokens
        return {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": total,
        }

    @staticmethod
    def sse(data: dict[str, Any]) -> str:
        return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _call_json(call: ParsedCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _finish(result: TurnResult, calls: list[ParsedCall]) -> str:
    if calls:
        return "tool_calls"
    return "length" if result.finish_reason == "length" else "stop"


def create_app(make_session: Callable[[], Session], *, limits: Limits | None = None, token: str | None = None):
    """The ASGI app. `token`: the bearer token every request must carry (None on loopback)."""
    worker = SessionWorker(make_session)
    api = ChatAPI(worker, limits or Limits(), token)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(exc.status_code, message, "invalid_request_error")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await asyncio.get_running_loop().run_in_executor(None, worker.close)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", api.chat, methods=["POST"]),
            Route("/v1/models", api.models, methods=["GET"]),
            Route("/v1/feedback", api.feedback, methods=["POST"]),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.api = api
    return app
