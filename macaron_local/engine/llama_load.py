"""Opening a model in llama.cpp without its AMX path, on the CPUs where that path crashes.

llama.cpp repacks weights into "extra" buffer types when the CPU has them; on a CPU with Intel
AMX (Sapphire Rapids and later Xeons) the first matrix multiply in the AMX buffer can segfault
the process (ggml_backend_amx_mul_mat; llama.cpp issue #20824, closed stale without a fix; other
projects' CI hit it on the same CPUs). Seen here: the embedded SmolLM2 (Q4_1) killed
`macaron ask` with SIGSEGV on the first token. A crash takes the user's whole app down, so on
such a CPU the model is opened with `use_extra_bufts` off (plain CPU buffers: a little slower,
never a crash). Other CPUs keep llama.cpp's default.

llama-cpp-python does not expose the switch as an argument, so the default model parameters it
starts from are adjusted for the one call, under a lock. `llama-server` takes it as `--no-repack`.
"""

from __future__ import annotations

import functools
import os
import threading
from pathlib import Path
from typing import Any

import llama_cpp

_defaults_lock = threading.Lock()
_AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")


@functools.cache
def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU reports AMX (Linux; elsewhere there is no cheap reading: assume not)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return False
    for line in text.splitlines():
        if line.startswith("flags"):
            return any(flag in line.split() for flag in _AMX_FLAGS)
    return False


def extra_buffers_allowed() -> bool:
    """False where llama.cpp's extra buffer types must stay off. MACARON_LLAMA_REPACK=1 or 0
    overrides the detection (to measure both ways, or on a CPU it cannot read)."""
    forced = os.environ.get("MACARON_LLAMA_REPACK")
    if forced in ("0", "1"):
        return forced == "1"
    return not cpu_has_amx()


def open_llama(model_path: str | Path, **kwargs: Any) -> llama_cpp.Llama:
    """`llama_cpp.Llama(model_path, **kwargs)`, with extra buffer types off where they crash."""
    if extra_buffers_allowed():
        return llama_cpp.Llama(model_path=str(model_path), **kwargs)
    module = llama_cpp.llama_cpp
    with _defaults_lock:
        original = module.llama_model_default_params

        def without_extra_buffers():
            params = original()
            params.use_extra_bufts = False
            return params

        module.llama_model_default_params = without_extra_buffers
        try:
            return llama_cpp.Llama(model_path=str(model_path), **kwargs)
        finally:
            module.llama_model_default_params = original


def server_flags() -> list[str]:
    """The same choice for a `llama-server` started here."""
    return [] if extra_buffers_allowed() else ["--no-repack"]
