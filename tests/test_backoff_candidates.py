"""The back-off's candidates, alone (no model): the half-strength one halves tonight's update and
never what earlier nights taught, the deployed candidate is chosen on all held-out feedback, and
the scan stops where older checkpoints stop winning."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from macaron_local.learn import gate
from macaron_local.learn.episodes import Episode
from macaron_local.learn.gate import Scores
from macaron_local.learn.loop import Checkpoint, LearnConfig, TrainResult
from macaron_local.learn.regression import RegressionScore
from macaron_local.learn.rewards import lesson_recall, lesson_words, preference_reward
from macaron_local.learn.run import Candidate, _fallbacks, best_passing, judge_in_turn, to_deploy


def lora(a: float, b: float, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "q.lora_A": (a * rng.standard_normal((4, 16))).astype(np.float32),
        "q.lora_B": (b * rng.standard_normal((16, 4))).astype(np.float32),
    }


def update(weights: dict[str, np.ndarray]) -> np.ndarray:
    return weights["q.lora_B"] @ weights["q.lora_A"]


def test_from_zero_the_half_candidate_is_exactly_half_the_update():
    start = lora(1.0, 0.0)  # a fresh LoRA: B is zero, so it serves nothing yet
    end = lora(1.0, 1.0, seed=1)
    half = Candidate("final-half", 10, 5e-4, 0.1, end, 0.5, origin=start).served_weights()
    np.testing.assert_allclose(update(half), 0.5 * update(end), rtol=1e-6)
    np.testing.assert_array_equal(half["q.lora_A"], end["q.lora_A"])
    # No origin recorded (the remote trainer's case) reads the same way.
    np.testing.assert_allclose(update(Candidate("h", 10, 0, 0, end, 0.5).served_weights()), update(half))


def test_after_a_warm_start_the_half_candidate_keeps_what_earlier_nights_taught():
    night1 = lora(1.0, 1.0, seed=2)  # the deployed version tonight started from
    night2 = {k: v + 0.1 * lora(1.0, 1.0, seed=3)[k] for k, v in night1.items()}
    half = Candidate("final-half", 66, 5e-4, 0.1, night2, 0.5, origin=night1).served_weights()
    for name in night1:  # halfway along tonight's path in weight space
        np.testing.assert_allclose(half[name], (night1[name] + night2[name]) / 2, rtol=1e-6, atol=1e-7)
    # Scaling the whole adapter (the old rule) would have halved night 1's update too:
    night1_kept = np.linalg.norm(update(half) - update(night1)) / np.linalg.norm(update(night1))
    whole_half = np.linalg.norm(0.5 * update(night2) - update(night1)) / np.linalg.norm(update(night1))
    assert night1_kept < 0.1 < 0.4 < whole_half


def test_full_strength_candidates_serve_their_weights_unchanged():
    end = lora(1.0, 1.0, seed=4)
    assert Candidate("final", 10, 5e-4, 0.1, end, origin=lora(1.0, 1.0)).served_weights() is end


def test_the_fallbacks_halve_from_where_the_run_started():
    start, end = lora(1.0, 1.0, seed=5), lora(1.0, 1.0, seed=6)
    result = TrainResult(checkpoints=[Checkpoint(6, lora(1.0, 1.0, seed=7)), Checkpoint(12, end)], start=start)
    final = Candidate("final", 18, 5e-4, 0.1, end)
    names = [c.name for c in _fallbacks(result, final, LearnConfig())]
    assert names == ["step-12", "step-6", "final-half"]
    half = _fallbacks(result, final, LearnConfig())[-1]
    assert half.origin is start and half.scale == 0.5


def test_a_candidate_is_chosen_on_every_held_out_episode_pooled():
    forgets = Scores(held_new=[0.6, 0.6], held_old=[-0.5, -0.5, -0.5, -0.5])
    keeps = Scores(held_new=[0.4, 0.4], held_old=[0.3, 0.3, 0.3, 0.3])
    assert forgets.new_mean > keeps.new_mean
    assert keeps.all_mean > forgets.all_mean
    assert abs(keeps.all_mean - (0.8 + 1.2) / 6) < 1e-9
    assert Scores([], []).all_mean == 0.0


# Three real back-off scans (bench/learning.py and bench/nights.py on the embedded model, stop 34),
# judged in full, newest first: (name, passed, choice_score) after the rejected final candidate.
RATINGS_NIGHT = [("step-102", False, 0.003), ("step-96", True, 0.0676), ("step-90", True, 0.0535),
                 ("step-84", True, 0.0417), ("step-78", False, 0.0267), ("step-72", False, 0.0167),
                 ("step-66", True, 0.0446), ("step-60", False, 0.0216), ("step-54", False, 0.0402),
                 ("step-48", False, -0.0182), ("step-42", False, -0.0234), ("step-36", False, -0.0058),
                 ("step-30", False, -0.0683), ("step-24", False, -0.0249), ("step-18", False, -0.0273),
                 ("step-12", False, 0.0057), ("step-6", False, -0.0033), ("final-half", False, -0.0091)]  # fmt: skip
TLDR_NIGHT = [("step-66", False, 0.0528), ("step-60", False, 0.0888), ("step-54", True, 0.0747),
              ("step-48", True, 0.025), ("step-42", True, 0.0125), ("step-36", True, -0.0119),
              ("step-30", True, 0.0347), ("step-24", True, -0.0249), ("step-18", True, 0.0006),
              ("step-12", False, -0.0742), ("step-6", False, -0.1284), ("final-half", False, -0.1033)]  # fmt: skip
SECOND_NIGHT = [("step-78", False, 0.0235), ("step-72", False, 0.0382), ("step-66", False, 0.0118),
                ("step-60", False, 0.0036), ("step-54", False, 0.0393), ("step-48", False, -0.0155),
                ("step-42", False, 0.043), ("step-36", True, 0.0209), ("step-30", True, 0.0508),
                ("step-24", True, 0.032), ("step-18", True, -0.0956), ("step-12", True, -0.0632),
                ("step-6", True, -0.1366), ("final-half", True, -0.0192)]  # fmt: skip


def scan(recorded, patience: int, budget: int = 100) -> list[Candidate]:
    """judge_in_turn over recorded verdicts; `budget`: how many judgements fit."""
    verdicts = {name: (passed, score) for name, passed, score in recorded}
    judged: list[str] = []

    def judge(candidate: Candidate) -> Candidate:
        judged.append(candidate.name)
        candidate.passed, score = verdicts[candidate.name]
        candidate.figures = {"choice_score": score}
        return candidate

    candidates = [Candidate(name, 0, 5e-4, 0.1, {}) for name, _, _ in recorded]
    done = judge_in_turn(candidates, judge, affordable=lambda: len(judged) < budget, patience=patience)
    assert [c.name for c in done] == judged
    return done


def best(judged: list[Candidate]) -> str | None:
    chosen = best_passing(judged)
    return chosen.name if chosen else None


def test_patience_keeps_the_choice_of_a_full_scan_on_real_nights_at_a_fraction_of_the_cost():
    nights = ((RATINGS_NIGHT, "step-96", 5), (TLDR_NIGHT, "step-54", 6), (SECOND_NIGHT, "step-30", 12))
    for recorded, chosen, judged in nights:
        full = scan(recorded, patience=0)
        assert len(full) == len(recorded) and best(full) == chosen
        short = scan(recorded, patience=3)
        assert best(short) == chosen and len(short) == judged


def test_patience_counts_only_after_a_pass_and_restarts_at_a_better_one():
    failing = [(f"step-{i}", False, 0.1) for i in range(20, 0, -1)]
    assert len(scan(failing, patience=3)) == 20  # nothing passed: every checkpoint is tried
    climbing = [("a", True, 0.1), ("b", False, 0.0), ("c", True, 0.2), ("d", True, 0.1), ("e", False, 0.0),
                ("f", True, 0.15), ("g", True, 0.3)]  # fmt: skip
    assert [c.name for c in scan(climbing, patience=3)] == ["a", "b", "c", "d", "e", "f"]
    assert best(scan(climbing, patience=4)) == "g"


def test_the_time_budget_bounds_the_scan_whatever_the_patience():
    assert len(scan(TLDR_NIGHT, patience=0, budget=2)) == 2
    assert best(scan(TLDR_NIGHT, patience=3, budget=2)) is None
    assert scan(TLDR_NIGHT, patience=3, budget=0) == []


def test_after_a_final_that_passed_patience_counts_from_the_start_and_only_a_better_one_replaces_it():
    final = Candidate("final", 72, 5e-4, 0.1, {}, passed=True, figures={"choice_score": 0.1})
    scores = {"step-66": 0.05, "step-60": 0.05, "step-54": 0.1, "step-48": 0.05, "step-42": 0.2}

    def judge(candidate: Candidate) -> Candidate:
        candidate.passed, candidate.figures = True, {"choice_score": scores[candidate.name]}
        return candidate

    def scan_after_final(names: list[str]) -> list[Candidate]:
        candidates = [Candidate(name, 0, 5e-4, 0.1, {}) for name in names]
        return judge_in_turn(candidates, judge, affordable=lambda: True, patience=3, passed=final)

    done = scan_after_final(["step-66", "step-60", "step-54", "step-48", "step-42"])
    assert [c.name for c in done] == ["step-66", "step-60", "step-54"]  # none beat the final (a tie neither)
    assert best_passing([final, *done]) is final
    done = scan_after_final(["step-66", "step-42", "step-60", "step-54", "step-48"])
    assert [c.name for c in done] == ["step-66", "step-42", "step-60", "step-54", "step-48"]
    assert best_passing([final, *done]).name == "step-42"


def judged(name: str, step: int, rewards: list[float], passed: bool = True, scale: float = 1.0) -> Candidate:
    """A candidate as the gate leaves it: its per-episode choice rewards and their mean."""
    figures = {"choice_score": float(np.mean(rewards)), "choice_rewards": rewards}
    return Candidate(name, step, 5e-4, 0.1, {}, scale, passed, figures=figures)


def test_the_most_trained_passing_candidate_is_deployed_when_the_leader_is_not_clearly_ahead():
    # The shape of a real allergy night: step 24 led on the held-out reward by 0.046 over its 3
    # held-out episodes, within the noise, and served 0.375 on the check; the final served 0.75.
    leader = judged("step-24", 24, [0.30, 0.05, 0.157])
    final = judged("final", 54, [0.20, 0.02, 0.151])
    early = judged("step-12", 12, [0.0] * 3)
    rejected = judged("step-48", 48, [0.5] * 3, passed=False)  # never deployed, however it scored
    chosen, note = to_deploy([final, leader, early, rejected])
    assert best_passing([final, leader, early, rejected]) is leader
    assert chosen is final
    assert note.startswith("final: the most trained") and "step-24" in note and "0.169 against 0.124" in note


def test_a_leader_clearly_ahead_is_deployed():
    # stop 35's tldr night in shape: the final passed 0.137 behind step 30, on every episode
    leader = judged("step-30", 30, [0.05, 0.0, 0.02, -0.05])
    final = judged("final", 72, [-0.10, -0.15, -0.12, -0.18])
    assert to_deploy([final, leader]) == (leader, "")


def test_strength_counts_as_training_and_nothing_passing_deploys_nothing():
    half = judged("final-half", 60, [0.1, 0.1, 0.1], scale=0.5)  # 30 steps' worth
    step42 = judged("step-42", 42, [0.1, 0.1, 0.1])
    assert to_deploy([half, step42])[0] is step42
    assert to_deploy([judged("final", 60, [0.3], passed=False)]) == (None, "")


REFERENCE = RegressionScore(passage_nll=2.0, qa_right=9, qa_total=12)
NIGHTS = json.loads((Path(__file__).parent / "data" / "allergy_nights.json").read_text())["nights"]


def choose(night: dict, lesson_weight: float) -> Candidate:
    """The candidate a recorded night deploys when its replies are scored by today's gate."""
    held = [Episode([{"role": "user", "content": e["prompt"]}], e["chosen"], e["rejected"]) for e in night["heldout"]]
    lesson = lesson_words(night["corrections"], night["rejected"])

    def scores(replies: list[str]) -> gate.Scores:
        pairs = list(zip(replies, held, strict=True))
        rewards = [preference_reward(reply, e.chosen, e.rejected) for reply, e in pairs]
        recalls = [lesson_recall(reply, e.chosen, lesson) for reply, e in pairs]
        return gate.Scores(rewards, [], REFERENCE, lesson=recalls)

    current = scores(night["deployed_replies"])
    candidates = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gate, "LESSON_WEIGHT", lesson_weight)
        for c in night["candidates"]:
            _, figures = gate.verdict(scores(c["replies"]), current, REFERENCE)
            candidates.append(Candidate(c["name"], c["step"], 5e-4, 0.1, {}, 1.0, True, figures=figures))
    chosen, _ = to_deploy(candidates)
    assert chosen is not None
    return chosen


@pytest.mark.parametrize("night", NIGHTS, ids=lambda n: n["night"])
def test_the_lesson_words_choose_a_candidate_that_applies_the_fact(night: dict) -> None:
    # Every candidate passed the gate that night; the reward alone could not rank them by
    # whether they applied the allergy. With the lesson words, the one deployed served it in at
    # least 6 of the 8 unseen prompts.
    served = {c["name"]: c["served_check"] for c in night["candidates"]}
    chosen = choose(night, gate.LESSON_WEIGHT)
    assert served[chosen.name] is not None and served[chosen.name] >= 0.75, chosen.name
    assert chosen.figures["heldout_lesson_after"] > 0.5


def test_without_the_lesson_words_the_fresh_allergy_night_now_finds_the_fact_by_its_length_charge() -> None:
    # Under stop 38's reward and stop 41's linear length charge, the reward alone chose the
    # final, which served 0.375 (as deployed that night). With length charged from the first word
    # past a cut (stop 42), the reward alone ranks step 42 first, as the lesson words do.
    night = NIGHTS[1]
    served = {c["name"]: c["served_check"] for c in night["candidates"]}
    assert served["final"] == 0.375
    assert choose(night, 0.0).name == "step-42" == choose(night, gate.LESSON_WEIGHT).name
    assert served["step-42"] == 0.875
