"""Plugins: a GGUF LoRA or a PEFT directory with a small manifest is checked, registered as a
candidate tagged `plugin:<name>`, listed, and removed with its file; bad ones store nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli, write_random_adapter
from safetensors.numpy import save_file

from macaron_local.catalog import Catalog
from macaron_local.engine import Engine, EngineConfig
from macaron_local.errors import AdapterError, InvalidInputError, ModelError
from macaron_local.plugins import import_plugin, read_manifest, remove_plugin
from macaron_local.store import open_default_store


@pytest.fixture
def setup(home, tiny_model, tmp_path):
    """(store, catalog, tiny model) with the tiny model in the catalog as `tiny`."""
    model = tiny_model("llama", False)
    catalog = Catalog(home)
    catalog.add_local("tiny", model.path)
    with open_default_store(home) as store:
        yield store, catalog, model


def peft_dir(folder: Path, model, rank: int = 4) -> Path:
    """A PEFT LoRA directory for the tiny llama (q and v projections of every layer)."""
    rng = np.random.default_rng(5)
    tensors = {}
    for i in range(model.config.n_layer):
        for module, role in (("self_attn.q_proj", "attn_q"), ("self_attn.v_proj", "attn_v")):
            out, inp = model.weights[f"blk.{i}.{role}.weight"].shape
            prefix = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.2, (rank, inp)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.2, (out, rank)).astype(np.float32)
    folder.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def registry_files(store) -> list[Path]:
    return sorted(store.adapters_dir.glob("*")) if store.adapters_dir.exists() else []


def test_a_gguf_plugin_is_checked_registered_listed_and_removed(setup, tmp_path):
    store, catalog, model = setup
    source = write_random_adapter(tmp_path / "Helper.gguf", model, rank=4, seed=1)
    imported = import_plugin(store, catalog, source, slot="coding", base_model="tiny")
    plugin = imported.plugin
    assert (plugin.name, plugin.slot, plugin.new_expert, plugin.format) == ("helper", "L2", False, "gguf")
    assert plugin.validated and plugin.rank == 4 and plugin.status == "candidate"
    assert Path(plugin.path).read_bytes() == source.read_bytes()
    assert store.deployed_adapter("L2", "tiny") is None  # importing never changes what is served
    assert [v.id for v in store.find_adapters(tag="plugin:helper")] == [plugin.version_id]
    assert store.adapter_tags(plugin.version_id) == ["plugin", "plugin:helper"]
    assert [p.name for p in store.plugins()] == ["helper"]
    with Engine(EngineConfig(model_path=model.path, n_ctx=64)) as engine:
        assert engine.load_adapter(plugin.path).report.n_pairs == imported.report.n_pairs

    with pytest.raises(InvalidInputError, match="already imported"):
        import_plugin(store, catalog, source, slot="L2", base_model="tiny", name="helper")
    removed, collected = remove_plugin(store, "helper")
    assert removed.version_id == plugin.version_id and collected.removed == [Path(plugin.path).name]
    assert store.plugins() == [] and registry_files(store) == []
    with pytest.raises(InvalidInputError, match="no adapter version"):
        store.adapter_version(plugin.version_id)
    with pytest.raises(InvalidInputError, match="no plugin named"):
        remove_plugin(store, "helper")


def test_a_peft_plugin_with_a_manifest_brings_a_new_expert(setup, tmp_path):
    store, catalog, model = setup
    folder = peft_dir(tmp_path / "sql-plugin", model)
    (folder / "plugin.toml").write_text('name = "sql"\nexpert = "sql"\nbase_model = "tiny"\ndescription = "SQL"\n')
    plugin = import_plugin(store, catalog, folder).plugin
    assert (plugin.name, plugin.slot, plugin.new_expert, plugin.format) == ("sql", "sql", True, "peft")
    assert plugin.manifest["description"] == "SQL" and plugin.manifest["manifest_file"].endswith("plugin.toml")
    assert plugin.validated and plugin.rank == 4
    with Engine(EngineConfig(model_path=model.path, n_ctx=64)) as engine:
        assert engine.load_adapter(plugin.path).report.n_pairs == 2 * model.config.n_layer


def test_options_win_over_a_json_manifest(setup, tmp_path):
    store, catalog, model = setup
    source = write_random_adapter(tmp_path / "a.gguf", model, rank=2, seed=2)
    manifest = tmp_path / "meta.json"
    manifest.write_text(json.dumps({"name": "from-manifest", "slot": "L1", "base_model": "tiny"}))
    plugin = import_plugin(store, catalog, source, manifest=manifest, name="chosen", slot="ui").plugin
    assert (plugin.name, plugin.slot, plugin.base_model) == ("chosen", "L3", "tiny")


def test_a_file_shared_with_another_version_is_kept_when_the_plugin_goes(setup, tmp_path):
    store, catalog, model = setup
    source = write_random_adapter(tmp_path / "shared.gguf", model, rank=2, seed=3)
    learned = store.register_adapter(source, slot="L0", base_model="tiny", rank=2)
    plugin = import_plugin(store, catalog, source, slot="L0", base_model="tiny").plugin
    _, collected = remove_plugin(store, plugin.name)
    assert collected.removed == [] and Path(learned.path).is_file()


def test_a_deployed_plugin_must_be_rolled_back_before_removal(setup, tmp_path):
    store, catalog, model = setup
    plugin = import_plugin(
        store, catalog, write_random_adapter(tmp_path / "d.gguf", model, rank=2, seed=4), slot="L0", base_model="tiny"
    ).plugin
    store.deploy_adapter(plugin.version_id)
    with pytest.raises(InvalidInputError, match="roll it back first"):
        remove_plugin(store, plugin.name)
    assert [p.name for p in store.plugins()] == ["d"]  # nothing changed


def test_without_the_base_a_gguf_is_checked_for_structure_and_a_peft_dir_refused(setup, tmp_path):
    store, catalog, model = setup
    away = tmp_path / "elsewhere.gguf"
    shutil.copyfile(model.path, away)
    catalog.add_local("gone", away)
    away.unlink()  # the manifest stays; the base is no longer on this machine
    good = write_random_adapter(tmp_path / "good.gguf", model, rank=2, seed=5)
    plugin = import_plugin(store, catalog, good, slot="L0", base_model="gone").plugin
    assert not plugin.validated and plugin.base_model == "gone"

    nan = write_random_adapter(tmp_path / "nan.gguf", model, rank=2, seed=6, magnitude=float("nan"))
    with pytest.raises(AdapterError, match="NaN"):
        import_plugin(store, catalog, nan, slot="L0", base_model="gone")
    with pytest.raises(InvalidInputError, match="needs the base model 'gone'"):
        import_plugin(store, catalog, peft_dir(tmp_path / "p", model), slot="L0", base_model="gone")
    assert [p.name for p in store.plugins()] == ["good"]


@pytest.mark.parametrize(
    ("make", "options", "error", "message"),
    [
        (lambda d, m: _garbage(d / "g.gguf"), {"slot": "L0"}, AdapterError, "not a GGUF file"),
        (lambda d, m: _truncated(d, m), {"slot": "L0"}, AdapterError, "truncated|corrupt|past the end"),
        (lambda d, m: _other_shapes(d), {"slot": "L0"}, AdapterError, "shape|not a tensor"),
        (lambda d, m: write_random_adapter(d / "ok.gguf", m, rank=2, seed=7), {}, InvalidInputError, "which expert"),
        (lambda d, m: write_random_adapter(d / "ok.gguf", m, rank=2, seed=7), {"slot": "L7"}, InvalidInputError, "L7"),
        (
            lambda d, m: write_random_adapter(d / "ok.gguf", m, rank=2, seed=7),
            {"slot": "Bad Name"},
            InvalidInputError,
            "new expert's name",
        ),
        (
            lambda d, m: write_random_adapter(d / "ok.gguf", m, rank=2, seed=7),
            {"slot": "L0", "base_model": "nope"},
            ModelError,
            "unknown model",
        ),
        (
            lambda d, m: write_random_adapter(d / "Ok Plugin!.gguf", m, rank=2, seed=7),
            {"slot": "L0"},
            InvalidInputError,
            "--name",
        ),
        (lambda d, m: d / "missing.gguf", {"slot": "L0"}, InvalidInputError, "no such file"),
        (lambda d, m: _empty_dir(d), {"slot": "L0"}, InvalidInputError, "neither a GGUF LoRA file nor a PEFT"),
    ],
)
def test_bad_plugins_store_nothing(setup, tmp_path, make, options, error, message):
    store, catalog, model = setup
    source = make(tmp_path, model)
    with pytest.raises(error, match=message):
        import_plugin(store, catalog, source, **{"base_model": "tiny", **options})
    assert store.plugins() == [] and store.adapter_versions() == [] and registry_files(store) == []


def _garbage(path: Path) -> Path:
    path.write_bytes(b"this is not an adapter" * 10)
    return path


def _truncated(folder: Path, model) -> Path:
    path = write_random_adapter(folder / "cut.gguf", model, rank=2, seed=8)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


def _other_shapes(folder: Path) -> Path:
    from tinymodels import TinyConfig, build_tiny_model

    other = build_tiny_model(folder / "wide.gguf", TinyConfig(arch="llama", n_embd=64, n_ff=96), seed=9)
    return write_random_adapter(folder / "wide-lora.gguf", other, rank=2, seed=9)


def _empty_dir(folder: Path) -> Path:
    (folder / "empty").mkdir()
    return folder / "empty"


@pytest.mark.parametrize(
    ("text", "suffix", "message"),
    [
        ("name = [", ".toml", "not valid TOML"),
        ("{", ".json", "not valid JSON"),
        ('name = "x"\nflavour = "y"\n', ".toml", "unknown key"),
        ("name = 3\n", ".toml", "non-empty string"),
        ("[1, 2]", ".json", "table of keys"),
    ],
)
def test_bad_manifests_are_one_line_errors(tmp_path, text, suffix, message):
    path = tmp_path / f"plugin{suffix}"
    path.write_text(text)
    with pytest.raises(InvalidInputError, match=message) as caught:
        read_manifest(path)
    assert "\n" not in str(caught.value)


def test_manifest_naming_both_a_slot_and_a_new_expert_is_refused(setup, tmp_path):
    store, catalog, model = setup
    folder = tmp_path / "both"
    folder.mkdir()
    write_random_adapter(folder / "a.gguf", model, rank=2, seed=10)
    (folder / "plugin.toml").write_text('slot = "L0"\nexpert = "sql"\nbase_model = "tiny"\n')
    with pytest.raises(InvalidInputError, match="not both"):
        import_plugin(store, catalog, folder)


def test_plugins_cli_end_to_end(tmp_path, tiny_model):
    model = tiny_model("llama", False)
    home = tmp_path / "home"
    assert run_cli("models", "add", "tiny", str(model.path), home=home).returncode == 0
    folder = tmp_path / "ui-helper"
    folder.mkdir()
    write_random_adapter(folder / "adapter.gguf", model, rank=2, seed=11)
    (folder / "plugin.toml").write_text('name = "ui-helper"\nslot = "ui"\nbase_model = "tiny"\n')

    imported = run_cli("plugins", "import", str(folder), home=home)
    assert imported.returncode == 0, imported.stderr
    assert "imported plugin ui-helper for L3 on tiny" in imported.stdout and "checked against tiny" in imported.stdout
    listed = json.loads(run_cli("plugins", "list", "--json", home=home).stdout)
    assert [(p["name"], p["slot"], p["validated"], p["format"]) for p in listed] == [("ui-helper", "L3", True, "gguf")]
    text = run_cli("plugins", "list", home=home).stdout
    assert text.startswith("ui-helper") and "checked" in text

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40)
    refused = run_cli("plugins", "import", str(bad), "--slot", "L0", "--base-model", "tiny", home=home)
    assert refused.returncode == 2 and refused.stderr.startswith("error: ") and refused.stderr.count("\n") == 1
    assert "Traceback" not in refused.stderr

    removed = run_cli("plugins", "remove", "ui-helper", home=home)
    assert removed.returncode == 0 and "deleted its file" in removed.stdout
    assert run_cli("plugins", "list", home=home).stdout.startswith("no plugins imported")
    missing = run_cli("plugins", "remove", "ui-helper", home=home)
    assert missing.returncode == 2 and "no plugin named 'ui-helper'" in missing.stderr
