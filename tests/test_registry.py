"""The adapter registry: versions are content-addressed and kept forever; deploy and rollback move
one pointer per slot in one transaction; a rollback restores the previous behaviour exactly."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import pytest
from conftest import write_random_adapter

from macaron_local.engine import Engine, EngineConfig
from macaron_local.errors import InvalidInputError
from macaron_local.store import open_store
from macaron_local.store.migrations import MIGRATIONS


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path / "data" / "macaron.db") as opened:
        yield opened


def test_migration_is_appended_after_the_initial_one():
    assert [m.__name__ for m in MIGRATIONS][:2] == ["m001_initial", "m002_adapter_registry"]


def test_register_deploy_and_roll_back(store, tiny_model, tmp_path):
    model = tiny_model("llama", False)
    first_file = write_random_adapter(tmp_path / "v1.gguf", model, rank=4, seed=1)
    second_file = write_random_adapter(tmp_path / "v2.gguf", model, rank=4, seed=2)
    first = store.register_adapter(first_file, slot="L0", base_model="tiny", rank=4, feedback_ids=[1, 2])
    assert first.status == "candidate" and store.deployed_adapter("L0", "tiny") is None
    stored = store.adapters_dir / f"{first.sha256}.gguf"
    assert first.path == str(stored) and stored.read_bytes() == first_file.read_bytes()
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert store.deploy_adapter(first.id).status == "deployed"

    second = store.register_adapter(
        second_file, slot="L0", base_model="tiny", rank=4, parent_id=first.id, evaluations={"after": 1.0}
    )
    store.deploy_adapter(second.id)
    assert store.deployed_adapter("L0", "tiny").id == second.id
    assert store.adapter_version(first.id).status == "retired"

    assert store.rollback_adapter("L0", "tiny").id == first.id
    assert store.adapter_version(second.id).status == "retired"
    assert store.rollback_adapter("L0", "tiny") is None  # back to the bare expert
    assert store.deployed_adapter("L0", "tiny") is None
    with pytest.raises(InvalidInputError, match="nothing to roll back"):
        store.rollback_adapter("L0", "tiny")
    assert [v.id for v in store.adapter_versions(slot="L0")] == [first.id, second.id]  # every version kept
    assert store.adapter_versions(slot="L2") == []


def test_the_versions_of_one_learning_run(store, tiny_model, tmp_path):
    model = tiny_model("llama", False)
    made = {}
    for seed, run in enumerate(["run-a", "run-b", "run-a", None], start=1):
        path = write_random_adapter(tmp_path / f"v{seed}.gguf", model, rank=4, seed=seed)
        made[seed] = store.register_adapter(path, slot="L0", base_model="tiny", rank=4, learning_run_id=run).id
    assert [v.id for v in store.adapter_versions(learning_run_id="run-a")] == [made[1], made[3]]
    assert [v.id for v in store.adapter_versions(learning_run_id="run-b")] == [made[2]]
    assert store.adapter_versions(learning_run_id="run-c") == []
    assert len(store.adapter_versions()) == 4


def test_the_same_file_is_stored_once(store, tiny_model, tmp_path):
    model = tiny_model("llama", False)
    path = write_random_adapter(tmp_path / "a.gguf", model, rank=2, seed=3)
    a = store.register_adapter(path, slot="L1", base_model="tiny", rank=2)
    b = store.register_adapter(path, slot="L1", base_model="tiny", rank=2)
    assert a.id != b.id and a.path == b.path
    assert len(list(store.adapters_dir.glob("*.gguf"))) == 1


def test_rollback_restores_the_previous_logits_exactly(store, tiny_model, tmp_path):
    model = tiny_model("qwen3", False)
    tokens = [0, 5, 17, 33, 9, 9, 41, 2]
    v1 = store.register_adapter(
        write_random_adapter(tmp_path / "1.gguf", model, rank=4, seed=4), slot="L0", base_model="tiny", rank=4
    )
    store.deploy_adapter(v1.id)
    v2 = store.register_adapter(
        write_random_adapter(tmp_path / "2.gguf", model, rank=4, seed=5),
        slot="L0",
        base_model="tiny",
        rank=4,
        parent_id=v1.id,
    )
    with Engine(EngineConfig(model_path=model.path, n_ctx=64, kv_f32=True)) as engine:

        def serve_deployed() -> np.ndarray:
            engine.set_adapters([engine.load_adapter(store.deployed_adapter("L0", "tiny").path)])
            return engine.logits(tokens)

        before = serve_deployed()
        store.deploy_adapter(v2.id)
        changed = serve_deployed()
        store.rollback_adapter("L0", "tiny")
        restored = serve_deployed()
    assert np.abs(changed - before).max() > 0.01
    assert np.array_equal(restored, before)


def test_unknown_version_is_a_clear_error(store):
    with pytest.raises(InvalidInputError, match="no adapter version"):
        store.deploy_adapter("nope")


def test_adapters_cli_lists_shows_and_rolls_back(tmp_path, tiny_model):
    from conftest import run_cli

    from macaron_local.settings import Settings
    from macaron_local.store import open_default_store

    model = tiny_model("llama", False)
    home = tmp_path / "home"
    assert run_cli("models", "add", "tiny", str(model.path), home=home).returncode == 0
    with open_default_store(Settings.load(home)) as store:
        v1 = store.register_adapter(
            write_random_adapter(tmp_path / "1.gguf", model, rank=2, seed=1), slot="L2", base_model="tiny", rank=2
        )
        store.deploy_adapter(v1.id)
        v2 = store.register_adapter(
            write_random_adapter(tmp_path / "2.gguf", model, rank=2, seed=2),
            slot="L2",
            base_model="tiny",
            rank=2,
            parent_id=v1.id,
        )
        store.deploy_adapter(v2.id)
    listed = run_cli("adapters", "list", "--model", "tiny", "--json", home=home)
    assert [(v["id"], v["status"]) for v in json.loads(listed.stdout)] == [
        (v1.id, "retired"),
        (v2.id, "deployed"),
    ]
    newest = run_cli("adapters", "list", "--model", "tiny", "--limit", "1", "--json", home=home)
    assert [v["id"] for v in json.loads(newest.stdout)] == [v2.id]  # a page, not the whole history
    assert run_cli("adapters", "list", "--model", "tiny", "--limit", "-1", home=home).returncode == 2
    rolled = run_cli("adapters", "rollback", "coding", "--model", "tiny", home=home)
    assert rolled.returncode == 0 and f"now serves {v1.id}" in rolled.stdout
    shown = run_cli("adapters", "show", v1.id, home=home)
    assert '"status": "deployed"' in shown.stdout
    empty = run_cli("adapters", "rollback", "L0", "--model", "tiny", home=home)
    assert empty.returncode == 2 and "nothing to roll back" in empty.stderr


def test_adapters_gc_removes_only_unreferenced_files(tmp_path, tiny_model):
    from conftest import run_cli

    from macaron_local.settings import Settings
    from macaron_local.store import open_default_store

    model = tiny_model("llama", False)
    home = tmp_path / "home"
    with open_default_store(Settings.load(home)) as store:
        kept = store.register_adapter(
            write_random_adapter(tmp_path / "1.gguf", model, rank=2, seed=1), slot="L0", base_model="tiny", rank=2
        )
        orphan = store.adapters_dir / ("0" * 64 + ".gguf")
        orphan.write_bytes(b"left by a crash")
    dry = run_cli("adapters", "gc", "--dry-run", home=home)
    assert dry.returncode == 0 and "would remove 1 unreferenced" in dry.stdout and orphan.exists()
    done = run_cli("adapters", "gc", home=home)
    assert done.returncode == 0 and "removed 1 unreferenced" in done.stdout
    assert not orphan.exists() and Path(kept.path).exists()


def test_a_peft_companion_lives_and_dies_with_its_gguf(store, tiny_model, tmp_path):
    """vLLM loads PEFT folders: a version may carry one (`<sha256>.peft/`), private, copied whole,
    and collected with the GGUF it belongs to."""
    from macaron_local.engine.remote.vllm import peft_folder

    model = tiny_model("llama", False)
    peft = tmp_path / "export"
    peft.mkdir()
    (peft / "adapter_config.json").write_text('{"r": 2}')
    (peft / "adapter_model.safetensors").write_bytes(b"weights")
    path = write_random_adapter(tmp_path / "a.gguf", model, rank=2, seed=5)
    with pytest.raises(InvalidInputError, match="not a PEFT folder"):
        store.register_adapter(path, slot="L0", base_model="tiny", rank=2, peft_dir=tmp_path)
    version = store.register_adapter(path, slot="L0", base_model="tiny", rank=2, peft_dir=peft)
    companion = peft_folder(Path(version.path))
    assert companion == store.adapters_dir / f"{version.sha256}.peft"
    assert (companion / "adapter_model.safetensors").read_bytes() == b"weights"
    assert stat.S_IMODE(companion.stat().st_mode) == 0o700
    assert stat.S_IMODE((companion / "adapter_config.json").stat().st_mode) == 0o600
    assert not [p for p in store.adapters_dir.iterdir() if p.name.startswith(".")]  # no temporary left

    dead = store.adapters_dir / f".{'1' * 64}.peft.999999999.tmp"  # a crashed copy, writer gone
    dead.mkdir()
    orphan = store.adapters_dir / f"{'2' * 64}.peft"  # a companion whose version is gone
    orphan.mkdir()
    report = store.collect_garbage(stale_temp_s=0.0)
    assert report.removed == [orphan.name] and report.stale_temps == [dead.name]
    assert companion.is_dir() and not orphan.exists() and not dead.exists()
