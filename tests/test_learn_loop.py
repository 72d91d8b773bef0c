"""The learning loop end to end on a tiny real model: the engine samples, the corrections join
each group, the trainer steps, rollout adapters are exported and swapped, and the policy moves
toward the corrections while staying close to the base."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from tinymodels import TinyConfig, build_tiny_model, tiny_trainer  # noqa: E402

from macaron_local.adapters import BaseModelInfo  # noqa: E402
from macaron_local.engine import Engine, EngineConfig  # noqa: E402
from macaron_local.learn.backends.base import make_batch  # noqa: E402
from macaron_local.learn.episodes import Episode  # noqa: E402
from macaron_local.learn.loop import (  # noqa: E402
    LearnConfig,
    completion_tokens,
    sample_night,
    train,
    train_on_rollouts,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("loop") / "llama.gguf", TinyConfig(arch="llama", n_ctx_train=512))


TWO_CORRECTIONS = [
    Episode(messages=[{"role": "user", "content": "ab"}], chosen="ba ba", rejected="ab ab"),
    Episode(messages=[{"role": "user", "content": "cd"}], chosen="dc dc", rejected="cd cd"),
]


def test_train_moves_toward_corrections_and_cleans_up(tiny, tmp_path):
    episodes = TWO_CORRECTIONS
    backend = tiny_trainer(tiny, lr=2e-2)
    base = BaseModelInfo.from_gguf(tiny.path)
    with Engine(EngineConfig(model_path=tiny.path, n_ctx=256, n_threads=2)) as engine:
        pairs = [completion_tokens(engine, e.messages, e.chosen) for e in episodes]
        batch = make_batch([p for p, _ in pairs], [c for _, c in pairs])
        mask = np.asarray(batch.mask) > 0

        def chosen_logprob() -> float:
            return float(backend.logprobs(batch).detach().numpy()[mask].sum())

        before = chosen_logprob()
        logs = []
        config = LearnConfig(steps=8, episodes_per_step=2, group_size=2, max_new_tokens=6, refresh_every=3, lr=2e-2)
        result = train(backend, engine, base, episodes, config, tmp_path, on_step=logs.append)
        assert len(result.steps) == 8 and result.trainer_tokens > 0 and result.trainer_tokens_per_s > 0
        assert chosen_logprob() > before + 1.0
        assert all(np.isfinite([log.loss, log.kl]).all() for log in logs)
        assert engine.active == ()  # rollout adapters are switched off and freed
        assert sorted(p.name for p in tmp_path.glob("rollout-*.gguf")) == ["rollout-3.gguf", "rollout-6.gguf"]
    # the chat template's end-of-turn is part of what is learned
    assert pairs[0][1][-1] != pairs[0][1][0]


def test_a_checkpoint_can_end_training_early_in_both_memory_plans(tiny, tmp_path):
    """`at_checkpoint` is asked at each checkpoint kept; when it says stop, training ends there,
    and that checkpoint (now the final) is not kept twice."""
    config = LearnConfig(steps=8, episodes_per_step=2, group_size=2, max_new_tokens=4, refresh_every=3, lr=1e-2)
    base = BaseModelInfo.from_gguf(tiny.path)
    with Engine(EngineConfig(model_path=tiny.path, n_ctx=256, n_threads=2)) as engine:
        asked: list[int] = []

        def stop_at_six(step: int) -> bool:
            asked.append(step)
            return step >= 6

        together = train(
            tiny_trainer(tiny, lr=1e-2), engine, base, TWO_CORRECTIONS, config, tmp_path,
            checkpoint_every=3, at_checkpoint=stop_at_six,
        )  # fmt: skip
        rollouts, _ = sample_night(engine, TWO_CORRECTIONS, config, steps=8)
    assert asked == [3, 6] and len(together.steps) == 6 and together.stopped_early
    assert [c.step for c in together.checkpoints] == [3]
    asked.clear()
    sequential = train_on_rollouts(
        tiny_trainer(tiny, lr=1e-2), rollouts, config, checkpoint_every=3, at_checkpoint=stop_at_six
    )
    assert asked == [3, 6] and len(sequential.steps) == 6 and sequential.stopped_early
    assert [c.step for c in sequential.checkpoints] == [3]
    never = train_on_rollouts(tiny_trainer(tiny, lr=1e-2), rollouts, config, checkpoint_every=3, at_checkpoint=None)
    assert len(never.steps) == 8 and not never.stopped_early and [c.step for c in never.checkpoints] == [3, 6]


def test_train_refuses_episodes_without_a_verdict(tiny, tmp_path):
    backend = tiny_trainer(tiny, rank=2)
    with Engine(EngineConfig(model_path=tiny.path, n_ctx=128)) as engine, pytest.raises(ValueError, match="chosen"):
        train(
            backend,
            engine,
            BaseModelInfo.from_gguf(tiny.path),
            [Episode([{"role": "user", "content": "x"}], None, None)],
            LearnConfig(steps=1),
            tmp_path,
        )


def test_down_votes_alone_push_away_from_the_disliked_reply(tiny, tmp_path):
    """Ratings with no correction still teach: the disliked reply joins its group as the worst
    member, so its probability falls (and a liked one's rises), KTO-like, with no pair."""
    disliked = [Episode([{"role": "user", "content": w}], None, "ab ab ab") for w in ("cd", "ef", "gh")]
    liked = [Episode([{"role": "user", "content": "ij"}], "ba", None)]
    backend = tiny_trainer(tiny, lr=2e-2)
    base = BaseModelInfo.from_gguf(tiny.path)
    with Engine(EngineConfig(model_path=tiny.path, n_ctx=256, n_threads=2)) as engine:
        pairs = [completion_tokens(engine, e.messages, e.rejected or e.chosen) for e in [*disliked, *liked]]
        batch = make_batch([p for p, _ in pairs], [c for _, c in pairs])
        mask = np.asarray(batch.mask) > 0
        rows = np.arange(len(pairs))[:, None] * np.ones_like(mask)

        def logprob(which) -> float:
            values = backend.logprobs(batch).detach().numpy()
            return float(values[mask & which(rows)].sum())

        down_before, up_before = logprob(lambda r: r < 3), logprob(lambda r: r == 3)
        config = LearnConfig(steps=8, episodes_per_step=2, group_size=2, max_new_tokens=6, refresh_every=4, lr=2e-2)
        train(backend, engine, base, [*disliked, *liked], config, tmp_path)
        assert logprob(lambda r: r < 3) < down_before - 1.0
        assert logprob(lambda r: r == 3) > up_before


def test_a_continued_night_is_held_to_where_it_started_not_to_the_base(tiny, tmp_path):
    """Warm-started from a deployed version, the KL term measures tonight's change only: at the
    first step the policy is the reference (KL 0), where a KL to the base would already pull
    the earlier nights' lessons back. The swap that computes the reference restores the LoRA."""
    import dataclasses

    from macaron_local.learn.loop import logprobs_at

    episodes = [Episode(messages=[{"role": "user", "content": "ab"}], chosen="ba ba", rejected="ab ab")]
    backend = tiny_trainer(tiny, lr=2e-2)
    rng = np.random.default_rng(0)
    deployed = {
        name: values if name.endswith("lora_A") else rng.normal(0.0, 0.2, values.shape)
        for name, values in backend.lora_weights().items()
    }
    base = BaseModelInfo.from_gguf(tiny.path)
    config = LearnConfig(steps=1, episodes_per_step=1, group_size=2, max_new_tokens=6, refresh_every=3, lr=2e-2)
    first_kl = {}
    with Engine(EngineConfig(model_path=tiny.path, n_ctx=256, n_threads=2)) as engine:
        for reference in ("deployed", "base"):
            for name, values in deployed.items():
                backend.set_lora_weight(name, values)
            result = train(
                backend, engine, base, episodes, dataclasses.replace(config, kl_reference=reference), tmp_path
            )
            first_kl[reference] = result.steps[0].kl
        pairs = [completion_tokens(engine, e.messages, e.chosen) for e in episodes]
    assert abs(first_kl["deployed"]) < 1e-6 < 1e-3 < first_kl["base"]
    batch = make_batch([p for p, _ in pairs], [c for _, c in pairs])
    trained = backend.lora_weights()
    at_deployed = logprobs_at(backend, batch, deployed)
    assert all(np.array_equal(trained[n], v) for n, v in backend.lora_weights().items())
    now = backend.to_numpy(backend.logprobs(batch))
    assert not np.allclose(at_deployed, now)  # the swap really served the other weights


def test_kl_reference_is_a_known_choice():
    from macaron_local.learn.loop import kl_reference_weights

    start = {"q.lora_A": np.ones((2, 3)), "q.lora_B": np.zeros((3, 2))}
    assert kl_reference_weights(start, LearnConfig()) is None  # a fresh LoRA is the base
    warm = {**start, "q.lora_B": np.ones((3, 2))}
    assert kl_reference_weights(warm, LearnConfig()) is warm
    assert kl_reference_weights(warm, LearnConfig(kl_reference="base")) is None
    with pytest.raises(ValueError, match="kl_reference"):
        kl_reference_weights(warm, LearnConfig(kl_reference="last"))


def test_passages_in_the_batch_hold_plain_text_to_the_base(tiny, tmp_path):
    """The same night with and without the passage term (learn/passages.py): with it, the
    passages' log-probabilities stay closer to the bare model's, the step logs the term, and
    the corrections are still learned."""
    from macaron_local.learn.passages import PassageGuard, passage_tokens

    episodes = TWO_CORRECTIONS
    backend = tiny_trainer(tiny, lr=3e-2)
    start = backend.lora_weights()
    base = BaseModelInfo.from_gguf(tiny.path)
    config = LearnConfig(steps=10, episodes_per_step=2, group_size=2, max_new_tokens=6, refresh_every=5, lr=3e-2)
    with Engine(EngineConfig(model_path=tiny.path, n_ctx=256, n_threads=2)) as engine:
        texts = ["xyz wvu xyz", "qrs tuv qrs tuv", "mno pq mno", "zyx uvw zyx"]
        tokens = passage_tokens(engine, texts)
        plain = make_batch([t[:1] for t in tokens], [t[1:] for t in tokens])
        chosen = make_batch(*zip(*[completion_tokens(engine, e.messages, e.chosen) for e in episodes], strict=True))
        bare_plain = backend.to_numpy(backend.reference_logprobs(plain)).sum()
        bare_chosen = backend.to_numpy(backend.reference_logprobs(chosen)).sum()
        lost, learned, logged = {}, {}, {}
        for guarded in (False, True):
            for name, values in start.items():
                backend.set_lora_weight(name, values)
            backend.reset_optimizer(config.lr)
            guard = PassageGuard(tokens, per_step=2, weight=4.0) if guarded else None
            logs = []
            train(
                backend, engine, base, episodes, config, tmp_path, guards=[guard] if guard else (), on_step=logs.append
            )
            lost[guarded] = bare_plain - backend.to_numpy(backend.logprobs(plain)).sum()
            learned[guarded] = backend.to_numpy(backend.logprobs(chosen)).sum() - bare_chosen
            logged[guarded] = [log.passages for log in logs]
    assert lost[False] > 0.5  # the corrections alone move plain text away from the base
    assert lost[True] < 0.5 * lost[False]
    assert learned[True] > 1.0 and learned[False] > 1.0
    # at the first step the policy is the base: nothing lost yet (up to float32 rounding)
    assert logged[False] == [0.0] * 10 and logged[True][0] < 1e-5 < max(logged[True])


def test_a_passage_guard_rotates_and_scores_its_reference_once_per_expert_group(tiny):
    from macaron_local.learn.passages import PassageGuard

    guard = PassageGuard([[0, 5, 6], [0, 7], [0, 8, 9, 10], [0]], per_step=2, weight=1.0)
    assert len(guard.prompts) == 3  # a passage of one token has nothing to score
    assert [guard.indices(s) for s in range(3)] == [[0, 1], [2, 0], [1, 2]]
    assert guard.rows(1) == ([[0], [0]], [[8, 9, 10], [5, 6]])
    assert PassageGuard([[0, 5]], per_step=2, weight=0.0).per_step == 0  # weight 0: no rows at all

    backend = tiny_trainer(tiny, rank=2)
    calls = []
    scored = backend.reference_logprobs
    backend.reference_logprobs = lambda batch: calls.append(batch) or scored(batch)
    first = guard._reference_for(backend, "", 2)
    again = guard._reference_for(backend, "", 2)
    guard._reference_for(backend, "L2", 2)
    assert len(calls) == 2 and first is again and first.shape == (3,)
    expected = backend.to_numpy(scored(make_batch([[0]], [[8, 9, 10]])))[0][:3]
    np.testing.assert_allclose(first, expected)
