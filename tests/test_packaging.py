"""The wheel and sdist: what they ship, and that an installed wheel runs from its own files.

CI (`.ci/run`) installs the wheel into a fresh virtual environment with its dependencies and
runs `macaron --version`, `macaron doctor` and `macaron ask`. Here, offline, the built wheel is
unpacked on its own path ahead of the checkout, with this environment's dependencies behind it,
so the commands must find their templates and manifests inside the wheel.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = (
    "packaging/systemd/macaron-learn.service",
    "packaging/systemd/macaron-learn.timer",
    "packaging/launchd/com.macaron-local.learn.plist",
)
APPLE_SILICON = "sys_platform == 'darwin' and platform_machine == 'arm64'"


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("hatchling")
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "-d", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    [wheel] = out.glob("*.whl")
    [sdist] = out.glob("*.tar.gz")
    return {"wheel": wheel, "sdist": sdist}


def test_the_wheel_ships_templates_manifests_the_ui_and_the_entry_point(dist):
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        names = set(wheel.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = wheel.read(info).decode()
        entry_points = wheel.read(info.replace("METADATA", "entry_points.txt")).decode()
    for template in TEMPLATES:
        assert f"macaron_local/{template}" in names
    assert "macaron_local/manifests/embedded.toml" in names
    assert "macaron_local/learn/data/regression.json" in names
    for part in ("profile.toml", "route.md", "lora.md", "intro.md", "summary.md", "handoff.md"):
        assert f"macaron_local/protocol/profiles/embedded/{part}" in names  # the embedded routing profile
    assert "macaron_ui/app.tcss" in names and "macaron_local/daemon/runner.py" in names
    assert "macaron = macaron_ui.main:main" in entry_points
    # Apple silicon gets MLX from the base dependencies; the torch route stays an extra.
    assert f"Requires-Dist: mlx>=0.22; {APPLE_SILICON}".replace("'", '"') in metadata.replace("'", '"')
    assert f"Requires-Dist: mlx-lm>=0.22; {APPLE_SILICON}".replace("'", '"') in metadata.replace("'", '"')
    assert "Provides-Extra: torch" in metadata and "Provides-Extra: mlx" in metadata
    assert "Requires-Dist: torch>=2.4; extra == 'torch'".replace("'", '"') in metadata.replace("'", '"')


def test_the_sdist_has_what_a_rebuild_needs(dist):
    with tarfile.open(dist["sdist"]) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    for template in TEMPLATES:
        assert template in names
    assert {"pyproject.toml", "README.md", "models/embedded.toml", ".ci/run"} <= names


def test_an_unpacked_wheel_runs_from_its_own_files(dist, tmp_path):
    target = tmp_path / "site"
    with zipfile.ZipFile(dist["wheel"]) as wheel:
        wheel.extractall(target)
    env = {
        **os.environ,
        "PYTHONPATH": str(target),
        "MACARON_HOME": str(tmp_path / "home"),
        "HF_HUB_OFFLINE": "1",
        "XDG_CONFIG_HOME": str(tmp_path / "xdg"),
    }

    def macaron(*args: str) -> subprocess.CompletedProcess[str]:
        code = "import sys; from macaron_ui.main import main; sys.exit(main(sys.argv[1:]))"
        return subprocess.run(
            [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
        )

    where = subprocess.run(
        [sys.executable, "-c", "import macaron_local.daemon.units as u; print(u.__file__); print(u.packaging_dir())"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    module, templates = where.stdout.split()
    assert module.startswith(str(target)) and templates == str(target / "macaron_local" / "packaging")

    version = macaron("--version")
    assert version.returncode == 0 and version.stdout.startswith("macaron-local ")
    dry = macaron("daemon", "install", "--dry-run", "--platform", "linux")
    assert dry.returncode == 0, dry.stderr
    assert "OnCalendar=" in dry.stdout and "Persistent=true" in dry.stdout
    doctor = macaron("doctor")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "ok   model             embedded" in doctor.stdout  # found through the wheel's manifests
    ask = macaron("ask", "--max-tokens", "4", "Say hello.")
    assert ask.returncode == 0 and ask.stdout.strip(), ask.stderr
