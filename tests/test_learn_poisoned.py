"""A poisoned batch (gibberish "corrections") is not learned from, and what is deployed stays
exactly as it was. Runs the real learning pass on the embedded model. The gate's own check for
replies that turned to noise is tested in tests/test_fluency.py."""

from __future__ import annotations

import random
import string

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from macaron_local.engine import GenerationParams  # noqa: E402
from macaron_local.learn.loop import LearnConfig  # noqa: E402
from macaron_local.learn.run import learn_once  # noqa: E402
from macaron_local.session import Session  # noqa: E402

PROMPTS = [
    "How do I boil an egg?",
    "Why is the sky blue?",
    "What is a budget?",
    "How often should I water a cactus?",
    "What should I pack for a hike?",
    "How do I make my password safer?",
    "What is compound interest?",
    "Why do cats purr?",
    "What is a healthy breakfast?",
    "How do I start running?",
    "What does a router do?",
    "How can I focus better while working?",
]


def test_gibberish_corrections_are_not_learned_and_nothing_is_deployed(home):
    rng = random.Random(0)
    alphabet = string.ascii_lowercase + "#@%"
    with Session(home, engine_config={"n_ctx": 1024}) as session:
        for prompt in PROMPTS:
            session.new_conversation()
            reply = session.send(prompt, params=GenerationParams(max_tokens=32, repeat_penalty=1.1)).wait()
            junk = " ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(3, 9))) for _ in range(30))
            session.correct(reply.message_id, junk)
        store, catalog, manifest = session.store, session.catalog, session.manifest
        config = LearnConfig(steps=24, max_new_tokens=24, backoff_s=0.0)
        # Trained on, such a night deployed: the replies drifted away from the rejected ones
        # (stop 32: -0.448 -> -0.322 at 24 steps, fluent) or turned to gibberish themselves
        # (bench, 54 steps: -0.316 -> 0.021), and the reward counts both as progress. Each
        # correction reads as noise to the bare experts (learn/fluency.py), so none is learned.
        [report] = learn_once(store, catalog, manifest, config)
        assert report.decision == "skipped", report.reason
        assert report.reason == f"all {len(PROMPTS)} correction(s) read as noise, not language: nothing to learn"
        assert store.deployed_adapter("personal", manifest.name) is None
        assert store.learning_runs() == []
        print(f"\npoisoned night: {report.reason}")


def test_only_feedback_no_deployed_run_learned_is_judged_for_noise(home):
    """The check's cost follows the new feedback: what a deployed run learned passed it then."""
    from macaron_local.adapters.validate import BaseModelInfo
    from macaron_local.learn.episodes import Episode
    from macaron_local.learn.run import Experts, _drop_noise, _night_engine

    rng = random.Random(1)
    junk = " ".join("".join(rng.choice(string.ascii_lowercase + "#@%") for _ in range(7)) for _ in range(30))
    episode = Episode([{"role": "user", "content": PROMPTS[0]}], junk, "x", feedback_ids=[5])
    with Session(home, engine_config={"n_ctx": 1024}) as session:
        catalog, manifest = session.catalog, session.manifest
    base = BaseModelInfo.from_gguf(catalog.base_path(manifest))
    with _night_engine(catalog, manifest) as engine:
        experts = Experts(engine, catalog, manifest, base)
        assert _drop_noise(experts, [episode], learned=set()) == ([], 1)
        assert _drop_noise(experts, [episode], learned={5}) == ([episode], 0)
