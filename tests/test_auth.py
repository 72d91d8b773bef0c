"""`macaron auth login|logout|status`: the Hugging Face token lives in the OS keyring only.

The tests use a keyring backend of their own (`JsonFileKeyring`, a stand-in for the OS keyring
kept outside MACARON_HOME), selected the way keyring documents: PYTHON_KEYRING_BACKEND.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import keyring
import pytest
from conftest import run_cli
from keyring.backend import KeyringBackend, properties
from keyring.errors import NoKeyringError, PasswordDeleteError

from macaron_local import secrets

TOKEN = "hf_" + "Zq9" * 12
TESTS = str(Path(__file__).parent)


class JsonFileKeyring(KeyringBackend):
    """A keyring in a JSON file named by $MACARON_TEST_KEYRING (the tests' OS keyring)."""

    @properties.classproperty
    def priority(cls) -> float:  # type: ignore[override]
        """Viable only where a test names its file: keyring registers every backend class it
        sees, and this one must not become the OS keyring of tests that run after this module."""
        if "MACARON_TEST_KEYRING" not in os.environ:
            raise RuntimeError("the tests' JSON keyring needs MACARON_TEST_KEYRING")
        return 1

    def _path(self) -> Path:
        if "MACARON_TEST_KEYRING" not in os.environ:  # a later test, after this one was chosen
            raise NoKeyringError("the tests' JSON keyring needs MACARON_TEST_KEYRING")
        return Path(os.environ["MACARON_TEST_KEYRING"])

    def _load(self) -> dict[str, str]:
        path = self._path()
        return json.loads(path.read_text()) if path.exists() else {}

    def get_password(self, service: str, username: str) -> str | None:
        return self._load().get(f"{service}/{username}")

    def set_password(self, service: str, username: str, password: str) -> None:
        data = self._load()
        data[f"{service}/{username}"] = password
        self._path().write_text(json.dumps(data))

    def delete_password(self, service: str, username: str) -> None:
        data = self._load()
        if data.pop(f"{service}/{username}", None) is None:
            raise PasswordDeleteError("not found")
        self._path().write_text(json.dumps(data))


@pytest.fixture
def vault(tmp_path, monkeypatch) -> dict[str, str]:
    """Environment for a CLI run with the test keyring; the keyring file is outside the home."""
    path = tmp_path / "os-keyring" / "secrets.json"
    path.parent.mkdir()
    monkeypatch.setenv("MACARON_TEST_KEYRING", str(path))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return {
        "MACARON_TEST_KEYRING": str(path),
        "PYTHON_KEYRING_BACKEND": "test_auth.JsonFileKeyring",
        "PYTHONPATH": os.pathsep.join([TESTS, *sys.path]),
    }


def everything_written(root: Path, skip: Path) -> str:
    text = []
    for path in root.rglob("*"):
        if path.is_file() and path != skip:
            text.append(path.read_bytes().decode("utf-8", errors="replace"))
    return "\n".join(text)


def test_login_keeps_the_token_in_the_keyring_and_nowhere_else(tmp_path, vault):
    home = tmp_path / "home"
    outputs = []
    done = run_cli("auth", "login", home=home, input=TOKEN + "\n", **vault)
    assert done.returncode == 0, done.stderr
    assert "token stored in the OS keyring" in done.stdout
    outputs.append(done.stdout + done.stderr)
    stored = json.loads(Path(vault["MACARON_TEST_KEYRING"]).read_text())
    assert stored == {f"{secrets.SERVICE}/{secrets.HF_TOKEN_KEY}": TOKEN}

    for args in (("auth", "status"), ("daemon", "run", "--now"), ("daemon", "status"), ("models", "list")):
        other = run_cli(*args, home=home, **vault)
        assert other.returncode == 0, (args, other.stderr)
        outputs.append(other.stdout + other.stderr)
    assert "a token is stored" in outputs[1]
    assert TOKEN not in "\n".join(outputs)
    assert TOKEN not in everything_written(tmp_path, skip=Path(vault["MACARON_TEST_KEYRING"]))
    assert (home / "logs" / "daemon.log").is_file()  # a log was written, without the token

    previous = keyring.get_keyring()
    keyring.set_keyring(JsonFileKeyring())
    try:
        assert secrets.get_hf_token() == TOKEN  # what downloads use
    finally:
        keyring.set_keyring(previous)

    out = run_cli("auth", "logout", home=home, **vault)
    assert out.returncode == 0 and "token removed" in out.stdout
    assert json.loads(Path(vault["MACARON_TEST_KEYRING"]).read_text()) == {}
    again = run_cli("auth", "logout", home=home, **vault)
    assert again.returncode == 0 and "no token was stored" in again.stdout
    assert "no token is stored" in run_cli("auth", "status", home=home, **vault).stdout


@pytest.mark.parametrize(
    ("given", "needle"),
    [("\n", "no token given"), ("hf_abc def\n", "contains spaces"), ("hf_\x07bell\n", "control characters")],
)
def test_bad_tokens_are_refused_with_one_line(tmp_path, vault, given, needle):
    done = run_cli("auth", "login", home=tmp_path / "home", input=given, **vault)
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and needle in done.stderr and len(done.stderr.splitlines()) == 1
    assert not Path(vault["MACARON_TEST_KEYRING"]).exists()


def test_no_usable_keyring_is_one_line_not_a_traceback(tmp_path, vault):
    env = {**vault, "PYTHON_KEYRING_BACKEND": "keyring.backends.fail.Keyring"}
    for args in (("auth", "login"), ("auth", "status"), ("auth", "logout")):
        done = run_cli(*args, home=tmp_path / "home", input=TOKEN + "\n", **env)
        assert done.returncode == 1, args
        assert done.stderr.startswith("error: no usable OS keyring") and "Traceback" not in done.stderr
        assert TOKEN not in done.stderr + done.stdout


def test_hf_token_in_the_environment_is_reported_first(tmp_path, vault):
    done = run_cli("auth", "status", home=tmp_path / "home", HF_TOKEN=TOKEN, **vault)
    assert done.returncode == 0 and "HF_TOKEN is set" in done.stdout and TOKEN not in done.stdout
