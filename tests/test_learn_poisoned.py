"""A poisoned batch (gibberish "corrections") yields a candidate the gate rejects, and what is
deployed stays exactly as it was. Runs the real learning pass on the embedded model (minutes)."""

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


@pytest.mark.slow
def test_gibberish_corrections_are_rejected_and_nothing_is_deployed(home):
    rng = random.Random(0)
    alphabet = string.ascii_lowercase + "#@%"
    with Session(home, engine_config={"n_ctx": 1024}) as session:
        for prompt in PROMPTS:
            session.new_conversation()
            reply = session.send(prompt, params=GenerationParams(max_tokens=32, repeat_penalty=1.1)).wait()
            junk = " ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(3, 9))) for _ in range(30))
            session.correct(reply.message_id, junk)
        store, catalog, manifest = session.store, session.catalog, session.manifest
        # The back-off candidates have their own test (tests/test_learn_personal.py): here the final one alone.
        config = LearnConfig(steps=24, max_new_tokens=24, backoff_s=0.0)
        [report] = learn_once(store, catalog, manifest, config)
        assert report.decision == "rejected", report.reason
        # What learned gibberish either answers held-out questions in it (noise to the bare
        # experts, learn.fluency: seen at this build, reward -0.32 -> 0.02 all the same), fails
        # to move the held-out replies beyond noise, or costs the regression set.
        why = ("read as noise", "passage NLL rose", "factual answers dropped", "did not improve beyond noise")
        assert any(reason in report.reason for reason in why), report.reason
        assert store.deployed_adapter("personal", manifest.name) is None
        assert store.adapter_version(report.version_id).status == "rejected"
        [run] = store.learning_runs()
        assert run.decision == "rejected"
        print(f"\npoisoned run rejected: {report.reason}")
