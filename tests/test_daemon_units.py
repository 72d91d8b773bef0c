"""The scheduler's files: systemd units that systemd itself accepts, a launchd plist that
round-trips through plistlib, and `macaron daemon install --dry-run|--no-enable|uninstall`."""

from __future__ import annotations

import os
import plistlib
import shutil
import stat
import subprocess
import sys
from datetime import time
from pathlib import Path

import pytest
from conftest import run_cli

from macaron_local.daemon.config import DaemonConfig, Window, daemon_config
from macaron_local.daemon.units import render, systemd_quote
from macaron_local.errors import InvalidInputError

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


@pytest.fixture
def fake_exe(tmp_path: Path) -> Path:
    """An executable `macaron` whose path needs quoting and escaping (a space and a %)."""
    folder = tmp_path / "my apps %d"
    folder.mkdir()
    exe = folder / "macaron"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return exe


def write_units(home, config: DaemonConfig, exe: Path, target: Path) -> dict[str, Path]:
    target.mkdir(parents=True, exist_ok=True)
    written = {}
    for unit in render(home, config, "linux", program=[str(exe)]):
        path = target / unit.path.name
        path.write_text(unit.content)
        written[unit.path.suffix] = path
    return written


def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd's unit syntax: [Section] headers, Key=value lines (a key may repeat), # comments."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"not a unit line: {line!r}"
        key, value = line.split("=", 1)
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def systemd_verify(*paths: Path, runtime: Path) -> subprocess.CompletedProcess[str]:
    runtime.mkdir(mode=0o700, exist_ok=True)
    return subprocess.run(
        [SYSTEMD_ANALYZE, "verify", "--user", "--man=no", *map(str, paths)],
        capture_output=True,
        text=True,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime), "SYSTEMD_LOG_LEVEL": "warning"},
        cwd=paths[0].parent,
        timeout=60,
    )


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
def test_systemd_units_pass_systemd_analyze_verify(home, fake_exe, tmp_path):
    config = DaemonConfig(window=Window.parse("23:15-01:15"), every_minutes=20)
    units = write_units(home, config, fake_exe, tmp_path / "units")
    done = systemd_verify(units[".service"], units[".timer"], runtime=tmp_path / "runtime")
    assert done.returncode == 0, done.stderr
    assert "not executable" not in done.stderr and "Failed to parse" not in done.stderr

    # The check has teeth: a broken calendar and a command that is not there are both refused.
    broken = tmp_path / "broken"
    bad = write_units(home, config, tmp_path / "missing" / "macaron", broken)
    bad[".timer"].write_text(bad[".timer"].read_text().replace("OnCalendar=*-*-*", "OnCalendar=nonsense"))
    refused = systemd_verify(bad[".service"], bad[".timer"], runtime=tmp_path / "runtime")
    assert refused.returncode != 0
    assert "not executable" in refused.stderr and "calendar" in refused.stderr


def test_systemd_units_parse_with_the_expected_settings(home, fake_exe, tmp_path):
    config = DaemonConfig(window=Window.parse("02:00-04:00"), every_minutes=30)
    units = write_units(home, config, fake_exe, tmp_path / "units")
    service, timer = parse_unit(units[".service"]), parse_unit(units[".timer"])
    assert service["Service"]["Type"] == ["oneshot"]
    [exec_start] = service["Service"]["ExecStart"]
    # quoted (a space), % doubled (systemd specifiers), then the subcommand
    assert exec_start == f'"{str(fake_exe).replace("%", "%%")}" daemon run'
    assert Path(fake_exe).is_absolute()
    assert service["Service"]["Nice"] == ["19"]
    assert service["Service"]["IOSchedulingClass"] == ["idle"]
    assert service["Service"]["CPUSchedulingPolicy"] == ["idle"]
    assert "HF_HUB_OFFLINE=1" in service["Service"]["Environment"]
    assert timer["Timer"]["OnCalendar"] == ["*-*-* 02,03:00,30:00"]
    assert timer["Timer"]["Persistent"] == ["true"]
    assert timer["Timer"]["Unit"] == ["macaron-learn.service"]
    assert timer["Install"]["WantedBy"] == ["timers.target"]


@pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize(
    ("window", "every", "expected"),
    [
        ("02:00-06:00", 30, ["02:00", "02:30", "03:00", "05:30"]),
        ("23:30-01:00", 30, ["23:30", "00:00", "00:30"]),  # wraps past midnight
        ("01:10-02:00", 20, ["01:10", "01:30", "01:50"]),
    ],
)
def test_on_calendar_fires_exactly_inside_the_window(home, fake_exe, tmp_path, window, every, expected):
    config = DaemonConfig(window=Window.parse(window), every_minutes=every)
    timer = write_units(home, config, fake_exe, tmp_path / "units")[".timer"]
    specs = [line.split("=", 1)[1] for line in timer.read_text().splitlines() if line.startswith("OnCalendar=")]
    times = set()
    for spec in specs:  # ask systemd when each line fires over the next day
        done = subprocess.run(
            [SYSTEMD_ANALYZE, "calendar", "--iterations=48", spec], capture_output=True, text=True, timeout=30
        )
        assert done.returncode == 0, done.stderr
        fired = [line for line in done.stdout.splitlines() if "Next elapse:" in line or "Iter. #" in line]
        times |= {line.split()[-2][:5] for line in fired}
    assert set(expected) <= times
    assert times == {f"{h:02d}:{m:02d}" for h, m in config.fire_times()}
    assert all(config.window.contains(time(int(t[:2]), int(t[3:]))) for t in times)


def test_launchd_plist_round_trips_with_the_expected_keys(home, fake_exe):
    config = DaemonConfig(window=Window.parse("01:00-02:30"), every_minutes=45)
    [unit] = render(home, config, "macos", program=[str(fake_exe)])
    assert unit.path.name == "com.macaron-local.learn.plist" and unit.path.parent.name == "LaunchAgents"
    data = plistlib.loads(unit.content.encode())
    assert plistlib.loads(plistlib.dumps(data)) == data
    assert data["Label"] == "com.macaron-local.learn"
    assert data["ProgramArguments"] == [str(fake_exe), "daemon", "run"]
    assert data["StartCalendarInterval"] == [
        {"Hour": 1, "Minute": 0},
        {"Hour": 1, "Minute": 45},
    ]
    assert data["ProcessType"] == "Background" and data["LowPriorityIO"] is True and data["Nice"] == 19
    assert data["RunAtLoad"] is False
    assert data["EnvironmentVariables"]["MACARON_HOME"] == str(Path(os.environ["MACARON_HOME"]).resolve())
    assert data["EnvironmentVariables"]["HF_HUB_OFFLINE"] == "1"
    assert data["StandardErrorPath"].startswith(str(home.log_dir))


def test_systemd_quote_escapes_what_systemd_would_expand():
    assert systemd_quote("/usr/bin/macaron") == "/usr/bin/macaron"
    assert systemd_quote("/a b/c") == '"/a b/c"'
    assert systemd_quote('/a"b\\c') == '"/a\\"b\\\\c"'
    assert systemd_quote("100%$HOME") == '"100%%$$HOME"'


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux dry run")
def test_dry_run_on_linux_prints_the_timer_and_writes_nothing(tmp_path):
    config_home = tmp_path / "xdg"
    done = run_cli("daemon", "install", "--dry-run", home=tmp_path / "home", XDG_CONFIG_HOME=str(config_home))
    assert done.returncode == 0, done.stderr
    assert f"# {config_home}/systemd/user/macaron-learn.timer" in done.stdout
    assert "OnCalendar=*-*-* 02,03,04,05:00,30:00" in done.stdout and "Persistent=true" in done.stdout
    exec_line = next(line for line in done.stdout.splitlines() if line.startswith("ExecStart="))
    program = exec_line.split("=", 1)[1].split()[0]
    assert Path(program).is_absolute() and Path(program).exists()
    assert not config_home.exists()
    plist = run_cli("daemon", "install", "--dry-run", "--platform", "macos", home=tmp_path / "home")
    assert plist.returncode == 0, plist.stderr
    assert "<key>StartCalendarInterval</key>" in plist.stdout and "LaunchAgents" in plist.stdout
    refused = run_cli("daemon", "install", "--platform", "macos", home=tmp_path / "home")
    assert refused.returncode == 2 and "add --dry-run" in refused.stderr


def test_install_writes_the_units_status_sees_them_and_uninstall_removes_them(tmp_path):
    home, config_home = tmp_path / "home", tmp_path / "xdg"
    env = {"XDG_CONFIG_HOME": str(config_home)}
    done = run_cli("daemon", "install", "--no-enable", home=home, **env)
    assert done.returncode == 0, done.stderr
    timer = config_home / "systemd" / "user" / "macaron-learn.timer"
    assert timer.is_file() and "Persistent=true" in timer.read_text()
    assert stat.S_IMODE(timer.stat().st_mode) == 0o600
    status = run_cli("daemon", "status", home=home, **env)
    assert status.returncode == 0, status.stderr
    assert "schedule: installed" in status.stdout and str(timer) in status.stdout
    gone = run_cli("daemon", "uninstall", home=home, **env)
    assert gone.returncode == 0, gone.stderr
    assert f"removed {timer}" in gone.stdout and not timer.exists()
    assert "not installed" in run_cli("daemon", "status", home=home, **env).stdout


@pytest.mark.parametrize(
    ("table", "needle"),
    [
        ({"window": "2am-6am"}, "window must look like"),
        ({"window": "25:00-06:00"}, "impossible time"),
        ({"window": "03:00-03:00"}, "empty"),
        ({"every_minutes": "often"}, "whole number"),
        ({"idle_minuts": 5}, "unknown [daemon] setting 'idle_minuts'"),
    ],
)
def test_bad_daemon_settings_are_one_line_errors(tmp_path, home, table, needle):
    home.save(daemon=table)
    with pytest.raises(InvalidInputError, match=None) as caught:
        daemon_config(home)
    assert needle in str(caught.value)
    done = run_cli("daemon", "install", "--dry-run", home=os.environ["MACARON_HOME"])
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and needle in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
