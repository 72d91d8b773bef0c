"""Render the scheduler's files from the templates in `packaging/`: systemd (Linux), launchd (macOS).

Rendering is pure (settings in, file paths and text out), so `--dry-run` prints exactly what
`install` writes and tests check the text with the real parsers (`systemd-analyze verify`,
`plistlib`). The units point at the absolute path of the installed `macaron`, so they keep
working whatever PATH the scheduler runs with.
"""

from __future__ import annotations

import os
import plistlib
import re
import shutil
import string
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from macaron_local.daemon.config import DaemonConfig
from macaron_local.errors import InvalidInputError
from macaron_local.settings import HOME_ENV, Settings

SERVICE_NAME = "macaron-learn.service"
TIMER_NAME = "macaron-learn.timer"
LAUNCHD_LABEL = "com.macaron-local.learn"
PLATFORMS = ("linux", "macos")
#: The scheduled run never downloads; this keeps huggingface_hub from even trying.
ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
_SYSTEMD_PLAIN = re.compile(r"^[A-Za-z0-9/._+\-=:,@]+$")


@dataclass(frozen=True)
class UnitFile:
    path: Path
    content: str


def packaging_dir() -> Path:
    """`macaron_local/packaging` in a wheel; the repository's `packaging/` in a checkout."""
    packaged = Path(__file__).parents[1] / "packaging"
    return packaged if packaged.is_dir() else Path(__file__).parents[2] / "packaging"


def current_platform() -> str:
    if sys.platform == "darwin":
        return "macos"
    if sys.platform.startswith("linux"):
        return "linux"
    raise InvalidInputError(f"the learning daemon runs on Linux (systemd) and macOS (launchd), not {sys.platform}")


def program_arguments() -> list[str]:
    """The absolute command that runs `macaron`: this installation's own entry point.

    In order: the `macaron` script that started us, the one next to this Python (a venv or
    pipx's venv), the one on PATH, and finally `python -m macaron_local`.
    """
    started = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if started is not None and started.name == "macaron" and started.is_file():
        return [str(started.resolve())]
    beside = Path(sys.executable).parent / "macaron"
    if beside.is_file() and os.access(beside, os.X_OK):
        return [str(beside.absolute())]
    found = shutil.which("macaron")
    if found:
        return [str(Path(found).resolve())]
    return [str(Path(sys.executable).absolute()), "-m", "macaron_local"]


def environment() -> dict[str, str]:
    env = dict(ENVIRONMENT)
    if os.environ.get(HOME_ENV):
        env[HOME_ENV] = str(Path(os.environ[HOME_ENV]).expanduser().resolve())
    return env


def systemd_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "systemd" / "user"


def launchd_dir() -> Path:
    return Path.home() / "Library" / "LaunchAgents"


# ----------------------------------------------------------------- systemd
def systemd_quote(word: str) -> str:
    """One word of a systemd command line or assignment: quoted when needed; `%` and `$`
    doubled so systemd's specifier and variable expansion leave them alone."""
    word = word.replace("%", "%%").replace("$", "$$")
    if _SYSTEMD_PLAIN.match(word):
        return word
    return '"' + word.replace("\\", "\\\\").replace('"', '\\"') + '"'


def on_calendar_lines(config: DaemonConfig) -> list[str]:
    """`OnCalendar=` lines: hours that share the same minutes are folded into one line."""
    by_minutes: dict[tuple[int, ...], list[int]] = {}
    hours: dict[int, list[int]] = {}
    for hour, minute in config.fire_times():
        hours.setdefault(hour, []).append(minute)
    for hour, minutes in hours.items():
        by_minutes.setdefault(tuple(sorted(minutes)), []).append(hour)
    lines = []
    for minutes, hour_list in by_minutes.items():
        hh = ",".join(f"{h:02d}" for h in sorted(hour_list))
        mm = ",".join(f"{m:02d}" for m in minutes)
        lines.append(f"OnCalendar=*-*-* {hh}:{mm}:00")
    return lines


def render_systemd(settings: Settings, config: DaemonConfig, program: list[str] | None = None) -> list[UnitFile]:
    templates = packaging_dir() / "systemd"
    command = [*(program or program_arguments()), "daemon", "run"]
    env_lines = [f"Environment={systemd_quote(f'{k}={v}')}" for k, v in environment().items()]
    values = {
        "exec_start": " ".join(systemd_quote(word) for word in command),
        "environment": "\n".join(env_lines),
        "on_calendar": "\n".join(on_calendar_lines(config)),
        "every_minutes": str(config.every_minutes),
        "window": str(config.window),
    }
    target = systemd_dir()
    return [
        UnitFile(target / name, string.Template((templates / name).read_text("utf-8")).substitute(values))
        for name in (SERVICE_NAME, TIMER_NAME)
    ]


# ----------------------------------------------------------------- launchd
def _fill(node: Any, values: dict[str, Any]) -> Any:
    """Substitute `${name}` placeholders in a parsed plist: a string that is exactly one
    placeholder takes the value's type (a list is spliced into its parent list)."""
    if isinstance(node, str):
        whole = re.fullmatch(r"\$\{(\w+)\}", node)
        if whole and not isinstance(values[whole.group(1)], str):
            return values[whole.group(1)]
        return string.Template(node).substitute({k: v for k, v in values.items() if isinstance(v, str)})
    if isinstance(node, dict):
        return {key: _fill(value, values) for key, value in node.items()}
    if isinstance(node, list):
        filled: list[Any] = []
        for item in node:
            value = _fill(item, values)
            filled.extend(value if isinstance(value, list) else [value])
        return filled
    return node


def render_launchd(settings: Settings, config: DaemonConfig, program: list[str] | None = None) -> list[UnitFile]:
    name = f"{LAUNCHD_LABEL}.plist"
    template = plistlib.loads((packaging_dir() / "launchd" / name).read_bytes())
    values: dict[str, Any] = {
        "label": LAUNCHD_LABEL,
        "program_arguments": [*(program or program_arguments()), "daemon", "run"],
        "calendar": [{"Hour": hour, "Minute": minute} for hour, minute in config.fire_times()],
        "environment": environment(),
        "log_dir": str(settings.log_dir),
    }
    content = plistlib.dumps(_fill(template, values), sort_keys=False).decode("utf-8")
    return [UnitFile(launchd_dir() / name, content)]


def render(settings: Settings, config: DaemonConfig, platform: str, program: list[str] | None = None) -> list[UnitFile]:
    if platform not in PLATFORMS:
        raise InvalidInputError(f"unknown platform {platform!r} (use linux or macos)")
    renderer = render_systemd if platform == "linux" else render_launchd
    return renderer(settings, config, program)
