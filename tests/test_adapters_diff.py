"""`macaron adapters diff`: the weight-update distance computed from rank-sized products equals
the dense one, and the CLI reports feedback, evaluations and the largest changes."""

from __future__ import annotations

import json

import numpy as np
from conftest import run_cli, write_random_adapter

from macaron_local.adapters import read_adapter
from macaron_local.adapters.diff import diff_adapters
from macaron_local.settings import Settings
from macaron_local.store import open_default_store


def dense_updates(path) -> dict[str, np.ndarray]:
    adapter = read_adapter(path)
    return {name: pair.delta(adapter.alpha) for name, pair in adapter.pairs.items()}


def test_distance_equals_the_dense_difference_of_updates(tiny_model, tmp_path):
    model = tiny_model("llama", False)
    old = write_random_adapter(tmp_path / "old.gguf", model, rank=3, seed=1)
    new = write_random_adapter(tmp_path / "new.gguf", model, rank=5, seed=2, alpha=4.0)
    a, b = dense_updates(old), dense_updates(new)
    diff = diff_adapters(old, new)
    for change in diff.changes:
        assert np.isclose(change.distance, np.linalg.norm(b[change.tensor] - a[change.tensor]), rtol=1e-6)
        assert np.isclose(change.norm_old, np.linalg.norm(a[change.tensor]), rtol=1e-6)
    assert diff_adapters(new, new).distance <= 1e-6 * diff.norm_new
    assert np.isclose(diff_adapters(None, new).distance, diff.norm_new)


def test_cli_diff_against_the_parent_and_a_damaged_file(tiny_model, tmp_path):
    model = tiny_model("llama", False)
    home = tmp_path / "home"
    assert run_cli("models", "add", "tiny", str(model.path), home=home).returncode == 0
    with open_default_store(Settings.load(home)) as store:
        v1 = store.register_adapter(
            write_random_adapter(tmp_path / "1.gguf", model, rank=2, seed=1),
            slot="L0",
            base_model="tiny",
            rank=2,
            feedback_ids=[1, 2],
            evaluations={"heldout_reward_after": 0.2},
        )
        v2 = store.register_adapter(
            write_random_adapter(tmp_path / "2.gguf", model, rank=2, seed=2),
            slot="L0",
            base_model="tiny",
            rank=2,
            parent_id=v1.id,
            feedback_ids=[1, 2, 3, 4],
            evaluations={"heldout_reward_after": 0.5},
        )
    done = run_cli("adapters", "diff", v2.id, "--json", home=home)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["against"] == v1.id and report["feedback_added"] == [3, 4] and report["feedback_removed"] == []
    assert report["evaluations"]["heldout_reward_after"] == [0.2, 0.5]
    expected = diff_adapters(v1.path, v2.path).distance
    assert report["distance"] == expected and expected > 0

    text = run_cli("adapters", "diff", v1.id, home=home)
    assert text.returncode == 0 and "against the bare expert" in text.stdout and "largest changes" in text.stdout

    with open(v1.path, "r+b") as handle:  # damage the older file in place
        handle.seek(64)
        handle.write(b"\xff" * 64)
    broken = run_cli("adapters", "diff", v2.id, home=home)
    assert broken.returncode == 2 and len(broken.stderr.strip().splitlines()) == 1
    assert broken.stderr.startswith("error:") and "Traceback" not in broken.stderr
