"""One learning run orchestrated end to end on a tiny real model: train, export, parity, gate,
register, deploy or reject, and every step recorded."""

from __future__ import annotations

import importlib.util

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from macaron_local.catalog import Catalog  # noqa: E402
from macaron_local.learn.loop import LearnConfig  # noqa: E402
from macaron_local.learn.run import learn_once, split_by_conversation  # noqa: E402
from macaron_local.store import open_default_store  # noqa: E402

HAS_MLX = importlib.util.find_spec("mlx") is not None and importlib.util.find_spec("mlx_lm") is not None
TURN = {"model": "tiny", "expert": "L0", "route_method": "default"}


def seed(store, n: int) -> None:
    for i in range(n):
        conversation = store.new_conversation("tiny")
        question = store.add_message(conversation, "user", f"ab {i}")
        reply, _ = store.add_reply(conversation, question, "cd cd", TURN)
        store.add_feedback(reply, "correction", text=f"ba {i} ba")


@pytest.mark.parametrize(
    "backend", ["torch", pytest.param("mlx", marks=pytest.mark.skipif(not HAS_MLX, reason="no mlx"))]
)
def test_a_run_is_gated_registered_and_recorded(home, tiny_model, backend):
    model = tiny_model("llama", False, n_ctx_train=2048)
    catalog = Catalog(home)
    manifest = catalog.add_local("tiny", model.path)
    with open_default_store(home) as store:
        seed(store, 8)
        config = LearnConfig(
            steps=2, episodes_per_step=2, group_size=2, max_new_tokens=4, refresh_every=1, backend=backend
        )
        [report] = learn_once(store, catalog, manifest, config)
        assert report.slot == "personal" and report.decision in ("deployed", "rejected") and report.reason
        assert report.metrics["train_episodes"] == 6 and report.metrics["heldout_episodes"] == 2
        # A float32 base: both sides agree to float32 rounding (MLX fuses norm and rope differently).
        assert report.metrics["parity_max_abs_diff"] <= 5e-3
        # The trainer read the 2 held-out corrections under the final and the step-1 checkpoint.
        assert {"final", "step-1", "final-half"} <= set(report.metrics["heldout_logprob_gain"])
        timing = report.metrics
        assert timing["rollout_s"] >= 0 and timing["trainer_s"] >= 0  # rounded to 0.1 s: a tiny run can show 0.0
        assert timing["rollout_s"] + timing["trainer_s"] <= timing["train_s"] + 0.1  # parts of it
        [run] = store.learning_runs()
        assert run.decision == report.decision and run.adapter_version == report.version_id
        assert sorted(run.feedback_ids) == list(range(1, 9))
        version = store.adapter_version(report.version_id)
        deployed = store.deployed_adapter("personal", "tiny")
        if report.decision == "deployed":
            assert version.status == "deployed" and deployed.id == version.id
        else:
            assert version.status == "rejected" and deployed is None


@pytest.mark.parametrize("patience", [1, 0])
def test_training_stops_once_the_held_out_corrections_stop_reading_better(home, tiny_model, patience):
    """A step size large enough that the tiny model overshoots within a few steps: with patience 1
    the night stops at the first checkpoint that reads worse, is gated like any other, and
    consumes its feedback; with patience 0 it trains every planned step."""
    model = tiny_model("llama", False, n_ctx_train=2048)
    catalog = Catalog(home)
    manifest = catalog.add_local("tiny", model.path)
    config = LearnConfig(
        steps=8, min_steps=8, episodes_per_step=2, group_size=2, max_new_tokens=4, refresh_every=1,
        backend="torch", lr=1e-1, early_stop_patience=patience, overfit_margin=0.05,
    )  # fmt: skip
    with open_default_store(home) as store:
        seed(store, 8)
        notices: list[str] = []
        [report] = learn_once(store, catalog, manifest, config, on_notice=notices.append)
        [run] = store.learning_runs()
    metrics = report.metrics
    assert notices == ([metrics["early_stop"]] if patience else [])  # the user is told why it ended early
    assert run.status == "done" and sorted(run.feedback_ids) == list(range(1, 9))  # consumed, not interrupted
    assert report.decision in ("deployed", "rejected") and metrics["planned_steps"] == 8
    gains, stopped = metrics["heldout_logprob_gain"], metrics["steps"]
    names = [c["name"] for c in metrics["candidates"]]
    assert len(names) == len(set(names))
    if patience == 0:
        assert stopped == 8 and "early_stop" not in metrics and "step-7" in gains
        return
    assert stopped < 8 and f"step-{stopped}" not in gains  # the final is that checkpoint, read once
    best = max((n for n in gains if n.startswith("step-")), key=gains.__getitem__)
    assert gains["final"] < gains[best]  # it stopped past the peak
    assert f"stopped at step {stopped} of 8" in metrics["early_stop"]
    assert f"best at step {best[5:]} ({gains[best]:.2f}" in metrics["early_stop"]


def test_a_ratings_night_is_not_read_on_the_replies_the_model_sampled(home, tiny_model):
    """Up-votes are replies the model gave itself: they read lower as training sharpens the
    policy, whatever it learned, so a night of ratings alone has no held-out reading (no
    overfit look, the back-off in its own order)."""
    model = tiny_model("llama", False, n_ctx_train=2048)
    catalog = Catalog(home)
    manifest = catalog.add_local("tiny", model.path)
    with open_default_store(home) as store:
        for i in range(8):
            conversation = store.new_conversation("tiny")
            question = store.add_message(conversation, "user", f"ab {i}")
            reply, _ = store.add_reply(conversation, question, "cd cd" if i % 2 else "ba ba", TURN)
            store.add_feedback(reply, "rating", value=-1 if i % 2 else 1)
        config = LearnConfig(steps=2, episodes_per_step=2, group_size=2, max_new_tokens=4, refresh_every=1)
        [report] = learn_once(store, catalog, manifest, config)
    assert report.decision in ("deployed", "rejected") and report.metrics["heldout_episodes"] == 2
    assert report.metrics["heldout_logprob_gain"] == {} and "overfit" not in report.metrics


def test_too_little_feedback_is_skipped(home, tiny_model):
    model = tiny_model("llama", False, n_ctx_train=2048)
    catalog = Catalog(home)
    manifest = catalog.add_local("tiny2", model.path)
    with open_default_store(home) as store:
        seed(store, 2)
        [report] = learn_once(store, catalog, manifest, LearnConfig(steps=1))
    assert report.decision == "skipped" and "too few" in report.reason


def test_held_out_episodes_are_whole_conversations():
    from macaron_local.learn.episodes import Episode

    episodes = [Episode([], "a", "b", conversation_id=f"c{i // 2}") for i in range(16)]
    train, held = split_by_conversation(episodes)
    assert {e.conversation_id for e in train}.isdisjoint({e.conversation_id for e in held})
    assert len(held) == 4 and len(train) == 12


def test_macaron_learn_shows_progress_and_the_decision(tmp_path, tiny_model):
    from conftest import run_cli

    from macaron_local.settings import Settings

    model = tiny_model("llama", False, n_ctx_train=2048)
    home = tmp_path / "home"
    assert run_cli("models", "add", "tiny", str(model.path), home=home).returncode == 0
    with open_default_store(Settings.load(home)) as store:
        seed(store, 8)
    # The gate's back-off on random weights would spend its whole budget (300 s): a short one here.
    (home / "config" / "settings.toml").write_text("[learn]\nbackoff_s = 20.0\n")
    done = run_cli("learn", "--model", "tiny", "--steps", "2", "--backend", "torch", home=home)
    assert done.returncode == 0, done.stderr
    progress = [line for line in done.stderr.splitlines() if line.startswith("learning (torch)")]
    assert [line.split()[3] for line in progress] == ["1/2", "2/2"]  # one line per step when piped
    [decision] = [line for line in done.stdout.splitlines() if line.startswith("personal: ")]
    assert decision.split()[1].rstrip(":") in ("deployed", "rejected") and " as " in decision
    with open_default_store(Settings.load(home)) as store:
        assert len(store.learning_runs()) == 1 and not any((home / "data").rglob("run-*"))


def test_progress_bar_redraws_in_place_on_a_terminal():
    import io

    from macaron_local.cli.progress import ProgressBar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    bar = ProgressBar(4, label="learning", stream=stream, width=8)
    bar.update(1, "loss 2.0")
    bar.update(4, "loss 1.0")
    bar.finish()
    text = stream.getvalue()
    assert text.count("\r\x1b[2K") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "learning ████████ 4/4 loss 1.0" in text and "██░░░░░░ 1/4" in text
