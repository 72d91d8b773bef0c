"""The PyTorch backend: transformers loads the same GGUF the engine runs (dequantized), peft adds
LoRA to every linear layer, AdamW trains it. CUDA when present, else CPU.

The KL reference is the same model with the adapter disabled, so the base exists once in
memory. Export goes through PEFT's own `save_pretrained`, then our PEFT->GGUF converter: the
same path Macaron's published experts take, tested end to end against a numpy reference.
"""

from __future__ import annotations

import os
from pathlib import Path

from macaron_local.errors import MacaronError
from macaron_local.learn.backends.base import Batch


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

    def __init__(self, lr: float = 1e-4, device: str | None = None, threads: int | None = None) -> None:
        torch = _require_torch()
        self.torch = torch
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        if threads or self.device == "cpu":
            torch.set_num_threads(threads or max(1, os.cpu_count() or 1))
        self.lr = lr
        self.model = None
        self.optimizer = None

    def load(self, base_gguf: Path, checkpoint: str | None = None) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        base_gguf = Path(base_gguf)
        source = (
            {"pretrained_model_name_or_path": checkpoint}
            if checkpoint
            else {
                "pretrained_model_name_or_path": str(base_gguf.parent),
                "gguf_file": base_gguf.name,
            }
        )
        try:
            model = AutoModelForCausalLM.from_pretrained(**source, dtype=self.torch.float32)
        except (ValueError, OSError, KeyError) as exc:
            raise MacaronError(
                f"transformers cannot load {checkpoint or base_gguf} for training ({exc}); "
                "name a checkpoint of the same base in the model's manifest"
            ) from None
        self.model = model.to(self.device)
        self.model.config.use_cache = False

    def add_lora(self, rank: int = 8, alpha: float = 16.0, seed: int = 0) -> None:
        from peft import LoraConfig, get_peft_model

        self.torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules="all-linear", lora_dropout=0.0, bias="none")
        self.model = get_peft_model(self.model, config)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self.torch.optim.AdamW(trainable, lr=self.lr, weight_decay=0.0)

    def _tensors(self, batch: Batch):
        torch = self.torch
        ids = torch.tensor(batch.input_ids, dtype=torch.long, device=self.device)
        targets = torch.tensor(batch.targets, dtype=torch.long, device=self.device)
        mask = torch.tensor(batch.mask, dtype=torch.float32, device=self.device)
        return ids, targets, mask

    def logprobs(self, batch: Batch):
        ids, targets, _ = self._tensors(batch)
        attention = self.torch.arange(ids.shape[1], device=self.device)[None, :] < self._lengths(batch)[:, None]
        logits = self.model(input_ids=ids, attention_mask=attention.long()).logits
        if logits.dtype in (self.torch.float16, self.torch.bfloat16):
            logits = logits.float()  # log_softmax in at least float32
        return self.torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

    def _lengths(self, batch: Batch):
        """Real (unpadded) lengths: the last scored position + 1, or the prompt length."""
        lengths = []
        for row_mask in batch.mask:
            scored = [i for i, m in enumerate(row_mask) if m]
            lengths.append(scored[-1] + 1 if scored else len(row_mask))
        return self.torch.tensor(lengths, device=self.device)

    def reference_logprobs(self, batch: Batch):
        with self.torch.no_grad(), self.model.disable_adapter():
            return self.logprobs(batch)

    def mask(self, batch: Batch):
        return self._tensors(batch)[2]

    def step(self, loss) -> float:
        loss.backward()
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = float(self.torch.nn.utils.clip_grad_norm_(params, 1.0))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def save_peft(self, directory: Path) -> Path:
        directory = Path(directory)
        self.model.save_pretrained(str(directory), safe_serialization=True)
        return directory
