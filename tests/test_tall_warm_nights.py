"""Nights that build on each other on Tall's architecture (a tiny random qwen3_5_moe with four
stacked experts): the second night continues the deployed personal version in both memory
plans, and starts out with what llama.cpp serves. With a read-back that misses (the Gated
DeltaNet head order left in GGUF's, as warm start read it before stop 58), the night notices on
its own and starts from zero rather than training on from a start the user was never served."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")
pytest.importorskip("transformers")

from macaron_local.catalog import Catalog  # noqa: E402
from macaron_local.learn.loop import LearnConfig  # noqa: E402
from macaron_local.learn.run import learn_once  # noqa: E402
from macaron_local.settings import Settings  # noqa: E402
from macaron_local.store import open_default_store  # noqa: E402

CONFIG = LearnConfig(steps=2, episodes_per_step=2, group_size=2, max_new_tokens=4, refresh_every=100, backend="torch")


def seed(store, name: str, first: int) -> None:
    for i in range(first, first + 8):
        conversation = store.new_conversation(name)
        question = store.add_message(conversation, "user", f"ab {i}")
        turn = {"model": name, "expert": f"L{i % 4}", "route_method": "default"}
        reply, _ = store.add_reply(conversation, question, "cd cd", turn)
        store.add_feedback(reply, "correction", text=f"ba {i} ba")


@pytest.fixture
def after_night_one(tmp_path, monkeypatch):
    """A home on the tiny Tall whose first night's version is deployed, with new feedback since."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    import tiny_tall

    monkeypatch.setenv("MACARON_HOME", str(tmp_path / "home"))
    home = Settings.load()
    home.ensure_dirs()
    name = tiny_tall.register(home, tiny_tall.build(tmp_path / "tall"))
    catalog = Catalog(home)
    with open_default_store(home) as store:
        seed(store, name, 0)
        [night1] = learn_once(store, catalog, catalog.get(name), CONFIG, mode="together")
        assert night1.metrics["start"] == "started from zero"
        if night1.decision != "deployed":  # the gate's verdict on random data does not matter here
            store.deploy_adapter(night1.version_id)
        seed(store, name, 8)
    return tmp_path / "home", name


def second_night(home: Path, name: str, mode: str, monkeypatch):
    monkeypatch.setenv("MACARON_HOME", str(home))
    settings = Settings.load()
    catalog = Catalog(settings)
    with open_default_store(settings) as store:
        [night2] = learn_once(store, catalog, catalog.get(name), CONFIG, mode=mode)
    return night2


@pytest.mark.parametrize("mode", ["together", "sequential"])
def test_the_second_tall_night_continues_what_llama_cpp_serves(after_night_one, tmp_path, monkeypatch, mode):
    home, name = after_night_one
    copy = tmp_path / f"home-{mode}"
    shutil.copytree(home, copy)
    night2 = second_night(copy, name, mode, monkeypatch)
    assert night2.metrics["start"] == "continued from the deployed version (34 layers, read back exactly)"


def test_a_read_back_that_misses_starts_from_zero(after_night_one, monkeypatch):
    home, name = after_night_one
    monkeypatch.setattr("macaron_local.adapters.qwen35moe.lora_orders", lambda module, dims: (None, None))
    night2 = second_night(home, name, "together", monkeypatch)
    start = night2.metrics["start"]
    assert start.startswith("started from zero: the deployed version did not read back exactly")
    assert "x its largest value" in start and ("attn_qkv" in start or "ssm_" in start or "attn_gate" in start)
