"""Where macaron-local keeps things, and the user's settings file.

Every other module asks `Settings` for a path instead of computing one, so one environment
variable (`MACARON_HOME`) can relocate everything: tests and portable installs point it at a
folder and nothing escapes it. Without it, paths come from platformdirs.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs
import tomli_w

from macaron_local.errors import InvalidInputError, MacaronError
from macaron_local.settings_schema import check_setting, check_settings
from macaron_local.untrusted import load_toml, read_text

APP_NAME = "macaron-local"
HOME_ENV = "MACARON_HOME"

DEFAULTS: dict[str, Any] = {
    "model": "embedded",
    "n_ctx": 4096,
    "n_threads": 0,  # 0: let llama.cpp choose
    "max_tokens": 512,
    "temperature": 0.0,
    "repeat_penalty": 1.1,  # small models loop without it
    "kv_switch": "state",  # bench/inference.py: restoring a saved KV state beats reset + re-prefill
    "system_prompt": "You are a helpful assistant.",
    "routing": "model",  # model: L0's route hop (Macaron's protocol); keywords: the fallback rules
    "learning_paused": False,
    "learning_backend": "auto",  # auto | torch | mlx (auto: MLX on Apple silicon, else torch)
}


def _private_dir(path: Path) -> Path:
    """Create `path` (and parents) with mode 0700: the user's data is nobody else's.

    An existing folder is only tightened when group or others can reach it, and never made
    writable: a folder the user made read-only stays read-only, and read-only commands work.
    A file in the way, or a place that cannot be written, is one clear line."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise InvalidInputError(
            f"{path} must be a folder, but {blocker} is a file; move it or set {HOME_ENV} to a folder"
        ) from None
    except OSError as exc:
        why = "read-only" if exc.errno == errno.EROFS else exc.strerror or str(exc)
        raise MacaronError(f"cannot create the folder {path} ({why}); set {HOME_ENV} to a writable folder") from None
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            os.chmod(path, mode & 0o700)
    except OSError:
        pass  # not ours to change (a read-only mount): `macaron doctor` reports its mode
    return path


@dataclass
class Settings:
    """Resolved paths plus the values of the TOML settings file (defaults filled in)."""

    data_dir: Path
    config_dir: Path
    cache_dir: Path
    log_dir: Path
    values: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, home: str | os.PathLike[str] | None = None) -> Settings:
        """Resolve paths (`home`, else `$MACARON_HOME`, else platformdirs) and read settings."""
        home = home or os.environ.get(HOME_ENV)
        if home:
            root = Path(home).expanduser().resolve()
            dirs = (root / "data", root / "config", root / "cache", root / "logs")
        else:
            dirs = (
                Path(platformdirs.user_data_dir(APP_NAME)),
                Path(platformdirs.user_config_dir(APP_NAME)),
                Path(platformdirs.user_cache_dir(APP_NAME)),
                Path(platformdirs.user_log_dir(APP_NAME)),
            )
        settings = cls(*dirs)
        settings.values = {**DEFAULTS, **settings._read_file()}
        return settings

    @property
    def settings_file(self) -> Path:
        return self.config_dir / "settings.toml"

    @property
    def models_dir(self) -> Path:
        """Downloaded base models and user-added model manifests live here."""
        return self.data_dir / "models"

    @property
    def user_manifests_dir(self) -> Path:
        return self.config_dir / "models"

    def ensure_dirs(self) -> None:
        """Create every directory 0700 (the data directory holds private conversations)."""
        for path in (self.data_dir, self.config_dir, self.cache_dir, self.log_dir):
            _private_dir(path)

    def configured(self) -> dict[str, Any]:
        """Only what the user's settings file says (no defaults): e.g. has a model been chosen?"""
        return self._read_file()

    def get(self, key: str) -> Any:
        return self.values.get(key, DEFAULTS.get(key))

    def _read_file(self) -> dict[str, Any]:
        """The settings file's values, refused (naming the key) unless every known key fits the
        schema; a directory, FIFO or deeply nested file in its place is one clear line."""
        path = self.settings_file
        if not os.path.lexists(path):
            return {}
        where = f"settings file {path}"
        values = load_toml(read_text(path, "settings file"), where)
        check_settings(values, where, DEFAULTS)
        return values

    def save(self, **changes: Any) -> None:
        """Write changed values to the settings file atomically (temp file + rename)."""
        current = self._read_file()
        for key, value in changes.items():
            check_setting(key, value, f"setting {key}", DEFAULTS)
        current.update(changes)
        self.values.update(changes)
        _private_dir(self.config_dir)
        write_private_atomic(self.settings_file, tomli_w.dumps(current).encode())


def write_private_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` via a 0600 temp file and an atomic rename: never half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
