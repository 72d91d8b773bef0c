"""The personal adapter across experts, backing off, and forgetting, on a tiny real model with
two GGUF expert adapters (L0 and L2): one adapter learns from every expert's turns, each
trained with its own expert underneath, and serves on whichever expert a turn routes to;
every candidate the gate tries is recorded; `forget` withdraws what learned a conversation."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tomli_w

pytest.importorskip("torch")
pytest.importorskip("peft")

from conftest import run_cli, write_random_adapter  # noqa: E402
from tinymodels import tiny_trainer  # noqa: E402

from macaron_local.adapters import BaseModelInfo  # noqa: E402
from macaron_local.catalog import Catalog  # noqa: E402
from macaron_local.engine import Engine, EngineConfig, GenerationParams  # noqa: E402
from macaron_local.learn.backends.base import make_batch  # noqa: E402
from macaron_local.learn.episodes import episodes_from_store  # noqa: E402
from macaron_local.learn.loop import LearnConfig, completion_tokens  # noqa: E402
from macaron_local.learn.personal import PERSONAL_SLOT  # noqa: E402
from macaron_local.learn.plan import plan_night  # noqa: E402
from macaron_local.learn.run import Candidate, Experts, learn_once, to_deploy  # noqa: E402
from macaron_local.protocol.options import resolve_profile
from macaron_local.protocol.views import system_message
from macaron_local.session import Session  # noqa: E402
from macaron_local.store import open_default_store  # noqa: E402

GREEDY = GenerationParams(max_tokens=6, temperature=0.0, min_p=0.0)
FACT = "ba ba ba"


def config(**kw) -> LearnConfig:
    return LearnConfig(
        **{
            "steps": 6,
            "min_steps": 1,
            "episodes_per_step": 2,
            "group_size": 2,
            "max_new_tokens": 4,
            "refresh_every": 2,
            "lr": 2e-2,
            "rank": 4,
            "alpha": 8.0,
            "backend": "torch",
            **kw,
        }
    )


@pytest.fixture
def experts_home(home, tiny_model, tmp_path):
    model = tiny_model("llama", False, n_ctx_train=2048)
    adapters = {
        slot: write_random_adapter(tmp_path / f"{slot}.gguf", model, rank=4, seed=seed, magnitude=1.5)
        for slot, seed in (("L0", 41), ("L2", 42))
    }
    manifest = {
        "name": "tiny",
        "architecture": "llama",
        "base": {"source": "path", "file": str(model.path)},
        "experts": {
            "L0": {"name": "Chat", "source": "path", "file": str(adapters["L0"])},
            "L1": {"name": "Agent"},
            "L2": {"name": "Coding", "source": "path", "file": str(adapters["L2"])},
            "L3": {"name": "UI"},
        },
    }
    home.user_manifests_dir.mkdir(parents=True, exist_ok=True)
    (home.user_manifests_dir / "tiny.toml").write_text(tomli_w.dumps(manifest))
    catalog = Catalog(home)
    return home, model, adapters, catalog, catalog.get("tiny")


def seed(store, n: int, expert: str, first: int = 0) -> list[str]:
    """n conversations whose reply (by `expert`) the user corrected to the same fact."""
    conversations = []
    for i in range(first, first + n):
        conversation = store.new_conversation("tiny")
        question = store.add_message(conversation, "user", f"ab {i}")
        reply, _ = store.add_reply(conversation, question, "cd cd", {"model": "tiny", "expert": expert})
        store.add_feedback(reply, "correction", text=FACT)
        conversations.append(conversation)
    return conversations


def fact_logprob(engine: Engine, adapters, prompt: str) -> float:
    engine.set_adapters(adapters)
    prompt_tokens, reply = completion_tokens(engine, [{"role": "user", "content": prompt}], FACT)
    return float(engine.token_logprobs(prompt_tokens, reply).sum())


def test_the_trainer_carries_each_episodes_own_expert_underneath(experts_home):
    """Folding an expert in (and out again, after the LoRA is added) makes the trainer compute
    what llama.cpp serves with that expert stacked: the reference the personal LoRA trains on."""
    _, model, adapters, catalog, manifest = experts_home
    base = BaseModelInfo.from_gguf(model.path)
    backend = tiny_trainer(model, rank=2)
    with Engine(EngineConfig(model_path=model.path, n_ctx=256, kv_f32=True)) as engine:
        experts = Experts(engine, catalog, manifest, base)
        experts.backend = backend
        prompt, reply = completion_tokens(engine, [{"role": "user", "content": "ab"}], FACT)
        batch = make_batch([prompt], [reply])
        mask = np.asarray(batch.mask[0]) > 0
        for group, slot in ((str(adapters["L2"]), "L2"), (str(adapters["L0"]), "L0"), ("", None)):
            handles = experts.underneath(group)
            assert [h.path for h in handles] == ([adapters[slot]] if slot else [])
            engine.set_adapters(handles)
            served = engine.token_logprobs(prompt, reply)
            trained = backend.to_numpy(backend.reference_logprobs(batch))[0][mask]
            assert np.abs(served - trained).max() < 2e-3, slot


def test_one_personal_adapter_learns_from_every_expert_and_serves_on_any(experts_home):
    home, model, adapters, catalog, manifest = experts_home
    with open_default_store(home) as store:
        seed(store, 6, "L0")
        seed(store, 4, "L2", first=6)
        [report] = learn_once(store, catalog, manifest, config())
        assert (
            report.slot == PERSONAL_SLOT and report.metrics["train_episodes"] + report.metrics["heldout_episodes"] == 10
        )
        version = store.adapter_version(report.version_id)
        if report.decision != "deployed":  # the gate's call on random weights is not the point here
            store.deploy_adapter(version.id)
    # Taught in L0 and L2 turns, it holds in a turn routed to L2 and in one routed to L0.
    with Engine(EngineConfig(model_path=model.path, n_ctx=256, kv_f32=True)) as engine:
        personal = engine.load_adapter(version.path)
        for slot, prompt in (("L2", "fix this python bug"), ("L0", "hello there")):
            expert = engine.load_adapter(adapters[slot])
            assert fact_logprob(engine, [expert, personal], prompt) > fact_logprob(engine, [expert], prompt) + 1.0
    with Session(home, model="tiny", engine_config={"n_ctx": 256, "kv_f32": True}) as session:
        reply = session.send("fix this python bug", expert="L2", params=GREEDY).wait()
        assert reply.route.slot == "L2" and reply.adapters == (adapters["L2"].name, f"personal {version.id}")
        assert [h.path.name for h in session.adapters_for("L1")] == [version.path.rsplit("/", 1)[-1]]


def test_every_candidate_is_recorded_and_the_best_passing_one_is_deployed(experts_home):
    home, _, _, catalog, manifest = experts_home
    with open_default_store(home) as store:
        seed(store, 8, "L0")
        # An overshooting step size: the first candidate (the mean of steps 4 and 6) is unlikely
        # to pass, so the run backs off.
        [report] = learn_once(store, catalog, manifest, config(lr=0.5, backoff_s=600))
        [run] = store.learning_runs()
        candidates = run.metrics["candidates"]
        versions = [v for v in store.adapter_versions() if v.learning_run_id == run.id]
        assert sorted(v.evaluations["candidate"]["name"] for v in versions) == sorted(c["name"] for c in candidates)
        assert candidates[0]["name"] == "average" and candidates[0]["averaged_steps"] == [4, 6]
        assert all("heldout_reward_after" in c for c in candidates)
        if not candidates[0]["passed"]:  # the final, checkpoints at steps 4 and 2, the final at half strength
            judged = [c["name"] for c in candidates[1:5]]
            assert sorted(judged) == ["final", "final-half", "step-2", "step-4"]
            gains = run.metrics["heldout_logprob_gain"]  # judged best reader of the held-out corrections first
            assert [gains[name] for name in judged] == sorted((gains[name] for name in judged), reverse=True)
            assert all(c["reasons"] for c in candidates if not c["passed"])
        passed = [c for c in candidates if c["passed"]]
        deployed = store.deployed_adapter(PERSONAL_SLOT, "tiny")
        assert (report.decision == "deployed") == bool(passed) == (deployed is not None)
        if passed:  # the choice rule (run.to_deploy) over the recorded figures picks what was deployed
            recorded = [
                Candidate(c["name"], c["step"], c["lr"], c["kl_beta"], {}, c["scale"], c["passed"], figures=c)
                for c in candidates
            ]
            best, _ = to_deploy(recorded)
            assert deployed.evaluations["candidate"]["name"] == best.name == run.metrics["chosen"]
            assert sum(v.status == "deployed" for v in versions) == 1


def test_a_continued_night_holds_the_deployed_versions_lessons_on_everyday_requests(experts_home):
    """The run-level path of learn/lesson_guard.py: off on a night from zero, and on a night that
    continues a deployed version (lesson_weight > 0) the deployed version's taught tokens on
    everyday requests ride in the steps and are recorded in the run's figures."""
    home, _, _, catalog, manifest = experts_home
    with open_default_store(home) as store:
        seed(store, 8, "L0")
        night_one_logs: list = []
        [night1] = learn_once(store, catalog, manifest, config(lesson_weight=1.0), on_step=night_one_logs.append)
        assert (night1.metrics["lesson_rows"], night1.metrics["lesson_tokens"]) == (0, 0)  # nothing to hold yet
        assert night_one_logs and all(log.lessons == 0.0 for log in night_one_logs)
        if night1.decision != "deployed":
            store.deploy_adapter(night1.version_id)
        seed(store, 8, "L0", first=8)
        logs: list = []
        [night2] = learn_once(
            store, catalog, manifest, config(lesson_weight=1.0, lesson_questions=6), on_step=logs.append
        )
        assert night2.metrics["start"].startswith("continued from the deployed version")
        rows, tokens = night2.metrics["lesson_rows"], night2.metrics["lesson_tokens"]
        assert 1 <= rows <= 6 and tokens >= rows  # each kept answer has at least one taught token
        assert logs[0].lessons < 1e-4 < max(log.lessons for log in logs)  # held to where the night began


@pytest.mark.parametrize("weight", [0.0, 1.0])
def test_the_anchor_hold_rides_in_the_steps_only_when_it_is_turned_on(experts_home, monkeypatch, weight):
    """The run-level path of learn/anchor_hold.py: off (the default), no held tokens and a zero
    term; on, the anchors' held tokens are counted in the run's figures and the term is logged.
    The tiny random model is sure of no token, so here every text token after the first counts
    as known."""
    monkeypatch.setattr("macaron_local.learn.anchor_hold.KNOWN_MIN_P", 1e-12)
    home, _, _, catalog, manifest = experts_home
    with open_default_store(home) as store:
        seed(store, 8, "L0")
        logs: list = []
        [night] = learn_once(store, catalog, manifest, config(anchor_hold_weight=weight), on_step=logs.append)
    held, anchors = night.metrics["anchor_hold_tokens"], night.metrics["anchor_episodes"]
    assert logs and anchors >= 1
    if weight == 0.0:
        assert held == 0 and all(log.anchor_hold == 0.0 for log in logs)
    else:
        assert held >= anchors and max(log.anchor_hold for log in logs) > 0.0


def test_forget_withdraws_every_version_that_learned_it_and_the_next_night_retrains_without_it(experts_home):
    home, model, adapters, catalog, manifest = experts_home
    with open_default_store(home) as store:
        taught = seed(store, 8, "L0")
        [night1] = learn_once(store, catalog, manifest, config())
        first = store.adapter_version(night1.version_id)
        if night1.decision != "deployed":
            store.deploy_adapter(first.id)
        seed(store, 8, "L0", first=8)
        [night2] = learn_once(store, catalog, manifest, config())
        assert night2.metrics["start"].startswith("continued from the deployed version")
        # Night 1's held-out corrections (when night 1 was deployed by the gate itself, so its
        # held-out set counts as taught) are read teacher-forced for what it taught (learn.retention).
        for candidate in night2.metrics["candidates"]:
            assert ("taught_drop" in candidate) == (candidate["old_heldout_episodes"] > 0)
            assert (candidate["old_heldout_episodes"] > 0) == (night1.decision == "deployed")
        second = store.adapter_version(night2.version_id)
        if night2.decision != "deployed":
            store.deploy_adapter(second.id)
        assert second.parent_id == first.id
        files = {v.id: v.path for v in store.adapter_versions()}

    def greedy() -> tuple[str, tuple[str, ...]]:
        with Session(home, model="tiny", engine_config={"n_ctx": 256, "kv_f32": True}) as session:
            reply = session.send("ab 1", expert="L0", params=GREEDY).wait()
            return reply.text, reply.adapters

    _, served = greedy()
    assert served == (adapters["L0"].name, f"personal {second.id}")
    trained_on = next(c for c in taught if c not in night1.metrics["heldout_conversations"])
    done = run_cli("forget", trained_on, home=home.data_dir.parent)
    assert done.returncode == 0, done.stderr
    line = done.stdout.splitlines()[0]
    assert line.startswith(f"forgot conversation {trained_on}") and "personal now serves the bare expert" in line
    bare, served = greedy()
    assert served == (adapters["L0"].name,)
    with Engine(EngineConfig(model_path=model.path, n_ctx=256, kv_f32=True)) as engine:
        engine.set_adapters([engine.load_adapter(adapters["L0"])])
        system = [system_message("You are a helpful assistant.", resolve_profile(manifest))]  # the answer hop's
        tokens, _ = engine.prompt_for([*system, {"role": "user", "content": "ab 1"}], GREEDY.max_tokens)
        assert bare == engine.generate(tokens, GREEDY).text  # exactly what the bare expert says
    with open_default_store(home) as store:
        assert store.deployed_adapter(PERSONAL_SLOT, "tiny") is None
        for version_id, path in files.items():  # both nights (the second grew from the first)
            assert not Path(path).exists(), version_id
            assert f"forgotten conversation {trained_on}" in store.forgotten_reason(version_id)
        assert all(run.tainted for run in store.learning_runs())
        assert store.damaged_adapter_files() == []  # deleted on purpose: not damage
        forgotten_ids = {i for run in store.learning_runs() for i in run.feedback_ids} - {
            item.feedback.id for item in store.feedback_rows()
        }
        # The next night (its plan: learn_once trains exactly this) retrains the rest from zero.
        night3 = plan_night(episodes_from_store(store), store.learning_runs(), config())
        assert not set(night3.feedback_ids) & forgotten_ids and night3.skipped is None
        assert len(night3.new_train) + len(night3.held_new) == 15 and not night3.replay and not night3.held_old
