"""Validate an adapter file against a base model before llama.cpp ever opens it.

llama.cpp trusts adapter files: a float64 alpha aborts the process in a GGML_ASSERT, NaN weights
are served silently as garbage, and llama-cpp-python's high-level constructor lets a failed load
through so the first completion segfaults. So every adapter passes through `validate_adapter`
first, which parses the file with pure Python (gguf-py + numpy) and raises `AdapterError` with
one line that says what is wrong.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import gguf
import numpy as np

from macaron_local.adapters.gguf_header import ADAPTER_LIMITS, MODEL_LIMITS, read_header
from macaron_local.adapters.gguf_lora import LORA_A, LORA_B, STORAGE_TYPES, field_value, read_tensor_values
from macaron_local.errors import AdapterError, MacaronError, ModelError

GGUF_MAGIC = b"GGUF"
#: Smallest possible GGUF: magic, version, tensor count, kv count.
GGUF_MIN_BYTES = 4 + 4 + 8 + 8
ALLOWED_TYPES = frozenset(STORAGE_TYPES.values())
#: The embedding table is the one tensor whose LoRA halves are laid out differently.
TOKEN_EMBD = "token_embd.weight"


@dataclass(frozen=True)
class BaseModelInfo:
    """What an adapter must agree with: the base model's architecture and tensor shapes."""

    path: Path
    architecture: str
    tensors: dict[str, tuple[int, ...]]  # numpy order, e.g. (out, in)
    n_head: int = 0
    n_head_kv: int = 0
    n_layer: int = 0
    name: str = ""
    kind: str = "model"  # general.type: a base model must not be an adapter
    #: Integer hyper-parameters an architecture's converter needs (`<arch>.` prefix dropped),
    #: e.g. "ssm.group_count" or "expert_count" for qwen35moe.
    hparams: dict[str, int] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str]) -> BaseModelInfo:
        """Read a base model's header (memory-mapped, no weights loaded). Cached per file."""
        path = Path(path).resolve()
        try:
            stat = path.stat()
        except OSError as exc:
            raise ModelError(f"base model {path} cannot be read: {exc.strerror}") from None
        return _base_info_cached(path, stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=8)
def _base_info_cached(path: Path, size: int, mtime_ns: int) -> BaseModelInfo:
    # The bounded header reader has everything a base's description needs, in a fraction of a
    # second; gguf-py reads every tokenizer entry one by one (~12 s for the embedded model here).
    header = read_header(path, ModelError, MODEL_LIMITS)
    arch = header.value("general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"base model {path} has no general.architecture")
    tensors = {t.name: tuple(int(d) for d in reversed(t.dims)) for t in header.tensors}

    def meta_int(key: str) -> int:
        value = header.value(f"{arch}.{key}")  # per-layer arrays (some archs): the first
        return int(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0

    hparams = {}
    for key, (kind, value) in header.kv.items():
        scalar = kind != gguf.GGUFValueType.ARRAY and isinstance(value, int) and not isinstance(value, bool)
        if key.startswith(f"{arch}.") and scalar:
            hparams[key.removeprefix(f"{arch}.")] = value
    return BaseModelInfo(
        path=path,
        architecture=arch,
        tensors=tensors,
        n_head=meta_int("attention.head_count"),
        n_head_kv=meta_int("attention.head_count_kv") or meta_int("attention.head_count"),
        n_layer=meta_int("block_count"),
        name=str(header.value("general.name") or path.stem),
        kind=str(header.value("general.type") or "model"),
        hparams=hparams,
    )


@dataclass(frozen=True)
class AdapterReport:
    """What a valid adapter holds: shown by `macaron adapters validate` and recorded on load."""

    path: Path
    architecture: str
    alpha: float
    ranks: tuple[int, ...]
    n_pairs: int
    storage_types: tuple[str, ...]
    task_name: str | None = None

    def summary(self) -> str:
        ranks = "/".join(str(r) for r in self.ranks)
        types = "/".join(self.storage_types)
        return f"LoRA for {self.architecture}: {self.n_pairs} pairs, rank {ranks}, alpha {self.alpha:g}, {types}"


def _why(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:160]


def _check_header(path: Path, error: type[MacaronError] = AdapterError) -> None:
    """Every count, length and offset of the header checked against the file before gguf-py
    reads it (adapters/gguf_header.py): regular file, magic, version, bounded arrays, tensor
    regions in order and inside the file."""
    read_header(path, error, ADAPTER_LIMITS if error is AdapterError else MODEL_LIMITS)


def _open(path: Path) -> gguf.GGUFReader:
    _check_header(path)
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # truncated or corrupt files raise many different exceptions
        raise AdapterError(f"{path}: not a valid GGUF file, truncated or corrupt ({_why(exc)})") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise AdapterError(f"{path}: tensor {tensor.name} runs past the end of the file (truncated)")
    return reader


def _check_metadata(path: Path, reader: gguf.GGUFReader, base: BaseModelInfo) -> float:
    kind = field_value(reader, "general.type")
    if kind != "adapter":
        raise AdapterError(f"{path}: not an adapter (general.type is {kind!r}, expected 'adapter')")
    adapter_type = field_value(reader, "adapter.type")
    if adapter_type != "lora":
        raise AdapterError(f"{path}: adapter.type is {adapter_type!r}, expected 'lora'")
    arch = field_value(reader, "general.architecture")
    if arch != base.architecture:
        raise AdapterError(f"{path}: adapter is for architecture {arch!r} but the base model is {base.architecture!r}")
    alpha_field = reader.get_field("adapter.lora.alpha")
    if alpha_field is None:
        raise AdapterError(f"{path}: adapter.lora.alpha is missing")
    alpha_types = alpha_field.types
    if alpha_types != [gguf.GGUFValueType.FLOAT32]:
        got = "/".join(t.name for t in alpha_types) or "unknown"
        raise AdapterError(f"{path}: adapter.lora.alpha must be FLOAT32, found {got} (llama.cpp aborts on it)")
    alpha = float(alpha_field.contents())
    if not np.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"{path}: adapter.lora.alpha must be a positive finite number, found {alpha}")
    return alpha


def _check_pair_shapes(
    path: Path, name: str, base_shape: tuple[int, ...], a: tuple[int, ...], b: tuple[int, ...]
) -> int:
    """Check one pair's shapes against its base tensor; returns the rank.

    Numpy order: `lora_a` is (..., rank, in) and `lora_b` is (..., out, rank), where `...` are
    the leading dims of a stacked (MoE) base tensor, e.g. (n_expert,) for `ffn_gate_exps`. A 1-D
    base `(in,)` (qwen35moe's shared-expert gate) is a matrix with one output row. The embedding
    table is the exception: `lora_a` is (n_vocab, rank) and `lora_b` is (n_embd, rank).
    """
    if len(base_shape) == 1:
        base_shape = (1, *base_shape)
    if name == TOKEN_EMBD:
        n_vocab, n_embd = base_shape
        rank = a[-1] if len(a) == 2 else 0
        want_a, want_b = (n_vocab, "rank"), (n_embd, "rank")
        ok_a = len(a) == 2 and a[0] == n_vocab
        ok_b = b == (n_embd, rank)
    else:
        *lead, out, inp = base_shape
        rank = a[-2] if len(a) == len(base_shape) else 0
        want_a, want_b = (*lead, "rank", inp), (*lead, out, "rank")
        ok_a = len(a) == len(base_shape) and a[-1] == inp and tuple(a[:-2]) == tuple(lead)
        ok_b = b == (*lead, out, rank)
    show = lambda dims: "(" + ", ".join(str(d) for d in dims) + ")"  # noqa: E731
    if not ok_a:
        raise AdapterError(f"{path}: {name}.lora_a has shape {show(a)}, expected {show(want_a)}")
    if rank < 1:
        raise AdapterError(f"{path}: {name} has rank {rank}; a LoRA pair needs rank >= 1")
    if not ok_b:
        raise AdapterError(
            f"{path}: {name}.lora_b has shape {show(b)}, expected {show(want_b)} with rank {rank} from lora_a"
        )
    return rank


#: Bytes per block and how many leading F16 scale values each block of a block type starts with
#: (Q8_0: d; Q4_0/Q5_0: d; Q4_1/Q5_1: d and m). A block's values are its scales times small
#: integers, so they are finite exactly when its scales are.
_BLOCK_SCALES = {
    gguf.GGMLQuantizationType.Q8_0: 1,
    gguf.GGMLQuantizationType.Q4_0: 1,
    gguf.GGMLQuantizationType.Q5_0: 1,
    gguf.GGMLQuantizationType.Q4_1: 2,
    gguf.GGMLQuantizationType.Q5_1: 2,
}


def all_finite(tensor: gguf.ReaderTensor) -> bool:
    """Whether every value of a tensor is finite, without dequantizing it: a Tall expert is
    5 GB at Q8_0, and dequantizing it in numpy to look for a NaN would take minutes."""
    raw = np.asarray(tensor.data)
    qtype = tensor.tensor_type
    if qtype == gguf.GGMLQuantizationType.F32:
        return bool(np.isfinite(raw.view(np.float32)).all())
    if qtype == gguf.GGMLQuantizationType.F16:
        return bool(np.isfinite(raw.view(np.float16)).all())
    if qtype == gguf.GGMLQuantizationType.BF16:
        return not bool(((raw.view(np.uint16) & 0x7F80) == 0x7F80).any())  # exponent all ones: inf or NaN
    if qtype in _BLOCK_SCALES:
        _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = raw.view(np.uint8).reshape(-1, block_bytes)
        scales = np.ascontiguousarray(blocks[:, : 2 * _BLOCK_SCALES[qtype]]).view(np.float16)
        return bool(np.isfinite(scales).all())
    return bool(np.isfinite(read_tensor_values(tensor)).all())


#: The largest |value| each block type's integers reach, per unit of its scale d (values are
#: d * q, or d * q + m for the _1 types).
_BLOCK_QMAX = {
    gguf.GGMLQuantizationType.Q8_0: 128,
    gguf.GGMLQuantizationType.Q4_0: 8,
    gguf.GGMLQuantizationType.Q5_0: 16,
    gguf.GGMLQuantizationType.Q4_1: 15,
    gguf.GGMLQuantizationType.Q5_1: 31,
}


def peak_abs(tensor: gguf.ReaderTensor) -> float:
    """An upper bound on max |value| of a finite tensor, from its block scales for the block types
    (exact for the float types), again without dequantizing."""
    raw = np.asarray(tensor.data)
    qtype = tensor.tensor_type
    if qtype in _BLOCK_SCALES:
        _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = raw.view(np.uint8).reshape(-1, block_bytes)
        scales = np.abs(np.ascontiguousarray(blocks[:, : 2 * _BLOCK_SCALES[qtype]]).view(np.float16).astype(np.float64))
        if scales.size == 0:
            return 0.0
        bound = scales[:, 0] * _BLOCK_QMAX[qtype] + (scales[:, 1] if _BLOCK_SCALES[qtype] == 2 else 0.0)
        return float(bound.max())
    values = raw.view(np.float32) if qtype == gguf.GGMLQuantizationType.F32 else None
    if qtype == gguf.GGMLQuantizationType.F16:
        values = raw.view(np.float16)
    if values is None:
        values = read_tensor_values(tensor)
    return float(np.abs(values).max(initial=0.0))


#: The largest weight update a pair may add: what half precision holds (llama.cpp's GPU backends
#: compute in it), far beyond any trained LoRA (updates there are below ~10).
MAX_UPDATE = 65504.0


def _check_update_range(path: Path, name: str, alpha: float, peak_a: float, peak_b: float) -> None:
    """Finite values can still multiply past float32: every element of (alpha / rank) * B @ A is
    at most alpha * max|A| * max|B| (rank terms, each at most max|A| * max|B|), so bounding that
    keeps the update llama.cpp adds finite without forming the product."""
    bound = alpha * peak_a * peak_b
    if not bound <= MAX_UPDATE:
        raise AdapterError(
            f"{path}: {name}'s update can reach {bound:.3g} (alpha {alpha:g} x max|A| {peak_a:.3g} x max|B| "
            f"{peak_b:.3g}); at most {MAX_UPDATE:g} is allowed"
        )


def validate_adapter(path: str | os.PathLike[str], base: BaseModelInfo, *, check_values: bool = True) -> AdapterReport:
    """Raise AdapterError unless `path` is a LoRA adapter llama.cpp can safely apply to `base`.

    Any exception while parsing untrusted bytes means the file is malformed, so it becomes an
    AdapterError too: callers get one line, never a traceback.
    """
    path = Path(path)
    try:
        with np.errstate(all="ignore"):  # overflow in untrusted values is reported, never warned
            return _validate(path, base, check_values)
    except AdapterError:
        raise
    except Exception as exc:
        raise AdapterError(f"{path}: malformed adapter ({_why(exc)})") from None


def _validate(path: Path, base: BaseModelInfo, check_values: bool) -> AdapterReport:
    reader = _open(path)
    alpha = _check_metadata(path, reader, base)
    if not reader.tensors:
        raise AdapterError(f"{path}: the adapter has no tensors")

    halves: dict[str, dict[str, gguf.ReaderTensor]] = {}
    for tensor in reader.tensors:
        if tensor.name.endswith(LORA_A):
            halves.setdefault(tensor.name[: -len(LORA_A)], {})["a"] = tensor
        elif tensor.name.endswith(LORA_B):
            halves.setdefault(tensor.name[: -len(LORA_B)], {})["b"] = tensor
        else:
            raise AdapterError(f"{path}: tensor {tensor.name!r} is neither a .lora_a nor a .lora_b half")
        if tensor.tensor_type not in ALLOWED_TYPES:
            raise AdapterError(
                f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}; "
                f"allowed: {', '.join(sorted(STORAGE_TYPES))}"
            )

    ranks: set[int] = set()
    for name, pair in sorted(halves.items()):
        if "a" not in pair or "b" not in pair:
            missing = "lora_b" if "a" in pair else "lora_a"
            raise AdapterError(f"{path}: {name} has no {missing} half")
        if name not in base.tensors:
            raise AdapterError(f"{path}: {name} is not a tensor of the base model {base.name}")
        a_shape = tuple(int(d) for d in reversed(pair["a"].shape.tolist()))
        b_shape = tuple(int(d) for d in reversed(pair["b"].shape.tolist()))
        rank = _check_pair_shapes(path, name, base.tensors[name], a_shape, b_shape)
        if check_values:
            peaks = []
            for half in ("a", "b"):
                if not all_finite(pair[half]):
                    raise AdapterError(f"{path}: {pair[half].name} holds NaN or infinite values")
                peaks.append(peak_abs(pair[half]))
            _check_update_range(path, name, alpha, *peaks)
        ranks.add(rank)

    return AdapterReport(
        path=path,
        architecture=base.architecture,
        alpha=alpha,
        ranks=tuple(sorted(ranks)),
        n_pairs=len(halves),
        storage_types=tuple(sorted({t.tensor_type.name for t in reader.tensors})),
        task_name=field_value(reader, "adapter.lora.task_name"),  # type: ignore[arg-type]
    )
