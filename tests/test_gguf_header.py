"""The bounded GGUF header reader: agrees with gguf-py on every valid file, refuses every bomb.

Agreement is what lets the base model be described from our reader alone (no gguf-py pass over
the tokenizer); refusal, in a few milliseconds, is what keeps gguf-py from ever seeing a header
that lies about its own size.
"""

from __future__ import annotations

import time

import gguf
import pytest
from conftest import EMBEDDED_GGUF, write_random_adapter
from gguf_bombs import bombs, write_bombs

from macaron_local.adapters.gguf_header import MODEL_LIMITS, read_header
from macaron_local.adapters.validate import BaseModelInfo, _base_info_cached
from macaron_local.errors import AdapterError, ModelError


def gguf_py_view(path) -> tuple[dict, dict]:
    reader = gguf.GGUFReader(str(path))
    tensors = {
        t.name: (tuple(int(d) for d in t.shape.tolist()), int(t.tensor_type), int(t.data_offset))
        for t in reader.tensors
    }
    return tensors, {name: field.types[0] for name, field in reader.fields.items() if not name.startswith("GGUF.")}


@pytest.mark.parametrize("which", ["embedded", "tiny-llama", "tiny-qwen3", "adapter-f32", "adapter-q8"])
def test_reader_agrees_with_gguf_py_on_valid_files(which, tiny_model, tmp_path):
    if which == "embedded":
        path = EMBEDDED_GGUF
    elif which.startswith("tiny"):
        path = tiny_model(which.split("-")[1], False).path
    else:
        dtype = "F32" if which.endswith("f32") else "Q8_0"
        path = write_random_adapter(tmp_path / "a.gguf", tiny_model("llama", False), rank=4, seed=1, dtype=dtype)
    header = read_header(path, limits=MODEL_LIMITS)
    tensors, kinds = gguf_py_view(path)
    ours = {t.name: (t.dims, t.type, header.data_start + t.offset) for t in header.tensors}
    assert ours == tensors
    assert {k: v[0] for k, v in header.kv.items()} == kinds


def test_base_description_matches_the_gguf_py_one(tiny_model):
    model = tiny_model("llama", False)
    info = BaseModelInfo.from_gguf(model.path)
    reader = gguf.GGUFReader(str(model.path))
    assert info.tensors == {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    assert (info.architecture, info.n_head, info.n_head_kv, info.n_layer) == (
        "llama",
        model.config.n_head,
        model.config.n_head_kv,
        model.config.n_layer,
    )
    start = time.perf_counter()
    _base_info_cached.cache_clear()
    BaseModelInfo.from_gguf(EMBEDDED_GGUF)
    assert time.perf_counter() - start < 30  # a loose guard: gguf-py's read took ~12 s on this machine


@pytest.mark.parametrize("name", sorted(bombs()))
def test_every_bomb_is_refused_in_one_line(name, tmp_path):
    path = write_bombs(tmp_path, lambda n: n == name)[name]
    with pytest.raises(AdapterError) as caught:
        read_header(path)
    assert "\n" not in str(caught.value) and str(path) in str(caught.value)


def test_a_base_model_bomb_is_a_model_error(tmp_path):
    path = write_bombs(tmp_path, lambda n: n == "n_tensors_2e60")["n_tensors_2e60"]
    with pytest.raises(ModelError, match="more than the file can hold"):
        BaseModelInfo.from_gguf(path)
