"""The server's small parts alone: the tool-call format, which messages are new, the token
check, request validation's one-line errors, the admission count."""

from __future__ import annotations

import json

import pytest

from macaron_local.server.auth import authorized, is_loopback
from macaron_local.server.limits import Admission, BusyError
from macaron_local.server.schemas import BadRequestError, ChatCompletionRequest, ChatMessage, parse
from macaron_local.server.tools import call_text, history_text, parse_tool_calls, streamable
from macaron_local.server.worker import new_messages

KNOWN = {"get_weather"}


def test_a_call_block_becomes_a_tool_call_and_leaves_the_rest_as_text() -> None:
    text = 'Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    content, calls = parse_tool_calls(text, KNOWN)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert calls[0].id.startswith("call_")


def test_a_json_list_of_calls_and_an_unclosed_block_are_calls_too() -> None:
    body = json.dumps([{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_weather", "arguments": "{}"}])
    _, calls = parse_tool_calls(f"<tool_call>{body}", KNOWN)  # cut off by max_tokens after the JSON
    assert [json.loads(c.arguments) for c in calls] == [{"city": "A"}, {}]


@pytest.mark.parametrize(
    "text",
    [
        "no call here",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # a tool that was not offered
        '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',  # arguments not an object
        "<tool_call>not json</tool_call>",
    ],
)
def test_what_is_not_a_valid_call_stays_text(text: str) -> None:
    assert parse_tool_calls(text, KNOWN) == (text, [])


def test_history_calls_are_written_as_the_model_writes_them() -> None:
    message = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}],
        }
    )
    assert history_text(message) == call_text("get_weather", {"city": "Oslo"})
    content, calls = parse_tool_calls(history_text(message), KNOWN)
    assert content == "" and calls[0].name == "get_weather"


def test_streaming_holds_back_only_what_is_or_may_become_a_call() -> None:
    assert streamable("Hello") == 5 and streamable("<b>bold</b>") == 11 and streamable("") == 0
    assert streamable("Let me check. <tool") == len("Let me check. ")  # may be a call beginning
    assert streamable('Sure <tool_call>{"name"') == len("Sure ")
    assert streamable("a <") == 2 and streamable("<tool_call>") == 0


def test_new_messages_takes_a_whole_conversation_or_only_the_new_part() -> None:
    stored = [("user", "a"), ("assistant", "b")]
    assert new_messages(stored, [("user", "a"), ("assistant", "b"), ("user", "c")]) == [("user", "c")]
    assert new_messages(stored, [("user", "c")]) == [("user", "c")]
    assert new_messages(stored, [("tool", "r1"), ("tool", "r2"), ("user", "x")]) == [
        ("tool", "r1"),
        ("tool", "r2"),
        ("user", "x"),
    ]
    assert new_messages([], [("user", "a"), ("assistant", "b"), ("user", "c")]) == [
        ("user", "a"),
        ("assistant", "b"),
        ("user", "c"),
    ]


def test_only_the_three_loopback_names_are_exempt_from_the_token() -> None:
    assert all(is_loopback(h) for h in ("127.0.0.1", "::1", "[::1]", "localhost", "LOCALHOST"))
    assert not any(is_loopback(h) for h in ("127.0.0.2", "0.0.0.0", "::", "192.168.1.2", "example.com"))
    assert authorized(None, None) and authorized("Bearer x", None)
    assert authorized("Bearer s3cret", "s3cret")
    assert not any(
        authorized(h, "s3cret") for h in (None, "", "s3cret", "Bearer s3cre", "Basic s3cret", "Bearer s3cretx")
    )


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b'"text"', "JSON object"),
        (b"{}", "messages: Field required"),
        (b'{"messages": []}', "messages: List should have at least 1 item"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages.0.role"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 9}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "n:"),
        (b'{"messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"}', "tool_choice"),
    ],
)
def test_bad_requests_are_one_line_naming_the_field(body: bytes, needle: str) -> None:
    with pytest.raises(BadRequestError) as caught:
        parse(ChatCompletionRequest, body)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_image_parts_are_refused_plainly_and_text_parts_are_joined() -> None:
    ok = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert ok.text() == "ab"
    image = ChatMessage.model_validate({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})
    with pytest.raises(BadRequestError, match="image_url"):
        image.text()


def test_admission_lets_in_one_running_plus_the_queue_then_refuses() -> None:
    gate = Admission(queue=2)
    for _ in range(3):
        gate.enter()
    with pytest.raises(BusyError, match="busy"):
        gate.enter()
    gate.leave()
    gate.enter()
    assert gate.held == 3
