"""Settings paths and files, and model manifests."""

from __future__ import annotations

import stat

import pytest

from macaron_local.catalog import SLOTS, Catalog, Manifest, builtin_manifest_dir
from macaron_local.errors import InvalidInputError, ModelError
from macaron_local.settings import Settings


def test_macaron_home_relocates_everything(tmp_path, monkeypatch):
    monkeypatch.setenv("MACARON_HOME", str(tmp_path))
    settings = Settings.load()
    settings.ensure_dirs()
    for path in (settings.data_dir, settings.config_dir, settings.cache_dir, settings.log_dir):
        assert path.is_relative_to(tmp_path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o700


def test_settings_save_is_private_and_round_trips(tmp_path):
    settings = Settings.load(tmp_path)
    settings.save(model="tiny", n_ctx=1024)
    assert stat.S_IMODE(settings.settings_file.stat().st_mode) == 0o600
    again = Settings.load(tmp_path)
    assert again.get("model") == "tiny" and again.get("n_ctx") == 1024
    assert again.get("max_tokens") == 512  # defaults fill the rest
    assert not list(settings.config_dir.glob(".*.tmp"))


def test_broken_settings_file_is_a_clear_error(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "settings.toml").write_text("model = [unclosed")
    with pytest.raises(InvalidInputError, match="not valid TOML"):
        Settings.load(tmp_path)


def test_builtin_manifests_have_four_slots(tmp_path):
    catalog = Catalog(Settings.load(tmp_path))
    embedded, tall = catalog.get("embedded"), catalog.get("tall")
    assert builtin_manifest_dir().is_dir()
    for manifest in (embedded, tall):
        assert list(manifest.experts) == list(SLOTS)
    assert all(catalog.expert_path(embedded, slot) is None for slot in SLOTS)  # served by the base
    assert catalog.base_path(embedded).is_file()
    assert tall.base.kind == "huggingface" and tall.base.repo and tall.base.file.endswith(".gguf")
    assert all(e.source and e.source.format == "peft" for e in tall.experts.values())
    with pytest.raises(ModelError, match="unknown model"):
        catalog.get("nope")


def test_manifest_toml_round_trip(tmp_path):
    source = builtin_manifest_dir() / "tall.toml"
    manifest = Manifest.from_toml(source)
    copy = tmp_path / "copy.toml"
    copy.write_text(manifest.to_toml())
    again = Manifest.from_toml(copy)
    assert (again.base, again.experts, again.architecture) == (
        manifest.base,
        manifest.experts,
        manifest.architecture,
    )


def test_add_local_rejects_bad_names_and_adapters(tmp_path, tiny_model):
    from conftest import write_random_adapter

    catalog = Catalog(Settings.load(tmp_path))
    model = tiny_model("llama", False)
    with pytest.raises(InvalidInputError, match="model name"):
        catalog.add_local("Bad Name", model.path)
    adapter = write_random_adapter(tmp_path / "a.gguf", model, rank=2, seed=1)
    with pytest.raises(InvalidInputError, match="is an adapter"):
        catalog.add_local("adapter", adapter)
    added = catalog.add_local("tiny", model.path)
    assert added.architecture == "llama" and catalog.base_path(added) == model.path.resolve()
