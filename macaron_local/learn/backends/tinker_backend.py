"""A remote trainer over the Tinker API (`tinker`, or MinT's compatible `mint`): for a base the
user's machine cannot train (Tall's BF16 weights are about 70 GB).

Off by default. When it is on, the conversations a run trains on leave the machine: each
step's rollouts (prompt and reply tokens, the sampler's log-probabilities and the advantages)
are sent to the service, which holds the LoRA and the optimizer. What comes back is the
adapter as a PEFT folder (`save_weights_external`, then one signed URL per file). From there
the candidate is handled as every other one: converted to GGUF here, checked against llama.cpp
(parity) and gated on held-out feedback before anything is deployed. The key lives in the OS
keyring (`macaron auth tinker-key`).

The loss is Tinker's built-in `importance_sampling`: per reply token, the advantage times the
ratio of the trained policy to the sampler's probability, which is this project's policy term
(learn/losses.py) with the sampler's log-probabilities as the behaviour policy.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from macaron_local.adapters.peft import convert_peft_dir
from macaron_local.adapters.validate import BaseModelInfo
from macaron_local.errors import InvalidInputError, MacaronError

SDKS = {"tinker": "tinker", "mint": "mint"}  # MinT: `import mint as tinker`
LOSS = "importance_sampling"
MAX_FILE_BYTES = 64 * 2**30  # Tall's experts are 7-14 GiB at BF16
LEAVES_THE_MACHINE = (
    "remote training is on: the conversations this run learns from are sent to {service} "
    "(prompt and reply tokens, log-probabilities, rewards), and the adapter comes back from it"
)


class RemoteTrainerError(MacaronError):
    """The remote trainer could not be reached, refused a request, or sent something unusable."""


def load_sdk(name: str) -> Any:
    if name not in SDKS:
        raise InvalidInputError(f"remote trainer must be one of {', '.join(SDKS)} (got {name!r})")
    try:
        return importlib.import_module(SDKS[name])
    except ImportError:
        package = "tinker" if name == "tinker" else "mindlab-toolkit"
        raise MacaronError(f"the {name} SDK is not installed; pip install {package}") from None


def datum_arrays(
    prompt: Sequence[int], completion: Sequence[int], sampler_logprobs: Sequence[float], advantage: float
) -> dict[str, np.ndarray]:
    """One rollout in Tinker's shifted layout: the model reads prompt + reply[:-1] and is scored
    on the next token at each position. Prompt positions carry no advantage (they are not the
    policy's choice), reply positions carry the group's advantage and the sampler's log-prob."""
    if len(sampler_logprobs) != len(completion) or not prompt or not completion:
        raise ValueError("a rollout needs a prompt, a reply and one sampler log-prob per reply token")
    tokens = [*prompt, *completion]
    n_prompt = len(prompt) - 1  # targets that are still prompt
    return {
        "model_input": np.asarray(tokens[:-1], dtype=np.int64),
        "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
        "logprobs": np.concatenate([np.zeros(n_prompt), np.asarray(sampler_logprobs)]).astype(np.float32),
        "advantages": np.concatenate([np.zeros(n_prompt), np.full(len(completion), advantage)]).astype(np.float32),
    }


def step_datums(sdk: Any, rollouts: Any, advantages: Sequence[Sequence[float]]) -> list[Any]:
    """A learning step's rollouts (learn.loop.StepRollouts) as the SDK's Datum objects; groups
    whose members all scored alike (advantage 0 throughout) are left out: they teach nothing."""
    types = sdk.types
    datums = []
    flat = [a for group in advantages for a in group]
    if len(flat) != len(rollouts.completions):
        raise ValueError("one advantage per rollout")
    for prompt, completion, sampler, advantage in zip(
        rollouts.prompts, rollouts.completions, rollouts.sampler, flat, strict=True
    ):
        if advantage == 0.0 or not completion:
            continue
        arrays = datum_arrays(prompt, completion, sampler, float(advantage))
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(arrays["model_input"].tolist()),
                loss_fn_inputs={k: arrays[k] for k in ("target_tokens", "logprobs", "advantages")},
            )
        )
    return datums


def safe_relative(name: str) -> PurePosixPath:
    path = PurePosixPath(name)
    if path.is_absolute() or not path.parts or any(p in ("..", "") for p in path.parts) or "\\" in name:
        raise RemoteTrainerError(f"the trainer sent an unsafe file name: {name!r}")
    return path


def download_files(urls: Mapping[str, str], dest: Path, *, timeout_s: float = 600.0) -> Path:
    """Fetch every file of a checkpoint into `dest` (a new folder, renamed into place whole):
    a half-downloaded adapter never looks like a finished one."""
    dest = Path(dest)
    if dest.exists():
        raise RemoteTrainerError(f"{dest} already exists")
    if not urls:
        raise RemoteTrainerError("the trainer's checkpoint has no files")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        for name, url in urls.items():
            relative = safe_relative(name)
            if not url.startswith(("https://", "http://127.0.0.1", "http://localhost")):
                raise RemoteTrainerError(f"refusing a plain-HTTP download of {name} from {url.split('/')[2]}")
            target = staging.joinpath(*relative.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            _fetch(url, target, timeout_s)
        os.replace(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return dest


def _fetch(url: str, target: Path, timeout_s: float) -> None:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response, open(target, "wb") as out:
            written = 0
            while chunk := response.read(1 << 20):
                written += len(chunk)
                if written > MAX_FILE_BYTES:
                    raise RemoteTrainerError(f"{target.name} is larger than {MAX_FILE_BYTES >> 30} GiB")
                out.write(chunk)
    except OSError as exc:
        raise RemoteTrainerError(f"downloading {target.name} failed: {exc}") from None


def peft_to_candidate(folder: Path, base: BaseModelInfo, out_path: Path) -> Path:
    """The downloaded PEFT folder as a validated GGUF candidate (parity and gate follow)."""
    if not (folder / "adapter_config.json").is_file():
        raise RemoteTrainerError(f"{folder} is not a PEFT adapter folder (no adapter_config.json)")
    return convert_peft_dir(folder, base, out_path, dtype="F16", task_name="personal")


class TinkerTrainer:
    """One LoRA training run on the service: `step` per learning step, `export` at the end."""

    def __init__(
        self,
        base_model: str,
        *,
        rank: int,
        lr: float,
        seed: int = 0,
        sdk: str = "tinker",
        api_key: str | None = None,
        service: Any | None = None,
    ) -> None:
        self.sdk = load_sdk(sdk)
        self.lr = lr
        if service is None:
            if not api_key:
                raise MacaronError(f"no {sdk} API key in the keyring; run `macaron auth tinker-key`")
            service = self.sdk.ServiceClient(api_key=api_key)
        self.service = service
        try:
            self.client = service.create_lora_training_client(base_model, rank=rank, seed=seed).result()
        except Exception as exc:  # the SDK's own errors are many; one line says which
            raise RemoteTrainerError(f"{sdk} could not start a LoRA run on {base_model}: {exc}") from None

    def step(self, rollouts: Any, advantages: Sequence[Sequence[float]]) -> float:
        """Send one step's rollouts, apply the gradients; the service's loss comes back."""
        datums = step_datums(self.sdk, rollouts, advantages)
        if not datums:
            return 0.0
        try:
            pending = self.client.forward_backward(datums, LOSS)
            update = self.client.optim_step(self.sdk.types.AdamParams(learning_rate=self.lr))
            output = pending.result()
            update.result()
        except Exception as exc:
            raise RemoteTrainerError(f"a remote training step failed: {exc}") from None
        metrics = getattr(output, "metrics", {}) or {}
        return float(next((v for k, v in metrics.items() if k.startswith("loss")), 0.0))

    def export(self, name: str, dest: Path) -> Path:
        """The trained adapter as a PEFT folder at `dest` on this machine."""
        try:
            path = self.client.save_weights_external(name).result().path
            urls = self.service.create_rest_client().get_external_weights_urls(path).result().urls
        except Exception as exc:
            raise RemoteTrainerError(f"the remote trainer could not export the adapter: {exc}") from None
        return download_files(urls, dest)
