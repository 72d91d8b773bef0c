"""The remote trainer's own side, on what runs here: rollouts in Tinker's datum layout (with
the real SDK's types where it is installed), the adapter's download from signed URLs over a
real HTTP server on 127.0.0.1, and its conversion to a GGUF candidate that llama.cpp applies.
The Tinker/MinT service itself is not reachable from here; no call to it is imitated."""

from __future__ import annotations

import dataclasses
import functools
import http.server
import threading

import numpy as np
import pytest
from test_peft_convert import TOKENS, hf_model, peft_dir

from macaron_local.adapters import BaseModelInfo
from macaron_local.engine import Engine, EngineConfig
from macaron_local.errors import InvalidInputError, MacaronError
from macaron_local.learn.backends.tinker_backend import (
    LEAVES_THE_MACHINE,
    RemoteTrainerError,
    TinkerTrainer,
    datum_arrays,
    download_files,
    load_sdk,
    peft_to_candidate,
    step_datums,
)
from macaron_local.learn.loop import StepRollouts


def test_a_rollout_is_shifted_and_only_its_reply_carries_the_advantage():
    arrays = datum_arrays([10, 11, 12], [20, 21], [-0.5, -1.25], 0.75)
    assert arrays["model_input"].tolist() == [10, 11, 12, 20]
    assert arrays["target_tokens"].tolist() == [11, 12, 20, 21]
    assert arrays["logprobs"].tolist() == [0.0, 0.0, -0.5, -1.25]
    assert arrays["advantages"].tolist() == [0.0, 0.0, 0.75, 0.75]
    with pytest.raises(ValueError):
        datum_arrays([1], [2, 3], [-1.0], 1.0)


def test_step_datums_use_the_sdks_types_and_skip_groups_that_teach_nothing():
    tinker = pytest.importorskip("tinker")
    rollouts = StepRollouts(0, "L0", prompts=[[1, 2], [1, 2], [3, 4], [3, 4]])
    rollouts.completions = [[5, 6], [7], [8], [9]]
    rollouts.sampler = [[-1.0, -2.0], [-0.5], [-0.1], [-0.2]]
    datums = step_datums(tinker, rollouts, [[1.0, -1.0], [0.0, 0.0]])
    assert len(datums) == 2 and all(isinstance(d, tinker.types.Datum) for d in datums)
    first = datums[0]
    assert first.model_input.to_ints() == [1, 2, 5]
    assert first.loss_fn_inputs["target_tokens"].tolist() == [2, 5, 6]
    assert first.loss_fn_inputs["advantages"].tolist() == [0.0, 1.0, 1.0]


def test_the_sdk_and_key_are_required_in_one_line():
    with pytest.raises(InvalidInputError, match="must be one of"):
        load_sdk("openai")
    if load_sdk_or_none("tinker") is not None:
        with pytest.raises(MacaronError, match="macaron auth tinker-key"):
            TinkerTrainer("Qwen/Qwen3.6-35B-A3B", rank=8, lr=1e-4, api_key=None)
    assert "are sent to tinker" in LEAVES_THE_MACHINE.format(service="tinker")


def load_sdk_or_none(name: str):
    try:
        return load_sdk(name)
    except MacaronError:
        return None


@pytest.fixture
def served_folder(tmp_path):
    """A PEFT adapter folder behind a real HTTP server on 127.0.0.1 (as signed URLs point to)."""
    model, _ = hf_model(tmp_path, "llama")
    folder, _ = peft_dir(tmp_path, model, rank=4, alpha=8)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *a, **k: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    yield model, folder, base
    server.shutdown()


def test_the_adapter_downloads_whole_and_converts_to_a_candidate_llama_cpp_applies(served_folder, tmp_path):
    model, folder, base = served_folder
    urls = {name: f"{base}/{name}" for name in ("adapter_config.json", "adapter_model.safetensors")}
    got = download_files(urls, tmp_path / "checkpoint")
    for name in urls:
        assert (got / name).read_bytes() == (folder / name).read_bytes()
    candidate = peft_to_candidate(got, BaseModelInfo.from_gguf(model.path), tmp_path / "candidate.gguf")
    with Engine(EngineConfig(model_path=model.path, n_ctx=64, n_threads=2)) as engine:
        bare = engine.logits(TOKENS)
        engine.set_adapters([engine.load_adapter(candidate)])
        tuned = engine.logits(TOKENS)
    assert np.abs(tuned - bare).max() > 1e-3  # the downloaded adapter changes what is served


def test_a_bad_download_leaves_nothing_behind(served_folder, tmp_path):
    _, _, base = served_folder
    with pytest.raises(RemoteTrainerError, match="unsafe file name"):
        download_files({"../escape": f"{base}/adapter_config.json"}, tmp_path / "a")
    with pytest.raises(RemoteTrainerError, match="failed"):
        download_files({"adapter_config.json": f"{base}/adapter_config.json", "x": f"{base}/missing"}, tmp_path / "b")
    with pytest.raises(RemoteTrainerError, match="plain-HTTP"):
        download_files({"adapter_config.json": "http://example.com/x"}, tmp_path / "c")
    assert not any(p.name.startswith(("a", "b", "c")) for p in tmp_path.iterdir() if p.is_dir())
    with pytest.raises(RemoteTrainerError, match="not a PEFT adapter folder"):
        peft_to_candidate(tmp_path, BaseModelInfo.from_gguf(served_folder[0].path), tmp_path / "x.gguf")


# ----------------------------------------------------------------- wired into a night
def test_a_remote_night_says_what_leaves_and_fails_fast_in_one_line(home, tiny_model):
    """`[learn] trainer = "tinker"`: the consent line comes first; without the service's base,
    SDK or key the run stops in one line before any rollout, and no feedback is consumed."""
    from test_learn_run import seed

    from macaron_local.catalog import Catalog
    from macaron_local.daemon.config import learn_config
    from macaron_local.learn.run import learn_once
    from macaron_local.store import open_default_store

    model = tiny_model("llama", False, n_ctx_train=2048)
    catalog = Catalog(home)
    manifest = catalog.add_local("tiny", model.path)
    home.save(learn={"trainer": "tinker", "steps": 2})
    config = learn_config(home)
    assert config.trainer == "tinker"
    with open_default_store(home) as store:
        seed(store, 8)
        with pytest.raises(InvalidInputError, match="remote_base_model"):
            learn_once(store, catalog, manifest, config)
        notes: list[str] = []
        remote = dataclasses.replace(config, remote_base_model="Qwen/Qwen3.6-35B-A3B")
        with pytest.raises(MacaronError) as caught:
            learn_once(store, catalog, manifest, remote, on_notice=notes.append)
        assert "\n" not in str(caught.value)
        assert "macaron auth tinker-key" in str(caught.value) or "pip install tinker" in str(caught.value)
        assert notes and "are sent to tinker" in notes[0]
        assert store.learning_runs() == [] and store.adapter_versions() == []  # nothing consumed or registered
    home.save(learn={"trainer": "openai"})
    with pytest.raises(InvalidInputError, match='trainer must be "local", "tinker" or "mint"'):
        learn_config(home)
