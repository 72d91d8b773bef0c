"""A nightly run gives way to the user: a chat that starts streaming, or the machine going on
battery, stops training between steps; nothing half-trained is judged or deployed, and the
feedback still counts as new for the next night."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from test_daemon_conditions import QUIET, seed_feedback  # noqa: E402

from macaron_local.catalog import Catalog  # noqa: E402
from macaron_local.daemon.conditions import new_feedback  # noqa: E402
from macaron_local.daemon.runner import run_once  # noqa: E402
from macaron_local.store import open_default_store  # noqa: E402

LEARN = {"steps": 6, "episodes_per_step": 1, "group_size": 2, "max_new_tokens": 4, "refresh_every": 10}
DAEMON = {"min_feedback": 8, "idle_minutes": 0, "max_load": 1000.0, "low_priority": False}


def after_calls(n: int, then: object, before: object):
    """A probe that reports `before` for its first n calls, then `then` (the user arrives)."""
    calls = itertools.count(1)
    return lambda *args: then if next(calls) > n else before


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"generating": after_calls(3, True, False)}, "a chat started generating"),
        ({"on_ac": after_calls(3, False, True)}, "the machine is on battery"),
    ],
    ids=["chat", "battery"],
)
def test_the_user_arriving_stops_training_and_nothing_is_deployed(home, tiny_model, change, said):
    model = tiny_model("llama", False, n_ctx_train=2048)
    Catalog(home).add_local("tiny", model.path)
    home.save(model="tiny", learn=LEARN, daemon=DAEMON)
    seed_feedback(home, 8)
    lines: list[str] = []
    run = run_once(home, skip_window=True, probe=dataclasses.replace(QUIET, **change), on_progress=lines.append)
    [slot] = run.slots
    assert slot["decision"] == "skipped" and slot["version_id"] is None
    assert slot["reason"].startswith("interrupted after ") and "of 6 steps" in slot["reason"]
    assert f"stopping: {said}" in lines
    assert sum(line.lstrip().startswith("step ") for line in lines) < 6
    with open_default_store(home) as store:
        assert store.deployed_adapter("L0", "tiny") is None and store.adapter_versions() == []
        [recorded] = store.learning_runs()
        assert recorded.status == "interrupted" and recorded.feedback_ids == []
        assert new_feedback(store) == 8  # the next night still sees all of it as new
    assert not any((home.data_dir / "learn-work").glob("run-*"))
