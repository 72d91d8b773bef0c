"""llama.cpp's extra buffer types stay off on CPUs with AMX, where they crash the process."""

from __future__ import annotations

import llama_cpp
import pytest
from conftest import EMBEDDED_GGUF

from macaron_local.engine import llama_load
from macaron_local.engine.llama_load import cpu_has_amx, open_llama, server_flags


def test_amx_is_read_from_the_cpu_flags(tmp_path):
    with_amx = tmp_path / "amx"
    with_amx.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f amx_bf16 amx_tile amx_int8\n\n")
    without = tmp_path / "plain"
    without.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n\n")
    assert cpu_has_amx(with_amx) and not cpu_has_amx(without)
    assert not cpu_has_amx(tmp_path / "missing")  # no /proc (macOS, Windows): assume no AMX


@pytest.mark.parametrize(("forced", "extra"), [("0", False), ("1", True)])
def test_the_model_opens_with_extra_buffers_only_where_allowed(monkeypatch, forced, extra):
    monkeypatch.setenv("MACARON_LLAMA_REPACK", forced)
    original = llama_cpp.llama_cpp.llama_model_default_params
    llm = open_llama(EMBEDDED_GGUF, n_ctx=64, verbose=False)
    try:
        assert llm.model_params.use_extra_bufts is extra
        assert llama_cpp.llama_cpp.llama_model_default_params is original  # the switch is not left on
        assert ("--no-repack" in server_flags()) is not extra
    finally:
        llm.close()


def test_on_this_machine_the_default_choice_generates(monkeypatch):
    """On an AMX CPU the default (llama.cpp's extra buffers) segfaults at the first token; the
    detection must keep them off there, and anywhere else leave llama.cpp's default."""
    monkeypatch.delenv("MACARON_LLAMA_REPACK", raising=False)
    llm = open_llama(EMBEDDED_GGUF, n_ctx=128, verbose=False)
    try:
        assert llm.model_params.use_extra_bufts is not llama_load.cpu_has_amx()
        tokens = llm.tokenize(b"The capital of France is")
        llm.eval(tokens)
        assert llm.n_tokens == len(tokens)
    finally:
        llm.close()
