"""Is a reply still language (learn.fluency)? Real text read by the embedded model in llama.cpp,
and the gate rejecting a candidate whose held-out replies turned to noise."""

from __future__ import annotations

import random
import string
import sys
from pathlib import Path

import pytest

from macaron_local.engine import Completion, Engine, EngineConfig
from macaron_local.learn import fluency, gate
from macaron_local.learn.episodes import Episode
from macaron_local.learn.regression import RegressionScore

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from common import embedded_model  # noqa: E402

SYSTEM = "You are a helpful assistant."
QUESTION = "How do I boil an egg?"
ANSWER = (
    "Put the egg in a pot of cold water and bring it to a boil. Lower the heat, simmer for 7 to 9 "
    "minutes, then cool it in cold water before peeling."
)


def gibberish(seed: int, words: int = 24) -> str:
    rng = random.Random(seed)
    alphabet = string.ascii_lowercase + "#@%"
    return " ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(3, 9))) for _ in range(words))


@pytest.fixture(scope="module")
def engine():
    with Engine(EngineConfig(model_path=embedded_model(), n_ctx=512, n_threads=2)) as engine:
        yield engine


def reader(engine: Engine):
    prompt = engine.render_tokens([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])

    def surprise(text: str) -> float | None:
        reply = Completion(text=text, tokens=engine.tokenize(text, special=False))
        return fluency.surprise(engine, prompt, reply)

    return surprise


def test_language_in_any_style_is_below_the_noise_line_and_gibberish_above(engine):
    surprise = reader(engine)
    styles = {
        "plain": ANSWER,
        "lower case": ANSWER.lower(),
        "tl;dr": "TL;DR: Simmer it for 7 to 9 minutes.\n\n" + ANSWER,
        "bullets": "- Cold water in a pot\n- Bring to a boil\n- Simmer 7 to 9 minutes\n- Cool before peeling",
        "french": "Mettez l'oeuf dans une casserole d'eau froide, portez à ébullition, puis laissez mijoter 8 minutes.",
    }
    for name, text in styles.items():
        value = surprise(text)
        assert value is not None and value < fluency.NOISE_NATS_PER_CHAR, (name, value)
    for seed in range(3):
        value = surprise(gibberish(seed))
        assert value is not None and value > fluency.NOISE_NATS_PER_CHAR, value
    # The model's own answer is what it finds least surprising.
    own = engine.generate(engine.render_tokens([{"role": "user", "content": QUESTION}]))
    assert surprise(own.text) < surprise(ANSWER)


def test_a_reply_too_short_to_judge_is_not_judged_and_not_counted(engine):
    surprise = reader(engine)
    assert surprise("Biscuit.") is None and surprise("Hi Sam, your dog is Biscuit.") is None
    assert surprise("") is None
    assert fluency.noise_count([None, 0.4, fluency.NOISE_NATS_PER_CHAR + 0.1, None, 4.2]) == 2


def test_the_gate_rejects_a_candidate_whose_replies_turned_to_noise():
    reference = RegressionScore(passage_nll=2.0, qa_right=9, qa_total=12)
    current = gate.Scores([-0.4, -0.4, -0.4], [], reference, surprise=[0.2, 0.3, None])
    # The gibberish night: a large reward gain (away from the rejected replies), all noise.
    noise = gate.Scores([0.0, 0.0, -0.1], [], reference, surprise=[4.1, 4.3, 4.2])
    reasons, figures = gate.verdict(noise, current, reference)
    assert figures["heldout_noise_replies_before"] == 0 and figures["heldout_noise_replies_after"] == 3
    assert reasons == [
        f"3 of 3 held-out replies read as noise, not language (the bare experts' surprise above "
        f"{fluency.NOISE_NATS_PER_CHAR} nats a character; the deployed version: 0)"
    ]
    # One noisy reply is enough; a lesson whose replies stay language passes.
    reasons, _ = gate.verdict(
        gate.Scores([0.0, 0.0, -0.1], [], reference, surprise=[0.5, 3.2, None]), current, reference
    )
    assert len(reasons) == 1 and "1 of 3 held-out replies read as noise" in reasons[0]
    reasons, _ = gate.verdict(
        gate.Scores([0.0, 0.0, -0.1], [], reference, surprise=[0.5, 0.9, 0.4]), current, reference
    )
    assert reasons == []


def test_a_night_leaves_out_the_corrections_that_read_as_noise_and_keeps_every_language(engine):
    def episode(correction: str) -> Episode:
        return Episode([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}], correction, "x")

    texts = [
        ANSWER,
        ANSWER.lower(),
        gibberish(7),
        "Mettez l'oeuf dans l'eau froide et laissez mijoter huit minutes.",
        "TL;DR: Simmer it.\n\n" + ANSWER,
        gibberish(8),
    ]
    episodes = [episode(text) for text in texts]
    episodes.append(Episode(episodes[0].messages, None, gibberish(9)))  # a dislike: nothing chosen to judge
    noisy = fluency.noisy_corrections(engine, lambda slot: [], episodes)
    assert [episodes.index(e) for e in noisy] == [2, 5]
