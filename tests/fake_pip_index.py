"""A PEP 503 package index on 127.0.0.1 holding one fake package, for running the real
`python -m pip install` in tests without touching the internet."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import os
import sys
import threading
import zipfile
from collections.abc import Iterator
from functools import partial
from pathlib import Path

from macaron_local.learning_setup.install import TrainerPlan

#: pip ignores this machine's pip.conf and PIP_* variables.
ISOLATED_PIP = [sys.executable, "-m", "pip", "--isolated"]
PACKAGE = "macaron-fake-trainer"


def build_wheel(folder: Path, name: str = "macaron_fake_trainer", payload: int = 3_000_000) -> Path:
    """A minimal valid wheel with an incompressible payload, so pip has real bytes to download."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{name}-1.0.dist-info"
    files = {
        f"{name}/__init__.py": b"VERSION = '1.0'\n",
        f"{name}/payload.bin": os.urandom(payload),
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 1.0\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


@contextlib.contextmanager
def fake_index(root: Path) -> Iterator[tuple[str, Path]]:
    """Serve an index with the fake package; yields (index URL, the wheel)."""
    wheel = build_wheel(root / "files")
    project = root / "simple" / PACKAGE
    project.mkdir(parents=True)
    (project / "index.html").write_text(f'<a href="../../files/{wheel.name}">{wheel.name}</a>\n')
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple", wheel
    finally:
        server.shutdown()


def fake_plan(url: str, target: Path, package: str = PACKAGE) -> TrainerPlan:
    """A trainer plan whose one pip run installs `package` from `url` into `target` (no cache)."""
    step = ("--no-cache-dir", "--index-url", url, "--target", str(target), package)
    return TrainerPlan("torch", "test build", "a local fake", (step,), 1000, sys.executable, str(target))
