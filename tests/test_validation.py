"""learn.validation alone (arrays in, verdicts out): a final that overfit its corrections is
looked past, one still learning is not."""

from __future__ import annotations

import numpy as np

from macaron_local.learn.loop import LearnConfig
from macaron_local.learn.run import Candidate, back_off, best_passing, judge_in_turn
from macaron_local.learn.validation import OVERFIT_MARGIN, EarlyStop, heldout_gain, overfit, ranked

# The night's held-out corrections' mean gain (nats a token over the bare base) under candidates
# of a real tldr night (bench/learning.py on the embedded model, stop 34), read teacher-forced
# under each one's GGUF afterwards; three more nights' are in the scans below.
STOP34 = {"final": 0.978, "step-66": 1.035, "step-60": 1.12, "step-54": 1.15}


# Three real back-off scans after a rejected final (tldr on the embedded model), every candidate
# judged, newest first: (name, passed, choice_score, held-out gain). Their finals read 0.702,
# 0.659 and 0.755. The first night's gains are the trainer's own (stop 36); the other two were
# read afterwards under each candidate's GGUF (stop 35).
STOP36 = [("step-66", True, -0.1371, 0.751), ("step-60", True, -0.0665, 0.841), ("step-54", False, -0.0509, 0.875),
          ("step-48", True, -0.031, 0.88), ("step-42", True, -0.0139, 1.003), ("step-36", True, -0.0197, 1.084),
          ("step-30", True, 0.05, 1.083), ("step-24", True, -0.0857, 1.044), ("step-18", False, -0.039, 0.962),
          ("step-12", False, -0.1034, 0.7)]  # fmt: skip
STOP35_THIRD_SCAN = [("step-66", False, 0.01, 0.576), ("step-60", True, 0.0717, 0.819),
                     ("step-54", False, 0.068, 0.942), ("step-48", True, 0.0849, 0.987),
                     ("step-42", True, 0.0514, 0.999), ("step-36", True, 0.0501, 0.979),
                     ("step-30", True, 0.0964, 0.919), ("step-24", True, 0.1033, 0.871),
                     ("step-18", False, -0.0085, 0.703), ("step-12", False, -0.0411, 0.492),
                     ("step-6", False, -0.044, 0.338)]  # fmt: skip
STOP35_SECOND_SCAN = [("step-66", False, 0.0736, 0.835), ("step-60", False, 0.0568, 0.915),
                      ("step-54", False, 0.0735, 0.977), ("step-48", False, 0.0656, 0.996),
                      ("step-42", True, 0.0954, 1.057), ("step-36", False, -0.0797, 0.899),
                      ("step-30", True, 0.0158, 0.978), ("step-24", True, 0.0273, 0.911)]  # fmt: skip


def test_the_gain_is_the_mean_over_every_token_of_every_sample():
    effects = [np.array([1.0, 3.0]), np.array([-1.0, 1.0, 1.0])]
    assert heldout_gain(effects) == 1.0  # 5 tokens, sum 5: a long sample weighs by its tokens
    assert heldout_gain([]) is None and heldout_gain([np.zeros(0)]) is None


def gains_of(recorded, final: float) -> dict[str, float]:
    return {"final": final, **{name: gain for name, _, _, gain in recorded}}


def test_the_recorded_overfit_finals_are_looked_past_and_the_note_names_the_better_checkpoint():
    for gains, best in (
        (STOP34, "step-54"),
        (gains_of(STOP36, 0.702), "step-36"),
        (gains_of(STOP35_THIRD_SCAN, 0.659), "step-42"),
        (gains_of(STOP35_SECOND_SCAN, 0.755), "step-42"),
    ):
        note = overfit(gains)
        assert note and best in note and f"{gains[best] - gains['final']:.2f} nats" in note


def test_a_final_still_learning_or_within_the_margin_is_kept_alone():
    rising = {"final": 1.2, "step-66": 1.15, "step-60": 1.0, "final-half": 0.6}
    assert overfit(rising) == ""
    close = {"final": 1.0, "step-66": 1.0 + OVERFIT_MARGIN - 0.01}
    assert overfit(close) == ""
    assert overfit({**close, "step-60": 1.0 + OVERFIT_MARGIN}) != ""


def test_nothing_to_compare_is_no_reason_to_look_further():
    assert overfit({}) == ""
    assert overfit({"final": None, "step-6": 1.0}) == ""  # no held-out correction (a ratings night)
    assert overfit({"final": 0.5}) == ""
    assert overfit({"final": 0.5, "step-6": None}) == ""


def test_ranked_puts_the_best_reader_first_and_keeps_the_order_of_those_without_a_gain():
    order = [Candidate(n, 0, 5e-4, 0.1, {}) for n in ("step-66", "step-60", "step-54", "final-half")]
    gains = {"step-66": 0.5, "step-60": None, "step-54": 0.9, "final-half": 0.7}
    assert [c.name for c in ranked(order, gains)] == ["step-54", "final-half", "step-66", "step-60"]
    assert [c.name for c in ranked(order, {})] == [c.name for c in order]  # nothing read: newest first


def test_readings_too_close_to_tell_apart_keep_the_runs_own_order():
    # a noapology ratings night (stop 37): its held-out liked replies, read under each candidate
    noapology = {"final": -0.0016, "step-18": -0.006, "step-12": 0.0119, "step-6": 0.0165, "final-half": 0.0208}
    order = [Candidate(n, 0, 5e-4, 0.1, {}) for n in ("step-18", "step-12", "step-6", "final-half")]
    assert [c.name for c in ranked(order, noapology)] == ["step-18", "step-12", "step-6", "final-half"]
    assert overfit(noapology) == ""
    spread = {**noapology, "step-12": 0.0119 + OVERFIT_MARGIN}  # one clearly better reader
    assert ranked(order, spread)[0].name == "step-12"


def test_judging_the_best_readers_first_keeps_each_recorded_choice_in_fewer_judgements():
    def scan(recorded, order: str) -> tuple[str | None, int]:
        verdicts = {name: (passed, score) for name, passed, score, _ in recorded}
        gains = {name: gain for name, _, _, gain in recorded}

        def judge(candidate: Candidate) -> Candidate:
            candidate.passed, score = verdicts[candidate.name]
            candidate.figures = {"choice_score": score}
            return candidate

        candidates = [Candidate(name, 0, 5e-4, 0.1, {}) for name, *_ in recorded]
        if order == "ranked":
            candidates = ranked(candidates, gains)
        judged = judge_in_turn(candidates, judge, affordable=lambda: True, patience=3)
        chosen = best_passing(judged)
        return (chosen.name if chosen else None), len(judged)

    for recorded, chosen, newest_first, by_gain in (
        (STOP36, "step-30", 10, 5),
        (STOP35_THIRD_SCAN, "step-24", 11, 9),
        (STOP35_SECOND_SCAN, "step-42", 8, 4),
    ):
        assert scan(recorded, "newest") == (chosen, newest_first)
        assert scan(recorded, "ranked") == (chosen, by_gain)


def test_a_passing_final_that_overfit_is_looked_past_and_stays_the_one_to_beat():
    verdicts = {name: (passed, score) for name, passed, score, _ in STOP36}

    def judge(candidate: Candidate) -> Candidate:
        candidate.passed, score = verdicts[candidate.name]
        candidate.figures = {"choice_score": score}
        return candidate

    def night(final_passed: bool, final_gain: float, config: LearnConfig) -> tuple[list[str], str, str | None]:
        final = Candidate("final", 72, 5e-4, 0.1, {}, passed=final_passed, figures={"choice_score": 0.0})
        fallbacks = [Candidate(name, 0, 5e-4, 0.1, {}) for name, *_ in STOP36]
        judged, note = back_off(final, fallbacks, gains_of(STOP36, final_gain), judge, lambda: True, config)
        chosen = best_passing([final, *judged])
        return [c.name for c in judged], note, chosen.name if chosen else None

    # Stop 36's night, had its final (read at 0.702) passed with a score of 0.0: step 30 beats it.
    judged, note, chosen = night(True, 0.702, LearnConfig())
    assert judged == ["step-36", "step-30", "step-24", "step-42", "step-18"] and chosen == "step-30"
    assert "0.38 nats a token worse than step-36" in note
    # A final that reads best, or within the margin, is deployed alone, as before.
    assert night(True, 1.2, LearnConfig()) == ([], "", "final")
    assert night(True, 0.702, LearnConfig(overfit_margin=0.5)) == ([], "", "final")
    # A rejected final is backed off from whatever the readings, and is not the one to beat.
    judged, note, chosen = night(False, 1.2, LearnConfig())
    assert note == "" and chosen == "step-30" and judged[0] == "step-36"


# The trainer's own readings at each checkpoint of four stop-36 nights (bench/learning.py on the
# embedded model, shipped [learn], every checkpoint kept), the step the gate deployed, and the
# planned steps: (readings by step, deployed step, planned).
STOP36_CURVES = {
    "tldr": ({6: 0.3696, 12: 0.7004, 18: 0.962, 24: 1.0442, 30: 1.0833, 36: 1.084, 42: 1.0032, 48: 0.8797,
              54: 0.8752, 60: 0.8412, 66: 0.751}, 30, 72),
    "tldr-again": ({6: 0.3008, 12: 0.5478, 18: 0.7776, 24: 0.8296, 30: 0.9527, 36: 1.0866, 42: 1.0979,
                    48: 0.8938, 54: 0.8992, 60: 0.7934, 66: 0.6199}, 36, 72),
    "mixedbrief": ({6: 0.2626, 12: 0.4022, 18: 0.4974, 24: 0.5446, 30: 0.5496, 36: 0.5409, 42: 0.4012,
                    48: 0.0037, 54: 0.1068, 60: 0.1867, 66: 0.0234}, 36, 72),
    "allergy": ({6: 0.3283, 12: 0.783, 18: 1.1257, 24: 1.3634, 30: 1.4804, 36: 1.6022, 42: 1.6273,
                 48: 1.5164}, 42, 54),
}  # fmt: skip
# Stop 37's first mixedbrief night, stopped at step 36 by patience alone (no margin): its
# reading had plateaued, every candidate failed the gate, and nothing was deployed.
MIXEDBRIEF_PLATEAU = {6: 0.1758, 12: 0.2858, 18: 0.3152, 24: 0.262, 30: 0.2256, 36: 0.2692}
# The same night replayed from its store with every planned step (deterministic: the same
# readings up to step 36): the final, reading -0.25, passed the gate and served 0.75; none of
# the checkpoints up to step 36 that were judged passed.
MIXEDBRIEF_FULL = {**MIXEDBRIEF_PLATEAU, 42: 0.1771, 48: -0.0472, 54: -0.2237, 60: -0.2941, 66: -0.2726,
                   72: -0.2503}  # fmt: skip


def stops_at(readings: dict[int, float], patience: int) -> int | None:
    """The checkpoint `EarlyStop` ends training at, reading them in training order (None: never)."""
    rule = EarlyStop(patience)
    return next((step for step, gain in sorted(readings.items()) if rule.update(step, gain)), None)


def test_early_stop_ends_recorded_nights_past_their_peak_and_keeps_what_the_gate_chose():
    expected = {"tldr": 54, "tldr-again": 60, "mixedbrief": 48, "allergy": None}  # allergy peaks late: all 54
    for name, (readings, deployed, planned) in STOP36_CURVES.items():
        stop = stops_at(readings, patience=3)
        assert stop == expected[name], name
        assert deployed <= (stop or planned)  # the candidate the gate chose is still trained
    # a night stopped at 54 of 72 saves 18 steps, some 2 minutes on the embedded model
    assert sum(72 - stops_at(r, 3) for r, _, p in STOP36_CURVES.values() if p == 72) == 18 + 12 + 24


def test_a_noisy_plateau_does_not_stop_training():
    assert stops_at(MIXEDBRIEF_PLATEAU, patience=3) is None  # 3 below the best, but by under 0.1
    assert stops_at({**MIXEDBRIEF_PLATEAU, 42: 0.2}, patience=3) == 42  # then clearly fallen
    no_margin = EarlyStop(patience=3, margin=0.0)
    assert next(s for s, g in sorted(MIXEDBRIEF_PLATEAU.items()) if no_margin.update(s, g)) == 36


def test_early_stop_counts_from_the_best_and_restarts_at_a_better_one():
    rule = EarlyStop(patience=2, margin=0.1)
    assert [rule.update(s, g) for s, g in [(6, 0.5), (12, 0.4), (18, 0.6), (24, 0.6), (30, 0.45)]] == [
        False, False, False, False, True,
    ]  # fmt: skip
    assert rule.best_step == 18 and rule.readings[24] == 0.6  # a tie is no improvement
    note = rule.note(30, 72)
    assert "stopped at step 30 of 72" in note and "best at step 18 (0.60" in note
    assert "2 checkpoints since, and 0.15 worse now" in note


def test_no_reading_or_no_patience_never_stops_training():
    unread = EarlyStop(patience=1)
    assert not any(unread.update(step, None) for step in range(6, 108, 6)) and unread.readings == {}
    patient = EarlyStop(patience=0)
    assert not any(patient.update(step, 1.0 / step) for step in range(6, 108, 6))
    assert patient.best_step == 6 and len(patient.readings) == 17


def test_early_stop_is_off_by_default_because_a_lesson_can_form_while_the_reading_falls():
    """The mixedbrief night's lesson arrived at the final, long after the reading's peak: the
    rule would have ended it at step 42 of 72, 30 steps before the only candidate judged that passed."""
    assert stops_at(MIXEDBRIEF_FULL, patience=3) == 42
    assert LearnConfig().early_stop_patience == 0 and stops_at(MIXEDBRIEF_FULL, patience=0) is None
