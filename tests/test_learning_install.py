"""Which trainer each machine gets, and the real `python -m pip install` that installs it, run
against a local fake package served on 127.0.0.1 (nothing is downloaded from the internet)."""

from __future__ import annotations

import sys
import threading
import tomllib
from pathlib import Path

import pytest
from fake_pip_index import ISOLATED_PIP, fake_index, fake_plan

from macaron_local.errors import MacaronError
from macaron_local.learning_setup import LearningSetup
from macaron_local.learning_setup.install import (
    MLX_REQUIREMENTS,
    TORCH_CPU_INDEX,
    TORCH_CUDA_INDEX,
    TORCH_REQUIREMENTS,
    Machine,
    failure_line,
    find_nvidia,
    parse_nvidia_smi,
    parse_proc_version,
    plan_for,
    run_plan,
)

ROOT = Path(__file__).parents[1]


def machine(**changes) -> Machine:
    base = {
        "system": "linux",
        "arch": "x86_64",
        "nvidia": None,
        "python": "/venv/bin/python",
        "prefix": "/venv",
        "externally_managed": False,
    }
    return Machine(**{**base, **changes})


def test_linux_without_a_gpu_gets_torchs_cpu_build_then_transformers_and_peft():
    plan = plan_for(machine())
    assert plan.available and plan.backend == "torch" and plan.build == "CPU build"
    assert plan.steps == (("--index-url", TORCH_CPU_INDEX, "torch>=2.4"), ("transformers>=5,<6", "peft>=0.17"))
    assert plan.commands()[0][:6] == ["/venv/bin/python", "-m", "pip", "install", "--progress-bar", "raw"]
    assert plan.size_text == "about 220 MB" and "/venv" in plan.summary()


def test_an_nvidia_gpu_gets_the_cuda_build_and_says_which_card():
    plan = plan_for(machine(nvidia="NVIDIA H200 (driver 570.86.15)", arch="aarch64"))
    assert plan.build == "CUDA 12.8 build" and plan.steps[0][:2] == ("--index-url", TORCH_CUDA_INDEX)
    assert "found NVIDIA H200" in plan.summary() and "3.0 GB" in plan.summary()


def test_apple_silicon_gets_mlx_and_intel_macs_and_system_pythons_are_told_why_not():
    mlx = plan_for(machine(system="darwin", arch="arm64"))
    assert mlx.backend == "mlx" and mlx.steps == (MLX_REQUIREMENTS,)
    intel = plan_for(machine(system="darwin", arch="x86_64"))
    assert not intel.available and "Intel Macs" in intel.summary()
    system = plan_for(machine(externally_managed=True))
    assert not system.available and "virtual environment" in system.blocked
    assert not plan_for(machine(system="win32")).available
    assert not plan_for(machine(arch="s390x")).available


def test_the_requirements_are_the_packages_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert tuple(project["optional-dependencies"]["torch"]) == TORCH_REQUIREMENTS
    apple = [d.split(";")[0].strip() for d in project["dependencies"] if "platform_machine == 'arm64'" in d]
    assert tuple(apple) == MLX_REQUIREMENTS


def test_nvidia_detection_reads_nvidia_smi_and_the_kernel_modules_proc_file(tmp_path):
    assert parse_nvidia_smi("NVIDIA H200, 570.86.15\n") == "NVIDIA H200 (driver 570.86.15)"
    assert parse_nvidia_smi("A, 1\nB, 1\n") == "A and 1 more (driver 1)"
    assert parse_nvidia_smi("") is None
    line = "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15  Thu Jan 23 2025\nGCC version: gcc 12"
    assert parse_proc_version(line) == "NVIDIA GPU (driver 570.86.15)"
    proc = tmp_path / "nvidia"
    assert find_nvidia(proc=proc, smi=None) is None
    proc.mkdir()
    (proc / "version").write_text(line)
    assert find_nvidia(proc=proc, smi=None) == "NVIDIA GPU (driver 570.86.15)"


@pytest.fixture
def index(tmp_path):
    with fake_index(tmp_path / "index") as served:
        yield served


def test_pip_installs_the_fake_package_and_reports_its_real_bytes(index, tmp_path):
    url, wheel = index
    target = tmp_path / "site"
    seen = []
    result = run_plan(fake_plan(url, target), seen.append, pip=ISOLATED_PIP)
    assert result.ok, result.output_tail
    assert (target / "macaron_fake_trainer" / "payload.bin").stat().st_size == 3_000_000
    size = wheel.stat().st_size
    assert seen[-1].done_bytes == size and seen[-1].total_bytes == size  # the estimate grew to the real size
    assert all(a.done_bytes <= b.done_bytes for a, b in zip(seen, seen[1:], strict=False))
    assert any("Successfully installed macaron-fake-trainer" in line for line in result.output_tail)


def test_a_package_pip_cannot_find_fails_in_one_line_with_pips_reason(index, tmp_path):
    url, _ = index
    result = run_plan(fake_plan(url, tmp_path / "site", "macaron-no-such-trainer"), pip=ISOLATED_PIP)
    assert not result.ok and result.returncode != 0
    line = failure_line(result)
    assert line.startswith("pip could not install the trainer") and "No matching distribution" in line


def test_a_cancel_stops_pip_and_installs_nothing(index, tmp_path):
    url, _ = index
    cancel = threading.Event()
    cancel.set()  # cancelled as soon as pip starts
    result = run_plan(fake_plan(url, tmp_path / "site"), pip=ISOLATED_PIP, cancel=cancel)
    assert result.cancelled and not (tmp_path / "site" / "macaron_fake_trainer").exists()
    assert failure_line(result) == "the trainer install was cancelled; nothing was changed"


def test_setup_reports_a_pip_run_that_did_not_bring_a_trainer(index, tmp_path, home, monkeypatch):
    """The install ran and worked, but torch is still not importable (the fake is not torch):
    setup must say so, not claim learning is ready."""
    url, _ = index
    for name in ("torch", "mlx", "mlx_lm"):
        monkeypatch.setitem(sys.modules, name, None)  # this process cannot import a trainer
    setup = LearningSetup(home, schedule_mode="dry-run", pip=ISOLATED_PIP, plan=fake_plan(url, tmp_path / "site"))
    with pytest.raises(MacaronError, match="still cannot be found"):
        setup.accept()
    assert setup.choice() == "accepted"  # the consent was given and is kept
