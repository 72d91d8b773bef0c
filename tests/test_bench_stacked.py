"""bench/stacked.py finds the adapter each home serves, and says in one line when a folder is
not a home or a home has deployed nothing (the serving itself is the engine's, tested with it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import write_random_adapter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from stacked import deployed_adapter  # noqa: E402

from macaron_local.catalog import Catalog  # noqa: E402
from macaron_local.learn.personal import PERSONAL_SLOT  # noqa: E402
from macaron_local.settings import Settings  # noqa: E402
from macaron_local.store import open_default_store  # noqa: E402


def _home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    return home


def test_the_newest_deployed_version_is_the_one_served(tmp_path, tiny_model):
    home = _home(tmp_path)
    model = tiny_model("llama", False)
    settings = Settings.load(home)
    base = Catalog(settings).default().name

    def register(store, seed: int, slot: str = PERSONAL_SLOT):
        path = write_random_adapter(tmp_path / f"{seed}.gguf", model, rank=2, seed=seed)
        return store.register_adapter(path, slot=slot, base_model=base, rank=2)

    with open_default_store(settings) as store:
        store.deploy_adapter(register(store, 1).id)
        second = register(store, 2)
        store.deploy_adapter(second.id)
        register(store, 3)  # a candidate, never deployed
        store.deploy_adapter(register(store, 4, slot="L0").id)  # an expert's slot, not the personal one
    assert deployed_adapter(home) == Path(second.path)


def test_a_folder_that_is_not_a_home_or_deployed_nothing_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="is not a macaron home"):
        deployed_adapter(tmp_path / "nowhere")
    home = _home(tmp_path)
    with pytest.raises(SystemExit, match="has deployed no personal adapter"):
        deployed_adapter(home)
