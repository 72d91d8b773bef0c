"""`macaron serve` as clients use it: a real server process on 127.0.0.1, the official `openai`
client, Simon Willison's `llm`, and raw HTTP for the bad input clients should never send.

One server (the embedded SmolLM2-135M, queue 6) serves the module; each test reads the store
file the server writes, as `macaron logs` and `macaron learn` do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from conftest import run_cli
from serving import Server, sse_events, start_server

from macaron_local.settings import Settings
from macaron_local.store import open_default_store

pytestmark = pytest.mark.slow

QUEUE = 6
CALL = "<tool_call>{}</tool_call>"  # a call as the model writes it (a client may echo it as text)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("serve-home")
    server = start_server(root, "--queue", str(QUEUE), "--max-tokens", "64")
    yield server, root
    stderr = server.stop()
    assert server.process.returncode == 0 and "Traceback" not in stderr, stderr  # Ctrl-C is a clean stop


@pytest.fixture
def client(served) -> openai.OpenAI:
    server, _ = served
    return openai.OpenAI(base_url=server.base_url, api_key="unused-on-loopback", max_retries=0)


def store_of(root: Path):
    os.environ["MACARON_HOME"] = str(root)
    try:
        return open_default_store(Settings.load())
    finally:
        del os.environ["MACARON_HOME"]


def conversation_count(root: Path) -> int:
    with store_of(root) as store:
        return len(store.list_conversations(limit=10_000))


def test_openai_client_streams_a_chat_and_the_turn_is_in_the_logs(served, client) -> None:
    server, root = served
    assert [m.id for m in client.models.list()][0] == "embedded"
    stream = client.chat.completions.create(
        model="embedded",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    extra = final.model_extra or {}
    assert text.strip() and final.choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    listed = run_cli("logs", "list", "--json", home=root)
    assert extra["conversation_id"] in [row["id"] for row in json.loads(listed.stdout)]
    with store_of(root) as store:
        conversation = store.get_conversation(extra["conversation_id"])
    reply = next(m for m in conversation.messages if m.id == extra["message_id"])
    assert reply.content == text and conversation.turns[0].expert == extra["expert"]


def test_a_conversation_continues_by_id_in_the_body_or_a_header(served, client) -> None:
    _, root = served
    first = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], model="embedded", max_tokens=6)
    cid = first.model_extra["conversation_id"]
    second = client.chat.completions.create(
        model="embedded",
        messages=[{"role": "user", "content": "And again?"}],  # only the new message
        max_tokens=6,
        extra_body={"conversation_id": cid},
    )
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And again?"},
        {"role": "assistant", "content": second.choices[0].message.content},
        {"role": "user", "content": "Once more."},
    ]
    third = client.chat.completions.create(
        model="embedded", messages=history, max_tokens=6, extra_headers={"X-Macaron-Conversation-Id": cid}
    )
    assert second.model_extra["conversation_id"] == third.model_extra["conversation_id"] == cid
    with store_of(root) as store:
        branch = store.path(store.get_conversation(cid).current_leaf_id)
    assert [m.role for m in branch] == ["user", "assistant"] * 3
    assert [m.content for m in branch if m.role == "user"] == ["Hi", "And again?", "Once more."]


def test_unknown_conversation_is_404(served, client) -> None:
    with pytest.raises(openai.NotFoundError, match="no conversation"):
        client.chat.completions.create(
            model="embedded", messages=[{"role": "user", "content": "x"}], extra_body={"conversation_id": "nope"}
        )


def test_tool_round_trip(served, client) -> None:
    """The model (prompted with earlier calls, as an agent's history holds them) calls the
    tool; the client runs it and sends the result back; the model answers from it."""
    _, root = served
    messages: list[dict] = []
    for n, city in enumerate(("Rome", "Oslo", "Lima")):
        function = {"name": "get_weather", "arguments": json.dumps({"city": city})}
        call = {"id": f"call_{n}", "type": "function", "function": function}
        messages += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ]
    messages.append({"role": "user", "content": "What is the weather in Paris?"})
    bare = client.chat.completions.create(model="embedded", messages=messages, max_tokens=1)
    first = client.chat.completions.create(model="embedded", messages=messages, tools=[WEATHER], max_tokens=40)
    # The tools reached the model's prompt (the session offers them; the stored system prompt is the user's).
    assert first.usage.prompt_tokens > bare.usage.prompt_tokens + 20
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 18, "sky": "sunny"})},
    ]
    cid = first.model_extra["conversation_id"]
    second = client.chat.completions.create(
        model="embedded", messages=messages, tools=[WEATHER], max_tokens=24, extra_body={"conversation_id": cid}
    )
    assert second.model_extra["conversation_id"] == cid
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with store_of(root) as store:
        conversation = store.get_conversation(cid)
        branch = store.path(conversation.current_leaf_id)
    assert [m.role for m in branch[-3:]] == ["assistant", "tool", "assistant"]
    assert '"name": "get_weather"' in branch[-3].content and "sunny" in branch[-2].content
    assert "get_weather" not in conversation.system_prompt  # offered per request, not stored as the prompt
    assert len(conversation.turns) == 2  # two replies generated; the few-shot history was recorded, not answered
    call_turn, answer_turn = sorted(conversation.turns, key=lambda t: t.created_at)
    assert answer_turn.route_method == "pending" and answer_turn.expert == call_turn.expert  # back to the caller


def test_tool_calls_stream_as_tool_call_deltas(served, client) -> None:
    messages: list[dict] = []
    for city in ("Rome", "Oslo", "Lima"):
        messages += [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {
                "role": "assistant",
                "content": CALL.format(json.dumps({"name": "get_weather", "arguments": {"city": city}})),
            },
        ]
    messages.append({"role": "user", "content": "What is the weather in Tokyo?"})
    chunks = list(
        client.chat.completions.create(model="embedded", messages=messages, tools=[WEATHER], max_tokens=40, stream=True)
    )
    calls = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [json.loads(tc.function.arguments) for tc in calls] == [{"city": "Tokyo"}]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_correction_sent_as_feedback_is_an_episode_for_learning(served, client) -> None:
    server, root = served
    reply = client.chat.completions.create(
        model="embedded", messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=8
    )
    status, _, body = server.request(
        "POST", "/v1/feedback", {"message_id": reply.id, "correction": "Two plus two is four, always.", "rating": -1}
    )
    assert status == 200 and body["message_id"] == reply.model_extra["message_id"] and len(body["feedback_ids"]) == 2
    done = run_cli("learn", "--dry-run", "--json", home=root)
    assert done.returncode == 0, done.stderr
    episodes = [e for e in json.loads(done.stdout) if e["chosen"] == "Two plus two is four, always."]
    assert episodes and episodes[0]["rejected"] == reply.choices[0].message.content
    assert episodes[0]["prompt"] == "What is 2+2?"
    status, _, body = server.request("POST", "/v1/feedback", {"message_id": "missing", "rating": 1})
    assert status == 404 and "no message" in body["error"]["message"]
    status, _, body = server.request("POST", "/v1/feedback", {"message_id": reply.id, "rating": 5})
    assert status == 400 and body["error"]["message"].startswith("rating")


def test_llm_with_an_openai_compatible_model_answers_a_prompt(served, tmp_path) -> None:
    server, root = served
    (tmp_path / "extra-openai-models.yaml").write_text(
        f'- model_id: macaron-test\n  model_name: embedded\n  api_base: "{server.base_url}"\n'
    )
    before = conversation_count(root)
    env = {**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "unused-on-loopback"}
    done = subprocess.run(
        [sys.executable, "-m", "llm", "-m", "macaron-test", "Say hello in one word."],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()
    assert conversation_count(root) == before + 1


def one_line_error(status: int, body: dict, expected: int, needle: str) -> None:
    assert status == expected, body
    message = body["error"]["message"]
    assert "\n" not in message and needle in message, message


def test_bad_input_gets_its_status_and_one_line_and_records_nothing(served) -> None:
    server, root = served
    before = conversation_count(root)
    chat = "/v1/chat/completions"
    status, _, body = server.request("POST", chat, b'{"messages": [')
    one_line_error(status, body, 400, "not valid JSON")
    status, _, body = server.request("POST", chat, {"messages": "hello"})
    one_line_error(status, body, 400, "messages")
    status, _, body = server.request("POST", chat, {"messages": [{"role": "user", "content": 5}]})
    one_line_error(status, body, 400, "messages.0.content")
    status, _, body = server.request(
        "POST", chat, {"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}
    )
    one_line_error(status, body, 400, "max_tokens")
    status, _, body = server.request("POST", chat, b"[1, 2]")
    one_line_error(status, body, 400, "JSON object")
    status, _, body = server.request("POST", chat, {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]})
    one_line_error(status, body, 404, "no model 'gpt-4'")
    status, _, body = server.request("POST", chat, {"messages": [{"role": "assistant", "content": "x"}]})
    one_line_error(status, body, 400, "last message")
    huge = json.dumps({"messages": [{"role": "user", "content": "x" * (20 * 1024 * 1024)}]}).encode()
    status, _, body = server.request("POST", chat, huge)
    one_line_error(status, body, 413, "limit")
    status, _, body = server.request("GET", "/v1/nothing-here")
    one_line_error(status, body, 404, "/v1/nothing-here")
    status, _, body = server.request("GET", "/v1/chat/completions")
    one_line_error(status, body, 405, "GET")
    assert conversation_count(root) == before  # none of them reached the store


def test_fifty_concurrent_requests_queue_then_429_and_every_accepted_one_is_recorded_once(served) -> None:
    server, root = served
    before = conversation_count(root)
    results: list[tuple[int, dict]] = []
    lock = threading.Lock()
    start = threading.Barrier(50)

    def one(n: int) -> None:
        start.wait()
        status, headers, body = server.request(
            "POST",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": f"Say the number {n}."}], "max_tokens": 3},
            timeout=600,  # the last of the queue waits for all before it, on a busy machine too
        )
        with lock:
            results.append((status, body))

    threads = [threading.Thread(target=one, args=(n,)) for n in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(900)
    assert len(results) == 50  # every request got an answer: nothing hung or was dropped
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    accepted = [b for s, b in results if s == 200]
    assert len(accepted) >= 1 + QUEUE and statuses.count(429) >= 1
    for status, body in results:
        if status == 429:
            one_line_error(status, body, 429, "busy")
    ids = {b["conversation_id"] for b in accepted}
    assert len(ids) == len(accepted)
    with store_of(root) as store:
        assert len(store.list_conversations(limit=10_000)) == before + len(accepted)
        for cid in ids:
            conversation = store.get_conversation(cid)
            assert [m.role for m in conversation.messages] == ["user", "assistant"] and len(conversation.turns) == 1


def test_a_client_that_leaves_mid_stream_leaves_a_cancelled_partial_reply(served) -> None:
    server, root = served
    connection = server.connection()
    body = json.dumps(
        {
            "messages": [{"role": "user", "content": "Tell me a long story about a fox."}],
            "max_tokens": 64,
            "stream": True,
            "temperature": 0,
        }
    )
    connection.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    cid = response.getheader("X-Macaron-Conversation-Id")
    events = sse_events(response)
    got = [next(events) for _ in range(4)]
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in got)
    connection.sock.close()  # the client goes away mid-reply
    connection.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with store_of(root) as store:
            turns = store.get_conversation(cid).turns
        if turns:
            break
        time.sleep(0.2)
    assert turns and turns[0].finish_reason == "cancelled"
    with store_of(root) as store:
        reply = store.get_message(turns[0].message_id)
    assert reply.content.startswith(text) and 0 < turns[0].completion_tokens < 64


def test_server_keeps_serving_after_all_that(served, client) -> None:
    reply = client.chat.completions.create(model="embedded", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert reply.choices[0].message.content


# ----------------------------------------------------------------- off loopback: a token
TESTS = str(Path(__file__).parent)


def test_a_non_loopback_bind_needs_a_token_from_the_keyring(tmp_path) -> None:
    """127.0.0.2 stays on this machine but is not 127.0.0.1: the server treats it as exposed."""
    if sys.platform != "linux":
        pytest.skip("127.0.0.2 is routed to loopback by default only on Linux")
    vault = {
        "MACARON_TEST_KEYRING": str(tmp_path / "keyring.json"),
        "PYTHON_KEYRING_BACKEND": "test_auth.JsonFileKeyring",
        "PYTHONPATH": os.pathsep.join([TESTS, *sys.path]),
    }
    home = tmp_path / "home"
    refused = run_cli("serve", "--host", "127.0.0.2", "--port", "0", home=home, **vault)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 1 and len(lines) == 1 and "macaron auth api-token" in lines[0], refused.stderr
    made = run_cli("auth", "api-token", home=home, **vault)
    token = made.stdout.strip()
    assert made.returncode == 0 and token.startswith("mk-") and len(token) > 30
    server: Server = start_server(home, "--host", "127.0.0.2", env=vault)
    try:
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
            status, got, body = server.request("POST", "/v1/chat/completions", chat, headers)
            one_line_error(status, body, 401, "API token")
            assert got.get("www-authenticate") == "Bearer"
        status, _, body = server.request("GET", "/v1/models", headers={"Authorization": "Bearer nope"})
        assert status == 401
        status, _, body = server.request("POST", "/v1/feedback", {"message_id": "x", "rating": 1})
        assert status == 401
        assert conversation_count(home) == 0  # refused requests recorded nothing
        status, _, body = server.request("POST", "/v1/chat/completions", chat, {"Authorization": f"Bearer {token}"})
        assert status == 200 and body["choices"][0]["message"]["content"]
        assert conversation_count(home) == 1
    finally:
        server.stop()
