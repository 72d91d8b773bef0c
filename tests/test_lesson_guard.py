"""Earlier nights' lessons held while a night learns something else (learn/lesson_guard.py):
the rows' rotation and masks alone, then on a tiny real model, a lesson taught in one night,
exported to GGUF, found by llama.cpp and held by the trainer against a correction that
contradicts it."""

from __future__ import annotations

import numpy as np
import pytest

from macaron_local.learn.lesson_guard import LessonGuard


def test_rows_rotate_within_the_steps_expert_group_and_inactive_without_a_learned_start():
    guard = LessonGuard(
        [[1], [2], [3]], [[4, 5], [6], [7, 8]], per_step=1, weight=1.0,
        masks=[[1, 0], [1], [0, 1]], groups=["", "L2", ""],
    )  # fmt: skip
    assert guard.rows(0, "") == ([[1]], [[4, 5]]) and guard.rows(1, "") == ([[3]], [[7, 8]])
    assert guard.rows(0, "L2") == ([[2]], [[6]])
    fresh = {"q.lora_A": np.ones((2, 3)), "q.lora_B": np.zeros((3, 2))}
    guard.begin(fresh)  # a night from zero has nothing earlier to hold
    assert guard.rows(0, "") == ([], [])
    guard.begin({**fresh, "q.lora_B": np.ones((3, 2))})
    assert guard.rows(0, "") == ([[1]], [[4, 5]])


def test_the_term_counts_held_tokens_only():
    torch = pytest.importorskip("torch")
    from macaron_local.learn.backends.base import make_batch

    class Numbers:  # the backend's array side, as the torch backend has it
        asarray = staticmethod(lambda a: torch.as_tensor(np.asarray(a, dtype=np.float32)))
        to_numpy = staticmethod(lambda a: a.detach().numpy())

    guard = LessonGuard([[1]], [[4, 5, 6]], per_step=1, weight=1.0, masks=[[1, 0, 1]])
    guard.begin({"q.lora_B": np.ones((1, 1))})
    batch = make_batch([[1]], [[4, 5, 6]])
    reference = np.zeros((1, 3), dtype=np.float32)  # the start gave each token probability 1
    guard.reference = lambda backend, b: torch.as_tensor(reference)
    term = guard.term(Numbers(), batch, 0, "")
    mask = torch.as_tensor(np.asarray(batch.mask, dtype=np.float32))
    # the middle token lost 5 nats but is not a lesson; the held ones lost 1 and 3
    logp = torch.tensor([[-1.0, -5.0, -3.0]])
    assert float(term(logp, mask)) == pytest.approx(2.0)
    assert float(term(torch.tensor([[0.5, -5.0, 0.0]]), mask)) == 0.0  # gains cost nothing


def test_a_taught_lesson_is_found_and_held_against_a_contradicting_night(tmp_path):
    pytest.importorskip("peft")
    from tinymodels import TinyConfig, build_tiny_model, tiny_trainer

    from macaron_local.adapters import BaseModelInfo
    from macaron_local.engine import Engine, EngineConfig
    from macaron_local.learn.backends.base import make_batch
    from macaron_local.learn.episodes import Episode
    from macaron_local.learn.export import export_gguf
    from macaron_local.learn.lesson_guard import lesson_guard
    from macaron_local.learn.loop import LearnConfig, logprobs_at, set_lora_weights, train

    tiny = build_tiny_model(tmp_path / "llama.gguf", TinyConfig(arch="llama", n_ctx_train=512))
    base = BaseModelInfo.from_gguf(tiny.path)
    backend = tiny_trainer(tiny, lr=3e-2)
    question = Episode(messages=[{"role": "user", "content": "ab"}], chosen=None, rejected=None)
    config = LearnConfig(steps=12, episodes_per_step=1, group_size=2, max_new_tokens=6, refresh_every=4, lr=3e-2)
    with Engine(EngineConfig(model_path=tiny.path, n_ctx=256, n_threads=2)) as engine:
        night_one = [Episode(messages=question.messages, chosen="ba ba", rejected="ab ab")]
        train(backend, engine, base, night_one, config, tmp_path)
        deployed_weights = backend.lora_weights()
        handle = engine.load_adapter(export_gguf(backend, base, tmp_path / "deployed.gguf"))
        guard = lesson_guard(
            engine, [question], lambda slot: [], lambda slot: [handle], lambda e: "", per_step=1, weight=8.0
        )
        assert guard.prompts and sum(map(sum, guard.masks)) >= 1  # llama.cpp sees what night 1 taught
        rows = make_batch(guard.prompts, guard.completions)
        held = np.asarray(rows.mask, dtype=bool)
        held[held] = np.concatenate([np.asarray(m, dtype=bool) for m in guard.masks])
        night_two = [Episode(messages=question.messages, chosen="cd cd", rejected="ba ba")]
        dropped, lessons_logged = {}, {}
        for guarded in (False, True):
            set_lora_weights(backend, deployed_weights)
            backend.reset_optimizer(config.lr)
            logs = []
            train(backend, engine, base, night_two, config, tmp_path, guards=[guard] if guarded else [],
                  on_step=logs.append)  # fmt: skip
            after = backend.to_numpy(backend.logprobs(rows))[held]
            start = logprobs_at(backend, rows, deployed_weights)[held]
            dropped[guarded] = float(np.mean(np.exp(start) - np.exp(after)))
            lessons_logged[guarded] = [log.lessons for log in logs]
    assert dropped[False] > 0.2  # the contradicting night takes the lesson away
    assert dropped[True] < 0.5 * dropped[False]
    assert lessons_logged[False] == [0.0] * 12 and lessons_logged[True][0] < 1e-5 < max(lessons_logged[True])


def test_lesson_settings_are_checked(home):
    from macaron_local.daemon.config import learn_config
    from macaron_local.errors import InvalidInputError

    home.save(learn={"lesson_weight": 2.0, "lesson_questions": 8})
    config = learn_config(home)
    assert (config.lesson_weight, config.lesson_questions, config.lessons_per_step) == (2.0, 8, 2)
    home.save(learn={"lesson_questions": -1})
    with pytest.raises(InvalidInputError, match="lesson_questions must be >= 0"):
        learn_config(home)


def test_lesson_questions_differ_by_night_and_carry_the_system_prompt():
    from macaron_local.learn.lesson_guard import lesson_questions

    first, again, second = (lesson_questions(16, night, "Be brief.") for night in (1, 1, 2))
    assert len(first) == 16 and [q.messages for q in first] == [q.messages for q in again]
    assert [q.messages for q in first] != [q.messages for q in second]
    assert all(q.messages[0] == {"role": "system", "content": "Be brief."} for q in first)
    assert len(lesson_questions(1000, 0, "")) == len({q.messages[-1]["content"] for q in lesson_questions(1000, 0, "")})
