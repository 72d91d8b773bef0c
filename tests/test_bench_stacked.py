"""bench/stacked.py finds the adapter each home serves, and says in one line when a folder is
not a home or a home has deployed nothing (the serving itself is the engine's, tested with it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import write_random_adapter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from stacked import deployed_adapter  # noqa: E402

from macaron_local.settings import Settings  # noqa: E402
from macaron_local.store import open_default_store  # noqa: E402


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    return home


def test_the_newest_deployed_version_is_the_one_served(tmp_path, tiny_model):
    home = _home(tmp_path)
    model = tiny_model("llama", False)
    with open_default_store(Settings.load(home)) as store:
        first = store.register_adapter(
            write_random_adapter(tmp_path / "1.gguf", model, rank=2, seed=1), slot="L0", base_model="tiny", rank=2
        )
        store.deploy_adapter(first.id)
        second = store.register_adapter(
            write_random_adapter(tmp_path / "2.gguf", model, rank=2, seed=2), slot="L0", base_model="tiny", rank=2
        )
        store.deploy_adapter(second.id)
        store.register_adapter(
            write_random_adapter(tmp_path / "3.gguf", model, rank=2, seed=3), slot="L0", base_model="tiny", rank=2
        )
    assert deployed_adapter(home) == Path(second.path)


def test_a_folder_that_is_not_a_home_or_deployed_nothing_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="is not a macaron home"):
        deployed_adapter(tmp_path / "nowhere")
    home = _home(tmp_path)
    with pytest.raises(SystemExit, match="has deployed no personal adapter"):
        deployed_adapter(home)
