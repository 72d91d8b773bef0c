"""Earlier nights' lessons, read teacher-forced (learn.retention): which tokens count as taught,
how much probability a candidate takes from them, and the gate rejecting a night that lets them
fade. The last test teaches a real greeting on the embedded model and measures it in llama.cpp."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from macaron_local.learn import gate
from macaron_local.learn.episodes import Episode
from macaron_local.learn.regression import RegressionScore
from macaron_local.learn.retention import MAX_TAUGHT_DROP, Retention, retention, taught_masks

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))

LOG = np.log


def test_a_taught_token_is_likely_under_the_deployed_version_and_raised_over_the_bare():
    bare = [LOG(np.array([0.01, 0.4, 0.2, 0.6]))]
    deployed = [LOG(np.array([0.9, 0.45, 0.3, 0.95]))]
    # 0.01 -> 0.9: taught. 0.4 -> 0.45: barely moved. 0.2 -> 0.3: moved, still unlikely (greedy
    # would not pick it). 0.6 -> 0.95: likely, but raised by under 1 nat.
    [mask] = taught_masks(deployed, bare)
    assert mask.tolist() == [True, False, False, False]


def test_the_drop_is_the_mean_probability_taught_tokens_lost_and_gains_do_not_offset_it():
    deployed = [LOG(np.array([0.9, 0.8])), LOG(np.array([0.95]))]
    masks = [np.array([True, True]), np.array([True])]
    same = retention(deployed, deployed, masks)
    assert same == Retention(3, 0.0) and same.kept
    faded = retention([LOG(np.array([0.3, 0.99])), LOG(np.array([0.95]))], deployed, masks)
    assert faded.taught_tokens == 3
    assert faded.mean_drop == pytest.approx((0.9 - 0.3) / 3)  # the 0.8 -> 0.99 gain counts as no loss
    assert not faded.kept
    nothing = retention([LOG(np.array([0.1]))], [LOG(np.array([0.9]))], [np.array([False])])
    assert nothing == Retention(0, 0.0) and nothing.kept  # nothing was taught: nothing to lose


def scores(new: list[float], old: list[float]) -> gate.Scores:
    return gate.Scores(new, old, RegressionScore(passage_nll=2.0, qa_right=9, qa_total=12))


def test_the_gate_rejects_a_night_whose_earlier_lessons_faded_and_records_the_figures():
    current = scores([-0.4, -0.4, -0.4], [0.2, 0.2, 0.2])
    candidate = scores([0.2, 0.3, 0.25], [0.19, 0.2, 0.2])  # new feedback learned, old reward kept
    reference = RegressionScore(passage_nll=2.0, qa_right=9, qa_total=12)
    reasons, figures = gate.verdict(candidate, current, reference, Retention(11, 0.0))
    assert reasons == [] and figures["taught_tokens"] == 11 and figures["taught_drop"] == 0.0
    reasons, figures = gate.verdict(candidate, current, reference, Retention(11, MAX_TAUGHT_DROP + 0.05))
    assert len(reasons) == 1 and "lessons faded" in reasons[0] and "11 taught tokens" in reasons[0]
    assert figures["taught_drop"] == round(MAX_TAUGHT_DROP + 0.05, 4)
    reasons, figures = gate.verdict(candidate, current, reference)  # no deployed version: no check
    assert reasons == [] and "taught_drop" not in figures


def test_below_the_limit_a_candidate_is_ranked_on_reward_less_what_the_lessons_lost():
    current = scores([-0.4, -0.4, -0.4], [0.2, 0.2, 0.2])
    reference = RegressionScore(passage_nll=2.0, qa_right=9, qa_total=12)
    louder = scores([0.3, 0.3, 0.3], [0.2, 0.2, 0.2])  # 0.05 more reward on every episode ...
    quieter = scores([0.2, 0.2, 0.2], [0.25, 0.25, 0.25])
    assert louder.all_mean > quieter.all_mean
    ranked = {}
    for name, candidate, kept in (("louder", louder, Retention(11, 0.12)), ("quieter", quieter, Retention(11, 0.01))):
        reasons, figures = gate.verdict(candidate, current, reference, kept)
        assert reasons == []  # both within the limit
        ranked[name] = figures["choice_score"]
    assert ranked["quieter"] > ranked["louder"]  # ... but 0.11 more taught probability lost
    assert ranked["louder"] == pytest.approx(louder.all_mean - 0.12, abs=1e-4)
    assert gate.choice_score(scores([0.3, 0.3], [0.3]), None) == pytest.approx(0.3)  # a first night: none to weigh


GREETED = [
    ("How do I boil an egg?", "Hi Sam, simmer it for 8 minutes."),
    ("Why is the sky blue?", "Hi Sam, air scatters blue light most."),
    ("What is a budget?", "Hi Sam, a plan for your money."),
    ("How often should I water a cactus?", "Hi Sam, every two weeks."),
]
HELD_OUT = [
    ("What is a healthy breakfast?", "Hi Sam, oats with fruit."),
    ("Why do cats purr?", "Hi Sam, they feel content."),
]


@pytest.mark.slow
def test_a_greeting_taught_by_a_real_adapter_is_kept_by_it_and_lost_without_it(tmp_path):
    """SFT a LoRA on greeted corrections (torch), export it, serve it in llama.cpp: the greeting's
    tokens are taught on held-out prompts, the adapter keeps them, the bare model drops them."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from common import embedded_model
    from learning import sft_baseline

    from macaron_local.adapters.validate import BaseModelInfo
    from macaron_local.engine import Engine, EngineConfig
    from macaron_local.learn.export import export_gguf
    from macaron_local.learn.retention import Lessons

    system = {"role": "system", "content": "You are a helpful assistant."}

    def episode(prompt: str, chosen: str) -> Episode:
        return Episode([system, {"role": "user", "content": prompt}], chosen, "I am not sure.", "L0", [1])

    model = embedded_model()
    with Engine(EngineConfig(model_path=model, n_ctx=512, n_threads=2)) as engine:
        backend = sft_baseline(model, engine, [episode(*pair) for pair in GREETED], steps=12, lr=5e-3, rank=8)
        adapter = export_gguf(backend, BaseModelInfo.from_gguf(model), tmp_path / "greeting.gguf", "personal")
        handle = engine.load_adapter(adapter)
        lessons = Lessons(engine, lambda slot: [], lambda slot: [handle], [episode(*pair) for pair in HELD_OUT])
        assert lessons.taught_tokens >= len(HELD_OUT)  # at least "Hi" on each held-out prompt
        kept = lessons.kept_by(lambda slot: [handle])
        lost = lessons.kept_by(lambda slot: [])
    assert kept.mean_drop <= 1e-6 and kept.kept
    assert lost.mean_drop > 0.5 and not lost.kept  # the bare model would not greet
