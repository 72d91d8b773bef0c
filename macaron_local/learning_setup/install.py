"""Which trainer this machine should get, how big it is, and the `pip install` that gets it.

The trainer goes into the app's own environment (`sys.executable`'s, a venv or pipx's), the
one the nightly run starts. MLX on Apple silicon; PyTorch elsewhere: torch's CUDA build when an
NVIDIA GPU is found, its CPU build otherwise. PyPI's Linux torch is the CUDA build (gigabytes),
so torch comes from the PyTorch index of the right build first, then transformers and peft
from the usual index; pip keeps the torch it just installed because it satisfies peft.

`plan_for` is pure (a `Machine` in, a plan out) so every machine is tested here; `run_plan`
runs the real `python -m pip install --progress-bar raw` and turns pip's "Progress N of M"
lines into a progress callback. The pip command is a parameter, so tests install a local fake
package and never download anything.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from macaron_local.errors import MacaronError

#: The `[torch]` extra and the Apple-silicon MLX requirements of pyproject.toml (a test keeps
#: them equal), so the trainer installed here is the one `pip install 'macaron-local[torch]'` gives.
TORCH_REQUIREMENTS = ("torch>=2.4", "transformers>=5,<6", "peft>=0.17")
MLX_REQUIREMENTS = ("mlx>=0.22", "mlx-lm>=0.22")
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
TORCH_CUDA_INDEX = "https://download.pytorch.org/whl/cu128"

#: Download sizes, stated before the user agrees. CPU: measured from pip's resolution for
#: Linux x86_64 on top of the base install (torch 2.13.0+cpu 192 MB, transformers 12.6 MB,
#: sympy 6.3 MB, tokenizers 3.4 MB, networkx 2.1 MB, the rest under 1 MB each). CUDA and MLX are
#: estimates from the published wheels (torch's CUDA 12.8 wheel alone is about 1.1 GB, NVIDIA's
#: CUDA libraries add the rest). The progress bar counts the real bytes.
SIZE_TORCH_CPU = 220_000_000
SIZE_TORCH_CUDA = 3_000_000_000
SIZE_MLX = 100_000_000

NVIDIA_PROC = Path("/proc/driver/nvidia")
SMI_TIMEOUT_S = 10
_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)\s*$")


@dataclass(frozen=True)
class Machine:
    """The facts the choice depends on; `this_machine()` reads them."""

    system: str  # sys.platform: linux, darwin, win32
    arch: str  # platform.machine(): x86_64, aarch64, arm64
    nvidia: str | None  # "NVIDIA H200 (driver 570.86)" when an NVIDIA GPU and driver are found
    python: str  # the interpreter whose environment receives the trainer
    prefix: str  # that environment's folder
    externally_managed: bool  # a system Python that refuses pip (PEP 668), not a venv


@dataclass(frozen=True)
class TrainerPlan:
    """What to install and why; `blocked` says why nothing can be installed on this machine."""

    backend: str | None  # torch | mlx
    build: str  # "CPU build", "CUDA 12.8 build", "Metal"
    why: str
    steps: tuple[tuple[str, ...], ...] = ()  # arguments after `pip install`, one tuple per pip run
    download_bytes: int = 0
    python: str = ""
    prefix: str = ""
    blocked: str | None = None

    @property
    def available(self) -> bool:
        return self.blocked is None and bool(self.steps)

    @property
    def size_text(self) -> str:
        return f"about {human_bytes(self.download_bytes)}"

    def summary(self) -> str:
        """One sentence for the consent question."""
        if not self.available:
            return f"No trainer can be installed here: {self.blocked}"
        name = {"torch": "PyTorch", "mlx": "MLX"}.get(self.backend or "", self.backend or "")
        return f"{name}, {self.build} ({self.why}): a download of {self.size_text} into {self.prefix}"

    def commands(self, pip: Sequence[str] | None = None) -> list[list[str]]:
        """The pip command lines this plan runs, in order."""
        base = list(pip or pip_command(self.python))
        return [[*base, "install", "--progress-bar", "raw", *step] for step in self.steps]


@dataclass(frozen=True)
class InstallProgress:
    """Where an install is: bytes downloaded of the (estimated, then real) total, and pip's line."""

    step: int  # 1-based pip run
    steps: int
    done_bytes: int
    total_bytes: int
    line: str


@dataclass
class InstallResult:
    ok: bool
    cancelled: bool = False
    returncode: int | None = None
    output_tail: list[str] = field(default_factory=list)


def human_bytes(count: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            value = count / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{int(count)} B"


def pip_command(python: str | None = None) -> list[str]:
    return [python or sys.executable, "-m", "pip"]


# ----------------------------------------------------------------- the machine
def parse_nvidia_smi(output: str) -> str | None:
    """`nvidia-smi --query-gpu=name,driver_version --format=csv,noheader`: "NAME, 570.86.15"."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not lines or "," not in lines[0]:
        return None
    name, driver = (part.strip() for part in lines[0].rsplit(",", 1))
    more = f" and {len(lines) - 1} more" if len(lines) > 1 else ""
    return f"{name}{more} (driver {driver})"


def parse_proc_version(text: str) -> str | None:
    """/proc/driver/nvidia/version: "NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15 ..."."""
    match = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
    return f"NVIDIA GPU (driver {match.group(1)})" if match else None


def find_nvidia(proc: Path = NVIDIA_PROC, smi: str | None = "nvidia-smi") -> str | None:
    """An NVIDIA GPU with its driver loaded: nvidia-smi first (it names the card), else the
    kernel module's /proc entry (a driver without the tools)."""
    tool = shutil.which(smi) if smi else None
    if tool:
        try:
            done = subprocess.run(
                [tool, "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=SMI_TIMEOUT_S,
                check=False,
            )
            if done.returncode == 0 and (found := parse_nvidia_smi(done.stdout)):
                return found
        except (OSError, subprocess.SubprocessError):
            pass
    try:
        return parse_proc_version((proc / "version").read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None


def externally_managed(prefix: str, base_prefix: str) -> bool:
    """PEP 668: a distribution's Python marks itself, and pip refuses to install into it."""
    if prefix != base_prefix:
        return False  # a virtual environment is never externally managed
    return (Path(sysconfig.get_path("stdlib")) / "EXTERNALLY-MANAGED").is_file()


def this_machine() -> Machine:
    return Machine(
        system=sys.platform,
        arch=platform.machine().lower(),
        nvidia=find_nvidia() if sys.platform.startswith("linux") else None,
        python=sys.executable,
        prefix=sys.prefix,
        externally_managed=externally_managed(sys.prefix, sys.base_prefix),
    )


# ----------------------------------------------------------------- the plan
def plan_for(machine: Machine) -> TrainerPlan:
    """The trainer this machine should get, with its size and the pip runs that install it."""
    where = {"python": machine.python, "prefix": machine.prefix}
    if machine.externally_managed:
        blocked = (
            f"the app runs on the system's Python ({machine.prefix}), which pip may not change; "
            "install macaron in a virtual environment (see the README's first command)"
        )
        return TrainerPlan(None, "", "", blocked=blocked, **where)
    if machine.system == "darwin":
        if machine.arch == "arm64":
            steps = (MLX_REQUIREMENTS,)
            return TrainerPlan("mlx", "Metal", "Apple silicon", steps, SIZE_MLX, **where)
        blocked = "Intel Macs have neither MLX (Apple silicon only) nor a PyTorch build this app can use (2.4 or later)"
        return TrainerPlan(None, "", "", blocked=blocked, **where)
    if not machine.system.startswith("linux"):
        return TrainerPlan(None, "", "", blocked=f"nightly learning runs on Linux and macOS, not {machine.system}")
    if machine.arch not in ("x86_64", "amd64", "aarch64", "arm64"):
        return TrainerPlan(None, "", "", blocked=f"PyTorch publishes no Linux build for {machine.arch}", **where)
    torch, rest = TORCH_REQUIREMENTS[0], TORCH_REQUIREMENTS[1:]
    if machine.nvidia:
        steps = (("--index-url", TORCH_CUDA_INDEX, torch), rest)
        return TrainerPlan("torch", "CUDA 12.8 build", f"found {machine.nvidia}", steps, SIZE_TORCH_CUDA, **where)
    steps = (("--index-url", TORCH_CPU_INDEX, torch), rest)
    return TrainerPlan("torch", "CPU build", "no NVIDIA GPU found", steps, SIZE_TORCH_CPU, **where)


# ----------------------------------------------------------------- running pip
def run_plan(
    plan: TrainerPlan,
    on_progress: Callable[[InstallProgress], None] | None = None,
    *,
    pip: Sequence[str] | None = None,
    cancel: threading.Event | None = None,
) -> InstallResult:
    """Run the plan's pip commands one after the other; stop at the first failure or a cancel.

    A cancel terminates pip. Each pip run downloads everything before it installs anything, so
    a cancel during a download installs nothing of that run (an earlier run's torch stays).
    """
    if not plan.available:
        raise MacaronError(plan.summary())
    commands = plan.commands(pip)
    done_files = 0  # bytes of the files pip finished downloading
    total = plan.download_bytes
    tail: list[str] = []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    for number, argv in enumerate(commands, start=1):
        try:
            process = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env
            )
        except OSError as exc:
            raise MacaronError(f"could not start pip ({argv[0]}): {exc}") from None
        stop = threading.Event()
        if cancel is not None:
            threading.Thread(target=_terminate_on_cancel, args=(process, cancel, stop), daemon=True).start()
        current, current_total = 0, 0
        assert process.stdout is not None
        for raw in process.stdout:
            line = raw.rstrip("\n")
            match = _PROGRESS.match(line)
            if match:
                current, current_total = int(match.group(1)), int(match.group(2))
                if current_total and current >= current_total:
                    done_files += current_total
                    current, current_total = 0, 0
            elif line.strip():
                tail = [*tail[-19:], line]
            total = max(total, done_files + current_total)
            if on_progress is not None:
                shown = line if not match else (tail[-1] if tail else "")
                on_progress(InstallProgress(number, len(commands), done_files + current, total, shown))
        returncode = process.wait()
        stop.set()
        if cancel is not None and cancel.is_set():
            return InstallResult(False, True, returncode, tail)
        if returncode != 0:
            return InstallResult(False, False, returncode, tail)
    return InstallResult(True, False, 0, tail)


def _terminate_on_cancel(process: subprocess.Popen, cancel: threading.Event, stop: threading.Event) -> None:
    while not stop.is_set() and process.poll() is None:
        if cancel.wait(0.2):
            process.terminate()
            return


def failure_line(result: InstallResult) -> str:
    """pip's own reason, for a one-line error."""
    if result.cancelled:
        return "the trainer install was cancelled; nothing was changed"
    errors = [line.strip() for line in result.output_tail if line.strip().startswith("ERROR")]
    reason = errors[-1] if errors else (result.output_tail[-1].strip() if result.output_tail else "no output")
    return f"pip could not install the trainer (exit {result.returncode}): {reason}"
