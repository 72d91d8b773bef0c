"""What a Chat Completions or feedback request may hold, validated with pydantic.

Fields the OpenAI API defines and that change nothing here (`n` > 1 excepted, `logprobs`,
`presence_penalty`, ...) are accepted and ignored so that ordinary clients work unchanged;
fields this server adds are `conversation_id` and `expert`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class BadRequestError(ValueError):
    """A request that does not say what it must: answered with 400 and this one line."""


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        """The message as plain text; only text parts are understood (no images here)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise BadRequestError(f"content parts of type {part.type!r} are not supported; send text")
            parts.append(part.text)
        return "".join(parts)


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionSpec


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = ""
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)
    tools: list[ToolSpec] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # This server's own fields (also accepted as headers, see app.py).
    conversation_id: str | None = None
    expert: str | None = None

    @field_validator("tool_choice")
    @classmethod
    def _known_tool_choice(cls, value: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
        if isinstance(value, str) and value not in ("none", "auto", "required"):
            raise ValueError("must be 'none', 'auto', 'required' or a function")
        return value


class FeedbackRequest(BaseModel):
    """A correction (the reply as it should have been) and/or a rating for a returned reply."""

    model_config = ConfigDict(extra="forbid")
    message_id: str = Field(min_length=1)
    correction: str | None = None
    rating: Literal[-1, 1] | None = None
    comment: str | None = None


def parse(model: type[BaseModel], body: bytes) -> Any:
    """`body` as `model`, or a BadRequestError whose one line names the first wrong field."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequestError(f"the body is not valid JSON ({exc.__class__.__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise BadRequestError("the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise BadRequestError(f"{where}: {first['msg']}{more}") from None
