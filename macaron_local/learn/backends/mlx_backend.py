"""The MLX backend: mlx-lm's model definitions and LoRA layers, on Apple silicon (Metal) or the
CPU build of MLX (Linux, for tests).

mlx-lm loads Hugging Face checkpoints, not GGUF, so the base is rebuilt from the same GGUF the
engine runs: the config from its metadata and the dequantized weights through gguf-py's name
map (`gguf_weights`). The KL reference is the same model with every LoRA's scale set to 0, so
the base exists once in memory. Export writes a PEFT directory (A = lora_a^T, B = lora_b^T,
alpha = scale * rank) and goes through the same PEFT->GGUF converter as the torch backend.

Tall (`qwen3_5_moe`) loads from the manifest's trainer checkpoint through mlx-lm's own
`qwen3_5_moe` (4-bit with `bits=4`), and its expert stays a frozen LoRA stacked under the
personal one (`mlx_stack`; `learn.stacking` says why and which targets the personal LoRA gets).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from macaron_local.errors import MacaronError
from macaron_local.learn.backends.base import (
    Batch,
    Objective,
    StepOutcome,
    first_scored_position,
    step_is_finite,
    sub_batches,
)
from macaron_local.learn.backends.checkpoint import resolve_checkpoint
from macaron_local.learn.backends.gguf_weights import hf_config, load_hf_weights
from macaron_local.learn.backends.mlx_stack import MLX_PREFIX, expert_factors, load_checkpoint, text_model
from macaron_local.learn.stacking import PERSONAL_TARGETS, stacks_experts

PEFT_PREFIX = "base_model.model."


def _require_mlx():
    try:
        import mlx.core as mx
        import mlx_lm  # noqa: F401
    except ImportError:
        raise MacaronError(
            "learning with the mlx backend needs MLX: pip install 'macaron-local[mlx]' (Apple silicon; "
            "on Linux, mlx[cpu])"
        ) from None
    return mx


class MlxBackend:
    name = "mlx"
    lora_transposed = True

    def __init__(
        self, lr: float = 1e-4, dtype: str = "float32", bits: int | str | None = "auto", group_size: int = 64
    ) -> None:
        self.mx = _require_mlx()
        # A quantized base, for checkpoints only: "auto" is 4-bit for Tall-class models (the only
        # way its base fits beside the engine on a 64 GB Mac), full precision for the others.
        self.bits, self.group_size = bits, group_size
        self.expert_source: Path | None = None
        self._expert_layers: list[tuple[object, str, object]] = []  # (parent, attribute, wrapper)
        self.model_type = ""
        self.lr = lr
        self.dtype = getattr(self.mx, dtype)
        self.model = None
        self.optimizer = None
        self.rank = 0
        self.scale = 0.0
        self._lora: dict[str, object] = {}

    def load(self, base_gguf: Path, checkpoint: str | None = None) -> None:
        import mlx.nn as nn
        from mlx.utils import tree_flatten
        from mlx_lm.utils import _get_classes

        if checkpoint:  # the local directory or cache only: learning never downloads
            local = resolve_checkpoint(checkpoint)
            bits = self.bits
            if bits == "auto":
                model_type = json.loads((local / "config.json").read_text()).get("model_type", "")
                bits = 4 if stacks_experts(model_type) else None
            self.model, self.config = load_checkpoint(local, bits, self.group_size)
        else:
            self.config = hf_config(Path(base_gguf))
            model_class, args_class = _get_classes(self.config)
            model = model_class(args_class.from_dict(self.config))
            names = [name for name, _ in tree_flatten(model.parameters())]
            weights = load_hf_weights(Path(base_gguf), names)
            model.load_weights([(k, self.mx.array(v)) for k, v in weights.items()], strict=True)
            self.model = model
        self.model_type = str(self.config.get("model_type", ""))
        self._set_dtype()
        self.model.freeze()
        self.mx.eval(self.model.parameters())
        self._nn = nn

    def _set_dtype(self) -> None:
        """Float parameters to the backend's dtype; quantized weights keep their integers."""
        self.model.set_dtype(self.dtype, predicate=lambda d: self.mx.issubdtype(d, self.mx.floating))

    @property
    def stacks_experts(self) -> bool:
        return stacks_experts(self.model_type)

    def linear_weight_names(self) -> list[str]:
        modules = self.model.named_modules()
        linear = [name for name, module in modules if isinstance(module, self._nn.Linear)]
        return [f"{name.removesuffix('.linear')}.weight" for name in linear]  # also after add_lora

    def fold_in(self, deltas: Mapping[str, np.ndarray]) -> None:
        from mlx.utils import tree_flatten, tree_unflatten

        current = dict(tree_flatten(self.model.parameters()))

        def resolved(name: str) -> str:  # after add_lora, LoRALinear keeps the base at `.linear`
            module, _, leaf = name.rpartition(".")
            return name if name in current else f"{module}.linear.{leaf}"

        updated = []
        for name, delta in deltas.items():
            key = resolved(name)
            updated.append((key, current[key] + self.mx.array(np.asarray(delta)).astype(current[key].dtype)))
        self.model.update(tree_unflatten(updated))
        self.mx.eval(self.model.parameters())

    def add_lora(self, rank: int = 8, alpha: float = 16.0, seed: int = 0) -> None:
        import mlx.optimizers as optim
        from mlx_lm.tuner.lora import LoRALinear
        from mlx_lm.tuner.utils import linear_to_lora_layers

        self.mx.random.seed(seed)
        self.rank, self.scale = rank, alpha / rank
        layers = len(self.model.layers)
        settings = {"rank": rank, "scale": self.scale, "dropout": 0.0}
        if self.stacks_experts:  # Tall's targets, looked up in every layer (attention or linear attention)
            keys = {f"{where}.{t}" for where in ("self_attn", "linear_attn") for t in PERSONAL_TARGETS[:9]}
            settings["keys"] = keys | {f"mlp.{t}" for t in PERSONAL_TARGETS[9:]}
        linear_to_lora_layers(self.model, layers, settings)
        self._lora = {name: m for name, m in self.model.named_modules() if isinstance(m, LoRALinear)}
        self._set_dtype()
        self.optimizer = optim.AdamW(learning_rate=self.lr, weight_decay=0.0)

    def reset_optimizer(self, lr: float) -> None:
        """A fresh AdamW at `lr` (a retry of the run at another step size)."""
        import mlx.optimizers as optim

        self.lr = lr
        self.optimizer = optim.AdamW(learning_rate=lr, weight_decay=0.0)

    def asarray(self, values: np.ndarray):
        return self.mx.array(np.asarray(values, dtype=np.float32)).astype(self.dtype)

    def to_numpy(self, values) -> np.ndarray:
        if values.dtype in (self.mx.float16, self.mx.bfloat16):
            values = values.astype(self.mx.float32)
        return np.array(values, dtype=np.float64)

    def _forward_logprobs(self, model, batch: Batch):
        """Rows in sub-batches of similar length (`length_buckets`), each cut to its longest row
        (right padding only follows a row's last real token, so the numbers are the same), put
        back in the batch's order and width."""
        mx = self.mx
        split = sub_batches(batch)
        if len(split) == 1:
            return self._bucket_logprobs(model, batch)
        width = len(batch.input_ids[0])
        parts, order = [], []
        for bucket, sub in split:
            parts.append(mx.pad(self._bucket_logprobs(model, sub), [(0, 0), (0, width - len(sub.input_ids[0]))]))
            order.extend(bucket)
        return mx.concatenate(parts, axis=0)[mx.array(np.argsort(order))]

    def _bucket_logprobs(self, model, batch: Batch):
        """Hidden states for every position, the output layer only from the first scored one."""
        mx = self.mx
        ids = mx.array(np.asarray(batch.input_ids, dtype=np.int32))
        targets = mx.array(np.asarray(batch.targets, dtype=np.int32))
        start = first_scored_position(batch)
        model = text_model(model)
        hidden = model.model(ids)[:, start:, :]
        if getattr(model.args, "tie_word_embeddings", False):
            logits = model.model.embed_tokens.as_linear(hidden)
        else:
            logits = model.lm_head(hidden)
        if logits.dtype in (mx.float16, mx.bfloat16):
            logits = logits.astype(mx.float32)  # log_softmax in at least float32
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        scored = mx.take_along_axis(logp, mx.expand_dims(targets[:, start:], -1), axis=-1).squeeze(-1)
        return mx.concatenate([mx.zeros((scored.shape[0], start), dtype=scored.dtype), scored], axis=1)

    def logprobs(self, batch: Batch):
        return self._forward_logprobs(self.model, batch)

    def reference_logprobs(self, batch: Batch):
        for layer in self._lora.values():
            layer.scale = 0.0
        try:
            return self.mx.stop_gradient(self._forward_logprobs(self.model, batch))
        finally:
            for layer in self._lora.values():
                layer.scale = self.scale

    def mask(self, batch: Batch):
        return self.asarray(np.asarray(batch.mask, dtype=np.float32))

    def _value_and_grad(self, batch: Batch, objective: Objective, with_reference: bool = True):
        mask = self.mask(batch)
        reference = self.reference_logprobs(batch) if with_reference else None
        parts_out: dict = {}

        def loss_fn(model):
            logp = self._forward_logprobs(model, batch)
            loss, parts = objective(logp, reference if reference is not None else self.mx.stop_gradient(logp), mask)
            parts_out.update(parts)
            return loss

        loss, grads = self._nn.value_and_grad(self.model, loss_fn)(self.model)
        return loss, grads, parts_out

    def train_step(self, batch: Batch, objective: Objective, with_reference: bool = True) -> StepOutcome:
        import mlx.optimizers as optim

        loss, grads, parts = self._value_and_grad(batch, objective, with_reference)
        grads, norm = optim.clip_grad_norm(grads, 1.0)
        self.mx.eval(loss, norm)
        if step_is_finite(float(loss), float(norm)):
            self.optimizer.update(self.model, grads)
        self.mx.eval(self.model.parameters(), self.optimizer.state, loss, *parts.values())
        return StepOutcome(float(loss), {k: float(v) for k, v in parts.items()}, float(norm))

    def gradients(self, batch: Batch, objective: Objective) -> dict[str, np.ndarray]:
        from mlx.utils import tree_flatten

        _, grads, _ = self._value_and_grad(batch, objective)
        return {self._short(n): self.to_numpy(g) for n, g in tree_flatten(grads)}

    @staticmethod
    def _short(name: str) -> str:
        """`model.layers.0.self_attn.q_proj.lora_a` -> `...q_proj.lora_A`: the torch backend's names.
        (The arrays are transposed relative to torch's: mlx-lm keeps (in, r) and (r, out).)"""
        return name.replace(".lora_a", ".lora_A").replace(".lora_b", ".lora_B")

    def lora_weights(self) -> dict[str, np.ndarray]:
        from mlx.utils import tree_flatten

        return {self._short(n): self.to_numpy(v) for n, v in tree_flatten(self.model.trainable_parameters())}

    def set_lora_weight(self, name: str, values: np.ndarray) -> None:
        module, _, half = name.rpartition(".")
        layer = self._lora[module]
        attribute = {"lora_A": "lora_a", "lora_B": "lora_b"}[half]
        setattr(layer, attribute, self.asarray(values))

    def save_peft(self, directory: Path) -> Path:
        from safetensors.numpy import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, layer in self._lora.items():
            module = name.replace(MLX_PREFIX, "model.") if name.startswith(MLX_PREFIX) else name
            a = np.array(layer.lora_a.astype(self.mx.float32)).T  # (r, in)
            b = np.array(layer.lora_b.astype(self.mx.float32)).T  # (out, r)
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a)
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b)
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        config = {
            "peft_type": "LORA",
            "r": self.rank,
            "lora_alpha": self.scale * self.rank,
            "target_modules": sorted({m.rsplit(".", 1)[-1] for m in self._lora}),
            "lora_dropout": 0.0,
            "bias": "none",
        }
        (directory / "adapter_config.json").write_text(json.dumps(config, indent=2))
        return directory

    def stack_expert(self, source: Path | None) -> None:
        """Put the PEFT expert at `source` under the personal LoRA, frozen (None: no expert).
        Called after `add_lora`; one expert at a time (switching unwraps the previous one)."""
        from mlx_lm.tuner.lora import LoRALinear, LoRASwitchLinear

        source = Path(source) if source is not None else None
        if source == self.expert_source:
            return
        for parent, attribute, wrapper in reversed(self._expert_layers):
            setattr(parent, attribute, wrapper.linear)
        self._expert_layers, self.expert_source = [], None
        if source is None:
            return
        modules = dict(self.model.named_modules())
        args = text_model(self.model).args
        for path, (a, b, scale) in expert_factors(source, int(args.num_experts), int(args.hidden_size)).items():
            parent_path, _, attribute = path.rpartition(".")
            parent = modules.get(parent_path)
            layer = getattr(parent, attribute, None) if parent is not None else None
            if layer is None:
                raise MacaronError(f"the trainer has no layer {path} for the expert at {source}")
            if isinstance(layer, LoRALinear) and path in self._lora:  # the personal LoRA wraps it
                parent, attribute, layer = layer, "linear", layer.linear
            wrap = LoRASwitchLinear if a.ndim == 3 else LoRALinear
            wrapper = wrap.from_base(layer, r=a.shape[-2] if a.ndim == 3 else a.shape[-1], scale=scale)
            wrapper.lora_a, wrapper.lora_b = self.asarray(a), self.asarray(b)
            wrapper.freeze()
            setattr(parent, attribute, wrapper)
            self._expert_layers.append((parent, attribute, wrapper))
        self.expert_source = source
        self.mx.eval(self.model.parameters())
