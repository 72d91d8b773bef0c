"""The session API: routes each turn, activates that expert's adapters (plus the user's personal
adapter), renders that expert's own view with the model's template, and streams the reply.

The tiny expert model routes with the keyword fallback mode (its random weights make the route
hop's choice arbitrary) and makes short summaries; tests/test_protocol.py covers the route hop."""

from __future__ import annotations

import numpy as np
import pytest
import tomli_w
from conftest import write_random_adapter

from macaron_local.engine import Engine, EngineConfig, GenerationParams
from macaron_local.errors import MacaronError, ModelError
from macaron_local.session import Session

SHORT = GenerationParams(max_tokens=6, temperature=0.0, min_p=0.0)


@pytest.fixture
def expert_home(home, tiny_model, tmp_path):
    """A user manifest `tiny` whose L0 and L2 slots have GGUF expert adapters."""
    model = tiny_model("qwen3", False)
    adapters = {
        slot: write_random_adapter(tmp_path / f"{slot}.gguf", model, rank=4, seed=seed, magnitude=1.5)
        for slot, seed in (("L0", 31), ("L2", 32))
    }
    manifest = {
        "name": "tiny",
        "architecture": "qwen3",
        "base": {"source": "path", "file": str(model.path)},
        "experts": {
            "L0": {"name": "Chat", "source": "path", "file": str(adapters["L0"])},
            "L1": {"name": "Agent"},
            "L2": {"name": "Coding", "source": "path", "file": str(adapters["L2"])},
            "L3": {"name": "UI"},
        },
        "protocol": {"summary_max_tokens": 4},
    }
    home.user_manifests_dir.mkdir(parents=True, exist_ok=True)
    (home.user_manifests_dir / "tiny.toml").write_text(tomli_w.dumps(manifest))
    home.save(routing="keywords")
    return home, model, adapters


N_CTX = 512


def open_session(home, **engine) -> Session:
    return Session(home, model="tiny", engine_config={"n_ctx": N_CTX, "kv_f32": True, **engine})


def test_keyword_fallback_mode_activates_that_expert(expert_home):
    home, _, adapters = expert_home
    with open_session(home) as session:
        reply = session.send("fix this python bug", params=SHORT).wait()
        assert reply.route.slot == "L2" and reply.adapters == (adapters["L2"].name,)
        assert session.engine.active == ((session.adapters_for("L2")[0].key, 1.0),)
        assert session.messages[-1] == {"role": "assistant", "content": reply.text}
        assert reply.route.method == "keywords" and reply.route.raw is None  # no route hop ran


def test_model_routing_runs_the_route_hop_on_l0_and_records_it(expert_home):
    home, _, _ = expert_home
    home.save(routing="model")
    with open_session(home, n_ctx=2048) as session:
        reply = session.send("hmm, what about this one?", params=SHORT).wait()
        [turn] = session.store.get_conversation(session.conversation_id).turns
    # Only label tokens can be chosen; a vocabulary that cannot spell a whole label (this tiny
    # one) leaves a non-label output, and the profile's default label answers.
    label = reply.route.raw == reply.route.slot
    assert reply.route.method == ("model" if label else "default")
    assert label or reply.route.slot == session.protocol.profile.default_label
    assert (turn.expert, turn.route_method, turn.route_raw) == (reply.route.slot, reply.route.method, reply.route.raw)
    assert turn.route_ms > 0 and turn.summary is not None and turn.summary_ms > 0


def test_reply_equals_a_fresh_engine_under_the_same_adapters(expert_home):
    home, model, adapters = expert_home
    with open_session(home) as session:
        first = session.send("hello there", expert="L0", params=SHORT).wait()  # L0 first: forces a switch
        reply = session.send("write python code", params=SHORT).wait()
        intro = session.protocol.profile.intro
        handoff = session.protocol.profile.handoff_text(first.summary)
        # L2's own view: L0's task as its summary (verbatim when no longer), then the request.
        shown = first.content if len(first.content) <= len(handoff) else handoff
        messages = [
            {"role": "system", "content": f"{session.system_prompt}\n\n{intro}"},
            {"role": "user", "content": "hello there"},
            {"role": "assistant", "content": shown},
            {"role": "user", "content": "write python code"},
        ]
    assert reply.route.slot == "L2" and first.summary
    with Engine(EngineConfig(model_path=model.path, n_ctx=N_CTX, kv_f32=True)) as engine:
        engine.set_adapters([engine.load_adapter(adapters["L2"])])
        tokens, _ = engine.prompt_for(messages, SHORT.max_tokens)
        assert engine.generate(tokens, SHORT).tokens == reply.completion.tokens


def test_personal_adapter_stacks_on_the_expert(expert_home, tmp_path):
    home, model, adapters = expert_home
    personal = write_random_adapter(tmp_path / "personal.gguf", model, rank=2, seed=33)
    with open_session(home) as session:
        session.set_personal_adapter("L2", personal)
        reply = session.send("python please", params=SHORT).wait()
        assert reply.adapters == (adapters["L2"].name, "personal.gguf")
        assert len(session.engine.active) == 2
        logits_both = session.engine.logits([1, 2, 3])
        session.set_personal_adapter("L2", None)
        session.engine.set_adapters(session.adapters_for("L2"))
        assert np.abs(logits_both - session.engine.logits([1, 2, 3])).max() > 1e-3


def test_tool_result_returns_to_the_expert_that_made_the_call(expert_home):
    home, _, _ = expert_home
    with open_session(home) as session:
        first = session.send("write python code to list files", params=SHORT).wait()
        result = session.send("file_a.txt\nfile_b.txt", role="tool", params=SHORT).wait()
    assert first.route.slot == "L2"
    assert (result.route.slot, result.route.method, result.route.raw) == ("L2", "pending", None)
    assert session.messages[2]["role"] == "tool"


def test_missing_expert_file_is_a_clear_error(expert_home):
    home, _, adapters = expert_home
    adapters["L2"].unlink()
    with pytest.raises(ModelError, match="expert L2 adapter .* is missing"):
        open_session(home).load()


def test_long_conversation_drops_oldest_turns_and_keeps_answering(home):
    with Session(home, engine_config={"n_ctx": 320}) as session:  # room for the route hop too
        dropped = []
        for i in range(8):
            reply = session.send(
                f"Tell me one fact about the number {i}.", params=GenerationParams(max_tokens=24)
            ).wait()
            dropped.append(reply.dropped_messages)
            assert reply.completion.tokens
        assert dropped[0] == 0 and dropped[-1] > 0
        assert len(session.messages) == 16  # the session keeps everything; only the prompt is trimmed


def test_follow_up_reuses_the_prompt_cache(home):
    with Session(home) as session:
        session.send("What is the capital of France?", params=GenerationParams(max_tokens=12)).wait()
        follow = session.send("And of Spain?", params=GenerationParams(max_tokens=12)).wait()
    assert follow.completion.reused_prompt_tokens > 20


def test_a_1mb_paste_gets_a_clear_error_and_is_kept(home):
    with Session(home, engine_config={"n_ctx": 512}) as session:
        huge = "word " * 200_000  # 1 MB
        with pytest.raises(MacaronError, match="too long for the model's context"):
            session.send(huge)
        conversation = session.store.get_conversation(session.conversation_id)
        assert [m.content for m in conversation.messages] == [huge]  # nothing lost
        reply = session.send("Hello?", params=SHORT).wait()  # and the session still works
        assert reply.message_id is not None


def test_correcting_an_earlier_reply_keeps_later_turns_and_feeds_the_model_the_correction(home):
    with Session(home) as session:
        first = session.send("Name a colour.", params=GenerationParams(max_tokens=8)).wait()
        session.send("Name another one.", params=GenerationParams(max_tokens=8)).wait()
        original = first.text
        feedback_id = session.correct(first.message_id, "Teal.")
        assert [m["content"] for m in session.messages][1] == "Teal."
        assert len(session.messages) == 4  # the later turns stay in view
        stored = session.store.get_message(first.message_id)
        assert stored.content == original  # nothing overwritten
        [item] = [i for i in session.store.feedback_rows() if i.feedback.id == feedback_id]
        assert (item.feedback.kind, item.feedback.text) == ("correction", "Teal.")
        with pytest.raises(MacaronError, match="only a reply"):
            session.correct(session.store.path(first.message_id)[0].id, "nope")


def test_deployed_personal_adapter_is_served_and_recorded(expert_home, tmp_path):
    home, model, adapters = expert_home
    personal = write_random_adapter(tmp_path / "mine.gguf", model, rank=2, seed=41)
    with open_session(home) as session:
        version = session.store.register_adapter(personal, slot="L2", base_model="tiny", rank=2)
        session.store.deploy_adapter(version.id)
    with open_session(home) as session:
        reply = session.send("fix this python bug", params=SHORT).wait()
        assert reply.adapters == (adapters["L2"].name, f"personal {version.id}")
        [turn] = session.store.get_conversation(session.conversation_id).turns
        assert turn.adapters == [adapters["L2"].name, f"personal {version.id}"]
        assert len(session.engine.active) == 2


def test_rollback_switches_the_served_personal_adapter(expert_home, tmp_path):
    home, model, adapters = expert_home
    with open_session(home) as session:
        first = session.store.register_adapter(
            write_random_adapter(tmp_path / "v1.gguf", model, rank=2, seed=51), slot="L2", base_model="tiny", rank=2
        )
        session.store.deploy_adapter(first.id)
        second = session.store.register_adapter(
            write_random_adapter(tmp_path / "v2.gguf", model, rank=2, seed=52),
            slot="L2",
            base_model="tiny",
            rank=2,
            parent_id=first.id,
        )
        session.store.deploy_adapter(second.id)
        assert session.send("python code", params=SHORT).wait().adapters[-1] == f"personal {second.id}"
        assert session.rollback("L2").id == first.id
        assert session.send("more python code", params=SHORT).wait().adapters[-1] == f"personal {first.id}"
        assert session.rollback("L2") is None
        assert session.send("python again", params=SHORT).wait().adapters == (adapters["L2"].name,)
        assert session.deployed_versions() == {}


def test_a_route_hop_that_does_not_fit_the_context_leaves_the_default_label(expert_home):
    home, _, _ = expert_home
    home.save(routing="model")
    with open_session(home) as session:  # the tiny model spells the route prompt letter by letter
        reply = session.send("hello", params=SHORT).wait()
    assert (reply.route.slot, reply.route.method, reply.route.raw) == ("L0", "default", "")
    assert "does not fit" in reply.route.reason and reply.message_id is not None
