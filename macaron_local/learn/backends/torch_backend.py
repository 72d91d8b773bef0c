"""The PyTorch backend: transformers loads the same GGUF the engine runs (dequantized), peft adds
LoRA to every linear layer, AdamW trains it. CUDA when present, else CPU.

The KL reference is the same model with the adapter disabled, so the base exists once in
memory. On Tall (`qwen3_5_moe`, loaded from the manifest's trainer checkpoint, in 8 or 4 bits on
a GPU smaller than its BF16 weights) the slot's expert is a second, frozen peft adapter stacked
under the personal one (`stack_expert`), and the reference is the expert alone (see
`learn.stacking` for why, and for the personal adapter's targets).

Export goes through PEFT's own `save_pretrained`, then our PEFT->GGUF converter: the same
path Macaron's published experts take, tested end to end against a numpy reference.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from macaron_local.errors import MacaronError
from macaron_local.learn.backends.base import (
    Batch,
    Objective,
    StepOutcome,
    real_lengths,
    step_is_finite,
    sub_batches,
)
from macaron_local.learn.backends.checkpoint import (
    bitsandbytes_config,
    checkpoint_bytes,
    choose_quantization,
    resolve_checkpoint,
)
from macaron_local.learn.stacking import personal_targets, stacks_experts

PERSONAL = "default"  # peft's name for the trainable adapter
EXPERT = "expert"  # the frozen expert stacked under it


def _require_torch():
    try:
        import peft  # noqa: F401
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise MacaronError(
            "learning with the torch backend needs the training extras: pip install 'macaron-local[torch]'"
        ) from None
    return torch


class TorchBackend:
    name = "torch"
    lora_transposed = False

    def __init__(self, lr: float = 1e-4, device: str | None = None, threads: int | None = None) -> None:
        torch = _require_torch()
        self.torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if threads or self.device == "cpu":
            torch.set_num_threads(threads or max(1, os.cpu_count() or 1))
        self.lr = lr
        self.model = None
        self.optimizer = None
        self.quantization: str | None = None
        self.expert_source: Path | None = None
        self._lora_params: dict | None = None  # short name -> the personal LoRA's parameter

    @property
    def stacks_experts(self) -> bool:
        """True where the slot's expert must stay a frozen LoRA (Tall), not be folded."""
        return self.model is not None and stacks_experts(self._config().model_type)

    def _config(self):
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return inner.config

    def load(self, base_gguf: Path, checkpoint: str | None = None) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        base_gguf = Path(base_gguf)
        dtype = self.torch.float32
        if checkpoint:  # a local directory or the local cache: learning never downloads
            local = resolve_checkpoint(checkpoint)
            source = {"pretrained_model_name_or_path": str(local), "local_files_only": True}
            if self.device == "cuda":
                dtype = self.torch.bfloat16
                gpu = self.torch.cuda.get_device_properties(0).total_memory
                self.quantization = choose_quantization(checkpoint_bytes(local), gpu)
                if self.quantization:
                    source["quantization_config"] = bitsandbytes_config(self.quantization, self.torch)
                    source["device_map"] = {"": 0}
        else:
            source = {"pretrained_model_name_or_path": str(base_gguf.parent), "gguf_file": base_gguf.name}
        try:
            model = AutoModelForCausalLM.from_pretrained(**source, dtype=dtype)
        except (ValueError, OSError, KeyError) as exc:
            raise MacaronError(
                f"transformers cannot load {checkpoint or base_gguf} for training ({exc}); "
                "name a checkpoint of the same base in the model's manifest ([training] checkpoint) "
                "and download it once with `hf download <checkpoint>`"
            ) from None
        if self.quantization:  # bitsandbytes placed it; float32 norms, input grads for the LoRA
            from peft import prepare_model_for_kbit_training

            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        else:
            model = model.to(self.device)
        self.model = model
        self.model.config.use_cache = False

    def linear_weight_names(self) -> list[str]:
        linear = self.torch.nn.Linear
        names = []
        for name, module in self.model.named_modules():
            if isinstance(module, linear) and ".lora_" not in name:  # the base's, also under peft
                names.append(f"{name.removeprefix('base_model.model.').removesuffix('.base_layer')}.weight")
        return names

    def fold_in(self, deltas: Mapping[str, np.ndarray]) -> None:
        """Add deltas to base weights; also after `add_lora` (peft's wrapped names), so one
        run can switch the expert underneath a shared LoRA."""
        with self.torch.no_grad():
            for name, delta in deltas.items():
                weight = self._base_parameter(name)
                weight += self.torch.from_numpy(np.asarray(delta)).to(weight.device, weight.dtype)

    def _base_parameter(self, name: str):
        try:
            return self.model.get_parameter(name)
        except AttributeError:
            module, _, leaf = name.rpartition(".")
            return self.model.get_parameter(f"base_model.model.{module}.base_layer.{leaf}")

    def reset_optimizer(self, lr: float) -> None:
        """A fresh AdamW at `lr` (a retry of the run at another step size)."""
        self.lr = lr
        self.optimizer = self.torch.optim.AdamW(self._trainable(), lr=lr, weight_decay=0.0)

    def add_lora(self, rank: int = 8, alpha: float = 16.0, seed: int = 0) -> None:
        from peft import LoraConfig, get_peft_model

        self.torch.manual_seed(seed)
        targets = personal_targets(self._config().model_type)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")
        self.model = get_peft_model(self.model, config)
        self._lora_params = None
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self.torch.optim.AdamW(trainable, lr=self.lr, weight_decay=0.0)

    def stack_expert(self, source: Path | None) -> None:
        """Put the PEFT expert at `source` under the personal LoRA, frozen (None: no expert).
        Called after `add_lora`; one expert is resident at a time (on Tall each is 3.7B
        parameters), so switching frees the previous one first."""
        source = Path(source) if source is not None else None
        if source == self.expert_source:
            return
        self._lora_params = None
        if EXPERT in self.model.peft_config:
            self._activate(PERSONAL)
            self.model.delete_adapter(EXPERT)
        self.expert_source = None
        if source is not None:
            try:
                self.model.load_adapter(str(source), adapter_name=EXPERT, is_trainable=False)
            except (ValueError, OSError, KeyError, RuntimeError) as exc:
                raise MacaronError(f"the trainer cannot stack the expert at {source}: {exc}") from None
            self.expert_source = source
        self._activate(*self._stack())

    def _stack(self) -> tuple[str, ...]:
        return (EXPERT, PERSONAL) if self.expert_source is not None else (PERSONAL,)

    def _activate(self, *adapters: str) -> None:
        """Make `adapters` the active (summed) set; only the personal LoRA ever trains."""
        self.model.base_model.set_adapter(list(adapters))
        for name, param in self.model.named_parameters():
            param.requires_grad = f".{PERSONAL}." in name and ".lora_" in name

    def asarray(self, values: np.ndarray):
        return self.torch.as_tensor(np.asarray(values), dtype=self.torch.float32, device=self.device)

    def to_numpy(self, values) -> np.ndarray:
        return values.detach().double().cpu().numpy()

    def logprobs(self, batch: Batch):
        """Hidden states for every position, but the output layer (vocab-sized: the largest
        matmul of a small model, and a softmax over 49k entries) only at the scored positions;
        prompt and padding positions never need logits. Unscored positions come back as 0.

        Rows run in sub-batches of similar length (`length_buckets`), each cut to its longest
        row: right padding only ever follows a row's last real token, so the numbers are the
        same, and short rows (passages, short corrections) stop paying for the longest one."""
        torch = self.torch
        inner = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        where_rows, where_cols, values = [], [], []
        for bucket, sub in sub_batches(batch):
            ids = torch.tensor(sub.input_ids, dtype=torch.long, device=self.device)
            real = torch.tensor(real_lengths(sub), device=self.device)
            attention = torch.arange(ids.shape[1], device=self.device)[None, :] < real[:, None]
            hidden = inner.get_decoder()(input_ids=ids, attention_mask=attention.long()).last_hidden_state
            rows, cols = torch.nonzero(torch.tensor(sub.mask, device=self.device) != 0, as_tuple=True)
            targets = torch.tensor(sub.targets, dtype=torch.long, device=self.device)[rows, cols]
            where_rows.append(torch.tensor(bucket, dtype=torch.long, device=self.device)[rows])
            where_cols.append(cols)
            values.append(self._scored(inner, hidden[rows, cols], targets))
        scored = torch.cat(values)
        shape = (batch.size, len(batch.input_ids[0]))
        return scored.new_zeros(shape).index_put((torch.cat(where_rows), torch.cat(where_cols)), scored)

    def _scored(self, inner, hidden, targets):
        """Log-probabilities of `targets` from the hidden states at the scored positions."""
        torch = self.torch
        logits = inner.get_output_embeddings()(hidden)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()  # log_softmax in at least float32
        scale = getattr(inner.config, "final_logit_softcapping", None)
        if scale:  # the few models that soft-cap their logits (gemma 2) do it after the head
            logits = torch.tanh(logits / scale) * scale
        return -torch.nn.functional.cross_entropy(logits, targets, reduction="none")

    def reference_logprobs(self, batch: Batch):
        """LoRA off; with a stacked expert, the expert alone (what the user is served now)."""
        if self.expert_source is None:
            with self.torch.no_grad(), self.model.disable_adapter():
                return self.logprobs(batch)
        self._activate(EXPERT)
        try:
            with self.torch.no_grad():
                return self.logprobs(batch)
        finally:
            self._activate(*self._stack())

    def mask(self, batch: Batch):
        return self.asarray(np.asarray(batch.mask, dtype=np.float32))

    def _loss(self, batch: Batch, objective: Objective, with_reference: bool = True):
        mask = self.mask(batch)
        logp = self.logprobs(batch)
        reference = self.reference_logprobs(batch) if with_reference else logp.detach()
        return objective(logp, reference, mask)

    def _trainable(self) -> list:
        return [p for p in self.model.parameters() if p.requires_grad]

    def train_step(self, batch: Batch, objective: Objective, with_reference: bool = True) -> StepOutcome:
        loss, parts = self._loss(batch, objective, with_reference)
        norm = self.step(loss)
        return StepOutcome(float(loss.detach()), {k: float(v.detach()) for k, v in parts.items()}, norm)

    def gradients(self, batch: Batch, objective: Objective) -> dict[str, np.ndarray]:
        self.model.zero_grad(set_to_none=True)
        loss, _ = self._loss(batch, objective)
        loss.backward()
        grads = {
            self._short(n): p.grad.detach().double().cpu().numpy()
            for n, p in self.model.named_parameters()
            if p.requires_grad and p.grad is not None
        }
        self.model.zero_grad(set_to_none=True)
        return grads

    @staticmethod
    def _short(name: str) -> str:
        """peft's `base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
        `model.layers.0.self_attn.q_proj.lora_A`: the same names on every backend."""
        return name.removeprefix("base_model.model.").replace(".default.weight", "")

    def lora_weights(self) -> dict[str, np.ndarray]:
        named = self.model.named_parameters()
        return {self._short(n): p.detach().double().cpu().numpy() for n, p in named if p.requires_grad}

    def set_lora_weight(self, name: str, values: np.ndarray) -> None:
        """By name through a map built once: the KL reference swaps every LoRA tensor twice a
        step on a continued night, and a scan of all parameters per tensor was quadratic."""
        if self._lora_params is None:
            named = self.model.named_parameters()
            self._lora_params = {self._short(n): p for n, p in named if p.requires_grad}
        param = self._lora_params[name]
        with self.torch.no_grad():
            param.copy_(self.torch.as_tensor(np.asarray(values), dtype=param.dtype))

    def step(self, loss) -> float:
        """Backpropagate an already computed loss and step (a plain training loop's step); a
        step whose loss or gradient is not finite is skipped (`step_is_finite`)."""
        loss.backward()
        norm = float(self.torch.nn.utils.clip_grad_norm_(self._trainable(), 1.0))
        if step_is_finite(float(loss.detach()), norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def save_peft(self, directory: Path) -> Path:
        directory = Path(directory)
        self.model.save_pretrained(str(directory), safe_serialization=True, selected_adapters=[PERSONAL])
        return directory
