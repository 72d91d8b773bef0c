"""Which trainer this Python can import, and on which device it would train.

Two probes. `find_trainer` is cheap (import specs only, no import) and answers every time a
message about learning is shown. `probe_device` really imports the trainer, in a child
process of this same Python: importing torch costs seconds and hundreds of MB, a broken native
build can abort the process that imports it, and a child sees packages that a `pip install`
added after this process started. Both honour what the learner itself uses: the
`learning_backend` setting, and `choose_backend`'s order for `auto`.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass

from macaron_local.errors import MacaronError
from macaron_local.learn.backends import choose_backend
from macaron_local.settings import Settings

#: What each backend imports; all of them must be present.
MODULES = {"torch": ("torch", "transformers", "peft"), "mlx": ("mlx", "mlx_lm")}
LABELS = {"torch": "PyTorch", "mlx": "MLX"}
PROBE_TIMEOUT_S = 180

#: Run by `probe_device` in a child: imports the trainer and prints what it would train on.
_DEVICE_CODE = """
import json, sys
backend = sys.argv[1]
if backend == "torch":
    import torch, transformers, peft
    if torch.cuda.is_available():
        device = "cuda: " + torch.cuda.get_device_name(0)
    else:
        device = "cpu"
    version = torch.__version__
else:
    import mlx.core as mx, mlx_lm
    from importlib.metadata import version as v
    device = "gpu (Metal)" if mx.default_device() == mx.gpu else "cpu"
    version = v("mlx")
print(json.dumps({"device": device, "version": version}))
"""


@dataclass(frozen=True)
class Trainer:
    """The trainer learning would use here; `backend` None when none is importable."""

    backend: str | None
    wanted: str  # the learning_backend setting: auto | torch | mlx
    missing: tuple[str, ...] = ()  # modules the wanted backend lacks

    @property
    def label(self) -> str:
        return LABELS.get(self.backend or "", "none")


@dataclass(frozen=True)
class TrainerDevice:
    """What importing the trainer in a child process found."""

    ok: bool
    device: str | None
    version: str | None
    detail: str


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a half-imported or blocked module
        return False


def find_trainer(settings: Settings) -> Trainer:
    """The backend `macaron learn` would pick, if its modules can be found (nothing imported)."""
    importlib.invalidate_caches()  # a pip install in this process's lifetime must be seen
    wanted = str(settings.get("learning_backend") or "auto")
    if wanted in MODULES:
        missing = tuple(m for m in MODULES[wanted] if not _present(m))
        return Trainer(None if missing else wanted, wanted, missing)
    try:
        chosen = choose_backend(wanted)
    except MacaronError:
        return Trainer(None, wanted, tuple(m for m in MODULES["torch"] if not _present(m)))
    missing = tuple(m for m in MODULES[chosen] if not _present(m))
    return Trainer(None if missing else chosen, wanted, missing)


def probe_device(backend: str, python: str | None = None, timeout: float = PROBE_TIMEOUT_S) -> TrainerDevice:
    """Import `backend` in a child of this Python and report its device (cuda / gpu / cpu)."""
    argv = [python or sys.executable, "-c", _DEVICE_CODE, backend]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return TrainerDevice(False, None, None, f"importing {LABELS[backend]} took over {timeout:.0f} s")
    except OSError as exc:
        return TrainerDevice(False, None, None, f"could not start {argv[0]}: {exc}")
    if done.returncode != 0:
        errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
        last = errors[-1] if errors else f"exit code {done.returncode}"
        return TrainerDevice(False, None, None, f"{LABELS[backend]} is installed but does not import: {last}")
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return TrainerDevice(False, None, None, f"{LABELS[backend]} probe printed nothing readable")
    device, version = str(found["device"]), str(found["version"])
    return TrainerDevice(True, device, version, f"{LABELS[backend]} {version} on {device}")
