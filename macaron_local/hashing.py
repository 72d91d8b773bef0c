"""One way to hash a file: adapter identity, registry addresses and download checks all use it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from macaron_local.errors import ModelError


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The hex sha256 of a file, read in chunks (base models are tens of GB)."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            return hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError as exc:
        raise ModelError(f"{path} cannot be read: {exc.strerror or exc}") from None
