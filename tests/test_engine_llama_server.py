"""The llama-server engine against a real `llama-server`, built from the llama.cpp vendored in
the pinned llama-cpp-python (tests/llama_server_build.py; cached per machine). The in-process
engine is the reference: with the same adapters, greedy tokens must be the same, whether for
one prompt, `macaron ask`, a routed conversation, or a learning pass's rollouts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import tomli_w

from macaron_local.adapters import BaseModelInfo, write_adapter
from macaron_local.engine import Engine, EngineConfig, GenerationParams
from macaron_local.engine.remote.http import EngineUnavailableError
from macaron_local.engine.remote.llama_server import LlamaServerEngine
from macaron_local.errors import AdapterError, InvalidInputError
from macaron_local.learn.episodes import Episode
from macaron_local.learn.loop import LearnConfig, sample_step
from macaron_local.session import Session

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).parent))
from common import embedded_model, random_lora  # noqa: E402
from conftest import run_cli  # noqa: E402
from llama_server_build import binary_path, build  # noqa: E402

pytestmark = pytest.mark.slow
GREEDY = GenerationParams(max_tokens=24, temperature=0.0, min_p=0.0)
PROMPTS = ["Name three colours.", "What is 2+2?", "Write a haiku about the sea.", "Say hello in French."]


@pytest.fixture(scope="module")
def server_binary() -> Path:
    if not binary_path().is_file():
        if not os.environ.get("MACARON_BUILD_LLAMA_SERVER"):
            pytest.skip(
                "no cached llama-server; build it with `python tests/llama_server_build.py` "
                "or set MACARON_BUILD_LLAMA_SERVER=1 (a cold build takes over an hour on 2 cores)"
            )
        build()
    return binary_path()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    info = BaseModelInfo.from_gguf(embedded_model())
    folder = tmp_path_factory.mktemp("adapters")
    return {
        name: write_adapter(folder / f"{name}.gguf", random_lora(info, rank=4, seed=seed, magnitude=0.01))
        for name, seed in (("L0", 7), ("L2", 8), ("extra", 9))
    }


@pytest.fixture(scope="module")
def engines(server_binary):
    config = EngineConfig(model_path=embedded_model(), n_ctx=1024, n_threads=2)
    with Engine(config) as local, LlamaServerEngine(config, binary=str(server_binary)) as remote:
        yield local, remote


def prompt_tokens(engine, text: str) -> list[int]:
    return engine.render_tokens([{"role": "user", "content": text}])


def test_prompts_render_to_the_same_tokens(engines):
    local, remote = engines
    for text in PROMPTS:
        assert remote.render_tokens([{"role": "user", "content": text}]) == prompt_tokens(local, text)
    assert remote.tokenize("model_id=L2", special=False) == local.tokenize("model_id=L2", special=False)
    assert remote.detokenize(local.tokenize("héllo wörld")) == local.detokenize(local.tokenize("héllo wörld"))


def test_greedy_replies_are_the_in_process_engines_with_and_without_adapters(engines, adapters):
    local, remote = engines
    for adapter_set in ([], [adapters["L0"]], [adapters["L0"], adapters["L2"]]):
        local.set_adapters([local.load_adapter(p) for p in adapter_set], view="x")
        remote.set_adapters([remote.load_adapter(p) for p in adapter_set], view="x")
        for text in PROMPTS:
            a = local.generate(prompt_tokens(local, text), GREEDY)
            b = remote.generate(prompt_tokens(local, text), GREEDY)
            assert (b.tokens, b.text, b.finish_reason) == (a.tokens, a.text, a.finish_reason), text
            assert b.stop_token == a.stop_token
    # The adapters change the replies at all (else the comparison above proves nothing).
    local.set_adapters([], view="x")
    bare = local.generate(prompt_tokens(local, PROMPTS[2]), GREEDY).tokens
    local.set_adapters([local.load_adapter(adapters["L0"])], view="x")
    assert local.generate(prompt_tokens(local, PROMPTS[2]), GREEDY).tokens != bare


def test_loaded_but_inactive_adapters_are_not_applied(engines, adapters):
    """llama-server applies --lora-init-without-apply adapters at 1.0 to a request naming none:
    the engine names every adapter, inactive ones at 0.0."""
    local, remote = engines
    remote.load_adapter(adapters["L0"])
    remote.set_adapters([], view="bare")
    local.set_adapters([], view="bare")
    tokens = prompt_tokens(local, PROMPTS[2])
    assert remote.generate(tokens, GREEDY).tokens == local.generate(tokens, GREEDY).tokens


def test_teacher_forced_logprobs_and_the_route_choice_agree(engines, adapters):
    local, remote = engines
    local.set_adapters([local.load_adapter(adapters["L2"])], view="s")
    remote.set_adapters([remote.load_adapter(adapters["L2"])], view="s")
    prompt = prompt_tokens(local, PROMPTS[1])
    reply = local.generate(prompt, GREEDY)
    eos = local.tokenize("<|im_end|>")
    unlikely = local.tokenize(" purple elephants", special=False)
    for completion in (reply.tokens, [*reply.tokens, *eos], [*unlikely, *eos, *unlikely]):
        a, b = local.token_logprobs(prompt, completion), remote.token_logprobs(prompt, completion)
        assert b.shape == a.shape and np.all(np.isfinite(b))
        # Batched vs one-at-a-time evaluation round differently; the numbers are the same model's.
        assert np.max(np.abs(a - b)) < 0.5, (a, b)
    assert min(remote.token_logprobs(prompt, unlikely)) < -5  # forced, not sampled
    labels = [local.tokenize(f"L{i}", special=False)[-1] for i in range(4)]
    assert remote.best_next(prompt, labels) == local.best_next(prompt, labels)


def test_a_closed_stream_stops_and_the_next_reply_is_whole(engines):
    """Closing the stream drops the connection, and the server stops. (A prompt cached whole
    replays its last token alone, which rounds differently from a batch, in llama.cpp either
    way: so both engines go through the same steps before they are compared.)"""
    local, remote = engines
    tokens = prompt_tokens(local, PROMPTS[0])
    replies = []
    for engine in (local, remote):
        engine.set_adapters([], view="c")
        generation = engine.stream(tokens, GREEDY)
        for i, _ in enumerate(generation):
            if i == 2:
                generation.close()
                break
        assert 0 < len(generation.result.tokens) < GREEDY.max_tokens
        replies.append(engine.generate(tokens, GREEDY))
    assert replies[1].tokens == replies[0].tokens and replies[1].finish_reason == replies[0].finish_reason
    assert replies[1].reused_prompt_tokens == replies[0].reused_prompt_tokens == len(tokens) - 1


def test_an_adapter_the_started_server_lacks_restarts_it_with_the_longer_list(engines, adapters):
    _, remote = engines
    first = remote.load_adapter(adapters["L0"])
    before = remote.managed.restarts
    handle = remote.load_adapter(adapters["extra"])
    assert remote.managed.restarts == before + 1  # "extra" is new to the server: one restart
    assert {str(p) for p in remote.managed.adapters} >= {str(first.path), str(handle.path)}
    assert remote.load_adapter(adapters["extra"]) is handle  # loaded once by content


def test_a_users_server_must_have_been_started_with_the_adapter(engines, adapters, tmp_path):
    local, remote = engines
    config = EngineConfig(model_path=embedded_model(), n_ctx=1024)
    outside = LlamaServerEngine(config, url=remote.url)
    try:
        known = outside.load_adapter(adapters["L0"])  # on the started server's list
        assert known.key == local.load_adapter(adapters["L0"]).key
        info = BaseModelInfo.from_gguf(embedded_model())
        other = write_adapter(tmp_path / "new.gguf", random_lora(info, rank=4, seed=99))
        with pytest.raises(AdapterError, match="was not started with"):
            outside.load_adapter(other)
        bad = tmp_path / "bad.gguf"
        bad.write_bytes(b"GGUF" + b"\0" * 40)
        with pytest.raises(AdapterError):  # checked here: a malformed file reaches no server
            outside.load_adapter(bad)
    finally:
        outside.close()
    assert not remote.closed  # closing a client of a server does not stop it


def test_an_unreachable_server_is_one_line():
    config = EngineConfig(model_path=embedded_model(), n_ctx=1024)
    with pytest.raises(EngineUnavailableError) as caught:
        LlamaServerEngine(config, url="http://127.0.0.1:9", timeout_s=5)
    assert "\n" not in str(caught.value) and "127.0.0.1:9" in str(caught.value)


def test_learning_rollouts_through_it_are_the_in_process_ones(engines, adapters):
    local, remote = engines
    config = LearnConfig(temperature=0.0, group_size=2, episodes_per_step=2, max_new_tokens=16)
    pool = [
        Episode([{"role": "user", "content": text}], chosen="A short, kind answer.", rejected=None) for text in PROMPTS
    ]
    rollouts = []
    for engine in (local, remote):
        engine.set_adapters([engine.load_adapter(adapters["L0"])], view="learn")
        rollouts.append(sample_step(engine, pool[:2], "L0", 0, config, lambda text, e: float(len(text))))
    a, b = rollouts
    assert b.prompts == a.prompts and b.completions == a.completions and b.rewards == a.rewards
    for x, y in zip(a.sampler, b.sampler, strict=True):
        assert np.max(np.abs(np.array(x) - np.array(y))) < 0.5


# ----------------------------------------------------------------- through the product
@pytest.fixture
def experts_home(home, tmp_path, adapters):
    manifest = {
        "name": "experts",
        "architecture": "llama",
        "base": {"source": "path", "file": str(embedded_model())},
        "experts": {
            "L0": {"name": "Chat", "source": "path", "file": str(adapters["L0"])},
            "L2": {"name": "Coding", "source": "path", "file": str(adapters["L2"])},
        },
        "protocol": {"profile": "embedded", "summary_max_tokens": 16},
    }
    home.user_manifests_dir.mkdir(parents=True, exist_ok=True)
    (home.user_manifests_dir / "experts.toml").write_text(tomli_w.dumps(manifest))
    return home


def conversation(settings) -> tuple[list[tuple], str]:
    """Each turn's route and greedy reply. (The hidden summary hop samples with a repeat
    penalty, whose window llama-server fills with the prompt too and llama-cpp-python with
    the reply only; its text is not compared, only that each task got one.)"""
    with Session(settings, model="experts", engine_config={"n_ctx": 1024, "n_threads": 2}) as session:
        turns = []
        for text in ("Name a fruit.", "Write a python loop that prints 1 to 3.", "Name another fruit."):
            reply = session.send(text, params=GREEDY).wait()
            turns.append((reply.route.slot, reply.route.raw, reply.content, bool(reply.summary)))
        kind = type(session.engine).__name__
    return turns, kind


def test_a_routed_conversation_is_the_same_over_either_engine(experts_home, server_binary):
    local_turns, local_kind = conversation(experts_home)
    experts_home.save(engine={"kind": "llama-server", "binary": str(server_binary)})
    remote_turns, remote_kind = conversation(experts_home)
    assert (local_kind, remote_kind) == ("Engine", "LlamaServerEngine")
    assert remote_turns == local_turns
    assert {turn[0] for turn in local_turns} >= {"L0"} and all(turn[2] and turn[3] for turn in local_turns)


def test_ask_is_the_same_over_either_engine(home, server_binary):
    """Greedy `ask`, token for token. The repeat penalty is off: llama-server's penalty window
    holds the prompt's last tokens too, llama-cpp-python's only the reply's (README)."""
    question = ["ask", "What is the capital of France?", "--json", "--max-tokens", "24"]
    home.save(repeat_penalty=1.0)
    local = run_cli(*question, home=os.environ["MACARON_HOME"])
    assert local.returncode == 0, local.stderr
    home.save(engine={"kind": "llama-server", "binary": str(server_binary)})
    remote = run_cli(*question, home=os.environ["MACARON_HOME"])
    assert remote.returncode == 0, remote.stderr
    answers = [json.loads(done.stdout) for done in (local, remote)]
    assert answers[1]["text"] == answers[0]["text"] and answers[1]["expert"] == answers[0]["expert"]
    assert answers[1]["completion_tokens"] == answers[0]["completion_tokens"]


def test_a_bad_engine_table_is_one_line(home):
    for table, words in (
        ({"kind": "ollama"}, "kind must be one of"),
        ({"kind": "vllm"}, "needs url"),
        ({"kind": "llama-server", "url": "ftp://x"}, "url must be"),
        ({"kind": "llama-server", "timeout_s": 0}, "timeout_s"),
    ):
        with pytest.raises(InvalidInputError, match=words):
            from macaron_local.engine.remote.config import engine_config

            engine_config(table)
    home.save(engine={"kind": "llama-server", "binary": "/nonexistent/llama-server"})
    result = run_cli("ask", "hi", home=os.environ["MACARON_HOME"])
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "llama-server" in result.stderr
