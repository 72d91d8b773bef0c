"""Convert a PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`) to GGUF.

This is how Macaron's published experts and third-party plugins arrive. The converter maps HF
module names to GGUF tensor names with gguf-py's own tensor map (the same table llama.cpp's
converters use), folds PEFT's per-module scaling into `B` so one FLOAT32 alpha serves every pair,
and for architecture `llama` permutes the q/k rows of `B` exactly as the model converter permuted
the base weights. The result is validated against the base before it is written.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import gguf
import numpy as np
from safetensors import safe_open

from macaron_local.adapters.gguf_lora import LoraAdapter, LoraPair, permute_llama_qk_rows, write_adapter
from macaron_local.adapters.peft_config import check_config, check_output, check_storable, check_tensors, read_config
from macaron_local.adapters.validate import BaseModelInfo, validate_adapter
from macaron_local.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: PEFT prefixes saved module names with these; they are not part of the HF module path.
PEFT_PREFIXES = ("base_model.model.",)
#: Architectures whose HF->GGUF conversion permutes q/k rows for rotary embedding.
PERMUTED_QK = {"llama": {"attn_q": "n_head", "attn_k": "n_head_kv"}}


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Read every tensor as float32; BF16 (which numpy lacks) is widened by hand."""
    tensors: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="numpy") as handle:
            for key in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                tensors[key] = handle.get_tensor(key).astype(np.float32)
        return tensors
    except (TypeError, ValueError) as exc:
        if "bf16" not in str(exc).lower() and "bfloat16" not in str(exc).lower():
            raise
    return _load_safetensors_bf16(path)


def _load_safetensors_bf16(path: Path) -> dict[str, np.ndarray]:
    """The safetensors layout is an 8-byte header length, a JSON header, then raw data."""
    raw = path.read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + header_len])
    base = 8 + header_len
    widths = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
    tensors: dict[str, np.ndarray] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        start, end = (base + int(x) for x in info["data_offsets"])
        chunk = raw[start:end]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(chunk, dtype="<u2").astype(np.uint32) << 16
            values = bits.view(np.float32)
        elif info["dtype"] in widths:
            values = np.frombuffer(chunk, dtype=widths[info["dtype"]]).astype(np.float32)
        else:
            raise AdapterError(f"{path}: tensor {key} has unsupported dtype {info['dtype']}")
        tensors[key] = values.reshape(info["shape"])
    return tensors


def _module_scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling for one module: alpha/r, or alpha/sqrt(r) with rsLoRA; patterns override."""
    alpha = float(config.get("lora_alpha", rank))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if module.endswith(pattern):
            alpha = float(value)
    denom = math.sqrt(rank) if config.get("use_rslora") else rank
    return alpha / denom


def tensor_name_map(base: BaseModelInfo) -> gguf.TensorNameMap | None:
    """gguf-py's HF <-> GGUF tensor name map for the base's architecture (None: unknown to gguf-py)."""
    arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == base.architecture), None)
    return None if arch is None else gguf.get_tensor_name_map(arch, max(base.n_layer, 1))


def gguf_name(name_map: gguf.TensorNameMap, hf_parameter: str) -> str | None:
    """`model.layers.0.self_attn.q_proj.weight` -> `blk.0.attn_q.weight` (None: no such tensor)."""
    return name_map.get_name(hf_parameter, try_suffixes=(".weight", ".bias"))


def qk_permuted_heads(base: BaseModelInfo, tensor: str) -> int | None:
    """The head count whose q/k row permutation the HF->GGUF conversion applied to `tensor`
    (None: its rows are in HF order)."""
    role = tensor.split(".")[-2] if tensor.startswith("blk.") else ""
    key = PERMUTED_QK.get(base.architecture, {}).get(role)
    return getattr(base, key) if key else None


@np.errstate(all="ignore")  # overflow in untrusted values is checked and reported, never warned
def convert_peft_dir(
    peft_dir: str | os.PathLike[str],
    base: BaseModelInfo,
    out_path: str | os.PathLike[str],
    dtype: str = "F16",
    task_name: str | None = None,
) -> Path:
    """Convert a PEFT LoRA directory for `base` into a validated GGUF adapter at `out_path`."""
    peft_dir = Path(peft_dir)
    config_path, weights_path = peft_dir / CONFIG_FILE, peft_dir / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterError(f"{peft_dir}: a PEFT adapter needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    check_output(out_path)
    config = read_config(config_path)  # an object of standard JSON, or one line
    check_config(config, peft_dir)
    try:
        tensors = _load_safetensors(weights_path)
    except AdapterError:
        raise
    except Exception as exc:
        raise AdapterError(f"{peft_dir}: unreadable PEFT adapter ({' '.join(str(exc).split())[:160]})") from None
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{peft_dir}: peft_type {config.get('peft_type')!r} is not LORA")

    check_tensors(config, tensors, peft_dir)
    try:
        adapter = _convert(config, tensors, base, peft_dir)
    except (ValueError, IndexError, ZeroDivisionError) as exc:  # a shape the base's layout cannot take
        why = " ".join(str(exc).split())[:160]
        raise AdapterError(f"{peft_dir}: tensor shapes do not fit the base model ({why})") from None
    check_storable(adapter.pairs, dtype, peft_dir)
    adapter.task_name = task_name
    out_path = Path(out_path)
    tmp = out_path.with_name(f".{out_path.name}.unvalidated")
    try:
        write_adapter(tmp, adapter, dtype=dtype)
    except OSError as exc:  # a full disk is a StoreError from the writer; anything else is the path
        raise AdapterError(f"cannot write {out_path}: {exc.strerror or exc}") from None
    try:
        validate_adapter(tmp, base)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def _convert(config: dict, tensors: dict[str, np.ndarray], base: BaseModelInfo, where: Path) -> LoraAdapter:
    name_map = tensor_name_map(base)
    if name_map is None:
        raise AdapterError(f"{where}: architecture {base.architecture!r} is unknown to gguf-py")

    modules: dict[str, dict[str, np.ndarray]] = {}
    for key, values in tensors.items():
        for prefix in PEFT_PREFIXES:
            key = key.removeprefix(prefix)
        for marker, half in (
            (".lora_A.", "A"),
            (".lora_B.", "B"),
            (".lora_embedding_A", "EA"),
            (".lora_embedding_B", "EB"),
        ):
            if marker in key:
                module = key.split(marker)[0]
                modules.setdefault(module, {})[half] = values
                break
        else:
            raise AdapterError(f"{where}: tensor {key} is not a LoRA A/B weight")

    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    pairs: dict[str, LoraPair] = {}
    for module, halves in sorted(modules.items()):
        target = gguf_name(name_map, module + ".weight")
        if target is None or target not in base.tensors:
            raise AdapterError(f"{where}: module {module} has no tensor in the {base.architecture} base model")
        if "EA" in halves or "EB" in halves:
            # Embedding LoRA: A is (r, vocab), B is (embd, r); llama.cpp wants (vocab, r) and (embd, r).
            a, b = halves["EA"].T, halves["EB"]
            rank = a.shape[-1]
        else:
            if "A" not in halves or "B" not in halves:
                raise AdapterError(f"{where}: module {module} lacks lora_A or lora_B")
            a, b = halves["A"], halves["B"]
            rank = a.shape[-2]
        b = b * (_module_scale(config, module, rank) * rank / alpha)
        if (heads := qk_permuted_heads(base, target)) is not None:
            b = permute_llama_qk_rows(b, heads)
        pairs[target] = LoraPair(np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32))
    if not pairs:
        raise AdapterError(f"{where}: the PEFT adapter holds no LoRA weights")
    return LoraAdapter(architecture=base.architecture, alpha=alpha, pairs=pairs)
