"""Build llama.cpp's `llama-server` from the llama.cpp vendored in the pinned llama-cpp-python
sdist, once per machine, into a cache outside the repo: the same llama.cpp the in-process
engine runs, so the two engines can be compared token for token.

`python tests/llama_server_build.py` builds it ahead (CI may); tests call `llama_server_binary()`,
which builds when the cache is empty. The build runs under `nice -n 19` with two jobs, CPU
only, with the web UI download and HTTPS off (no network beyond the package registry).
Cache: $MACARON_LLAMA_SERVER_CACHE, else ~/.cache/macaron-local/llama-server/<version>.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

VERSION = "0.3.36"  # pyproject pins llama-cpp-python to this


def cache_dir() -> Path:
    root = os.environ.get("MACARON_LLAMA_SERVER_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "macaron-local" / "llama-server" / VERSION


def binary_path() -> Path:
    return cache_dir() / "build" / "bin" / "llama-server"


def _run(args: list[str], cwd: Path, log) -> None:
    log.write(f"$ {' '.join(args)}\n")
    log.flush()
    subprocess.run(["nice", "-n", "19", *args], cwd=cwd, check=True, stdout=log, stderr=subprocess.STDOUT)


def build(jobs: int = 2) -> tuple[Path, float]:
    """Build (or reuse) the binary; returns its path and the seconds a build took (0 if cached)."""
    target = binary_path()
    if target.is_file():
        return target, 0.0
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(root / "build.log", "a") as log:
        sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.is_file():
            pip = [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={VERSION}", "--no-deps"]
            _run([*pip, "--no-binary", ":all:", "-d", str(root)], root, log)
        source = root / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
        if not source.is_dir():
            with tarfile.open(sdist) as archive:
                archive.extractall(root, filter="data")
        build_dir = root / "build"
        configure = [
            "cmake", "-S", str(source), "-B", str(build_dir),
            "-G", "Ninja" if shutil.which("ninja") else "Unix Makefiles",
            "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
            "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=OFF",
        ]  # fmt: skip
        _run(configure, root, log)
        _run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)], root, log)
    seconds = time.monotonic() - started
    (root / "build-seconds.txt").write_text(f"{seconds:.0f}\n")
    return target, seconds


if __name__ == "__main__":
    path, seconds = build()
    print(f"{path} ({'cached' if not seconds else f'built in {seconds:.0f} s'})")
