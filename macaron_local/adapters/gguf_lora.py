"""Read and write GGUF LoRA adapters in the exact layout llama.cpp's `llama_adapter_lora_init` loads.

Conventions (checked against llama.cpp, see the shared llama-cpp-lora note):
- metadata `general.type = "adapter"`, `adapter.type = "lora"`, `general.architecture` = base's,
  `adapter.lora.alpha` as FLOAT32 (a float64 alpha aborts llama.cpp);
- tensors `<base tensor>.lora_a` with numpy shape `(rank, in)` and `<base tensor>.lora_b` with
  `(out, rank)`, the same as PEFT's `lora_A.weight` / `lora_B.weight`;
- the update is `W x + scale * (alpha / rank) * B (A x)`, applied at run time per matmul.

Writes are atomic: an adapter file is either whole or absent.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from macaron_local.errors import AdapterError
from macaron_local.store.errors import StoreError

LORA_A = ".lora_a"
LORA_B = ".lora_b"

#: Storage types llama.cpp loads for LoRA tensors, by the name users pass on the command line.
STORAGE_TYPES: dict[str, gguf.GGMLQuantizationType] = {
    "F32": gguf.GGMLQuantizationType.F32,
    "F16": gguf.GGMLQuantizationType.F16,
    "BF16": gguf.GGMLQuantizationType.BF16,
    "Q8_0": gguf.GGMLQuantizationType.Q8_0,
    "Q5_1": gguf.GGMLQuantizationType.Q5_1,
    "Q5_0": gguf.GGMLQuantizationType.Q5_0,
    "Q4_1": gguf.GGMLQuantizationType.Q4_1,
    "Q4_0": gguf.GGMLQuantizationType.Q4_0,
}
#: Types whose blocks carry an F16 scale: a block whose largest value exceeds this cannot be stored.
HALF_SCALED = {name for name in STORAGE_TYPES if name not in ("F32", "BF16")}
F16_MAX = 65504.0


@dataclass
class LoraPair:
    """One adapted matrix: `a` is `(rank, in)`, `b` is `(out, rank)` (numpy order)."""

    a: np.ndarray
    b: np.ndarray

    @property
    def rank(self) -> int:
        return int(self.a.shape[-2])

    def delta(self, alpha: float) -> np.ndarray:
        """The weight update this pair adds at scale 1: `(alpha / rank) * B @ A`."""
        return (alpha / self.rank) * (self.b.astype(np.float64) @ self.a.astype(np.float64))


@dataclass
class LoraAdapter:
    """A LoRA adapter in memory: float32 pairs keyed by the base tensor they adapt."""

    architecture: str
    alpha: float
    pairs: dict[str, LoraPair] = field(default_factory=dict)
    task_name: str | None = None

    @property
    def ranks(self) -> set[int]:
        return {pair.rank for pair in self.pairs.values()}


def update_factors(adapter: LoraAdapter, tensor: str) -> tuple[np.ndarray, np.ndarray]:
    """(left, right) in float64 whose product is the update llama.cpp adds to `tensor`, in the
    base tensor's numpy orientation, with llama.cpp's scale (alpha / rank; 1 when alpha is 0).
    `token_embd` is kept as A (vocab, r) and B (embd, r), so its update is A @ B^T."""
    pair = adapter.pairs[tensor]
    a, b = pair.a.astype(np.float64), pair.b.astype(np.float64)
    if tensor == "token_embd.weight":
        left, right, rank = a, b.T, a.shape[-1]
    else:
        left, right, rank = b, a, pair.rank
    return left * (adapter.alpha / rank if adapter.alpha else 1.0), right


def _encode(values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Convert float values to the bytes of `qtype`; F32/F16 stay typed arrays."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    return gguf.quants.quantize(values, qtype)


def _storage_for(shape: tuple[int, ...], wanted: gguf.GGMLQuantizationType) -> gguf.GGMLQuantizationType:
    """Block types need rows in whole blocks (32 values); a tensor whose rows are shorter or
    ragged falls back to F16."""
    block, _ = gguf.GGML_QUANT_SIZES[wanted]
    if shape[-1] % block:
        return gguf.GGMLQuantizationType.F16
    return wanted


def _nbytes(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size


@dataclass(frozen=True)
class PlannedPair:
    """One pair to write, whose values are produced only when the writer gets to it: a
    converter streams a 14 GiB adapter through this one pair at a time."""

    name: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    make: Callable[[], tuple[np.ndarray, np.ndarray]]


#: progress(bytes written so far, total bytes, tensor just written)
Progress = Callable[[int, int, str], None]


def write_adapter(path: str | os.PathLike[str], adapter: LoraAdapter, dtype: str = "F32") -> Path:
    """Write `adapter` as a GGUF LoRA file at `path`, atomically (temp file + rename).

    `dtype` is one of STORAGE_TYPES. For the block types (Q8_0, Q5_x, Q4_x), tensors whose row
    length is not a multiple of 32 (e.g. `lora_b` when the rank is not) are stored as F16.
    """
    planned = [
        PlannedPair(name, tuple(pair.a.shape), tuple(pair.b.shape), lambda pair=pair: (pair.a, pair.b))
        for name, pair in sorted(adapter.pairs.items())
    ]
    return write_planned(path, adapter.architecture, adapter.alpha, planned, dtype=dtype, task_name=adapter.task_name)


def write_planned(
    path: str | os.PathLike[str],
    architecture: str,
    alpha: float,
    pairs: Sequence[PlannedPair],
    dtype: str = "F32",
    task_name: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write planned pairs as a GGUF LoRA file, holding one pair in memory at a time.

    The header (every tensor's name, shape and type) is written first from the plan; then each
    pair is produced, checked (finite, and storable in its type), encoded and appended. The file
    appears at `path` only when complete (temp file + fsync + rename).
    """
    if dtype not in STORAGE_TYPES:
        raise AdapterError(f"unknown adapter storage type {dtype!r}; use one of {', '.join(STORAGE_TYPES)}")
    if not pairs:
        raise AdapterError("an adapter needs at least one lora_a/lora_b pair")
    path = Path(path)
    wanted = STORAGE_TYPES[dtype]
    layout = []
    for pair in pairs:
        for suffix, shape in ((LORA_A, pair.a_shape), (LORA_B, pair.b_shape)):
            qtype = _storage_for(shape, wanted)
            layout.append((pair.name + suffix, shape, qtype, _nbytes(shape, qtype)))
    total = sum(item[3] for item in layout)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), architecture)
    try:
        writer.add_string("general.type", "adapter")
        writer.add_string("adapter.type", "lora")
        writer.add_float32("adapter.lora.alpha", float(alpha))
        if task_name:
            writer.add_string("adapter.lora.task_name", task_name)
        for name, shape, qtype, nbytes in layout:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        done, items = 0, iter(layout)
        for pair in pairs:
            a, b = pair.make()
            for values in (a, b):
                name, shape, qtype, nbytes = next(items)
                if tuple(values.shape) != shape:
                    raise AdapterError(f"{name}: produced shape {values.shape}, planned {shape}")
                writer.write_tensor_data(_checked_encode(name, values, qtype))
                done += nbytes
            del a, b
            if progress is not None:
                progress(done, total, pair.name)
        for handle in writer.fout or ():  # surface a full disk now, not after the rename
            handle.flush()
            os.fsync(handle.fileno())
        writer.close()
        _check_complete(tmp, len(layout))
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # closing flushes, which fails again on a full disk
            writer.close()
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise StoreError(
                f"no space left to write {path.name} in {path.parent} ({exc.strerror}); free some space and try again"
            ) from None
        raise
    return path


def _checked_encode(name: str, values: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Encode one tensor, refusing values llama.cpp would serve as garbage (NaN, inf, or too
    large for an F16 scale)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if not np.isfinite(values).all():
        raise AdapterError(f"{name} holds NaN or infinite values")
    if qtype.name in HALF_SCALED and values.size and float(np.abs(values).max()) > F16_MAX:
        raise AdapterError(f"{name} holds values beyond {qtype.name}'s range (|x| > {F16_MAX:g}); use F32 or BF16")
    return _encode(values, qtype)


def _check_complete(path: Path, n_tensors: int) -> None:
    """numpy's `tofile` can stop short without raising (a file-size limit, some full disks):
    read the file back and make sure every tensor's data is there before it gets its name."""
    try:
        reader = gguf.GGUFReader(str(path))
        size = path.stat().st_size
        complete = len(reader.tensors) == n_tensors and all(t.data_offset + t.n_bytes <= size for t in reader.tensors)
    except (ValueError, OSError, IndexError):
        complete = False
    if not complete:
        raise OSError(errno.ENOSPC, "the file was cut short", str(path))


def read_tensor_values(tensor: gguf.ReaderTensor) -> np.ndarray:
    """Dequantize one tensor from a GGUFReader to float32 in numpy order."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values, dtype=np.float32).reshape(shape)


def field_value(reader: gguf.GGUFReader, key: str) -> object | None:
    """The python value of a scalar or string metadata field, or None when absent."""
    fld = reader.get_field(key)
    if fld is None:
        return None
    return fld.contents()


def read_adapter(path: str | os.PathLike[str]) -> LoraAdapter:
    """Load an adapter file into memory (float32). Validate it first: this trusts the file."""
    reader = gguf.GGUFReader(str(path))
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for tensor in reader.tensors:
        base, _, half = tensor.name.rpartition(".")
        pairs.setdefault(base, {})[half] = read_tensor_values(tensor)
    return LoraAdapter(
        architecture=str(field_value(reader, "general.architecture")),
        alpha=float(field_value(reader, "adapter.lora.alpha") or 0.0),
        pairs={name: LoraPair(h["lora_a"], h["lora_b"]) for name, h in pairs.items()},
        task_name=field_value(reader, "adapter.lora.task_name"),  # type: ignore[arg-type]
    )


def permute_llama_qk_rows(b: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder output rows the way llama.cpp's HF->GGUF conversion reorders q/k weights.

    HF llama checkpoints rotate halves of each head (`rotate_half`); llama.cpp rotates adjacent
    pairs. The converter interleaves each head's two halves, so any LoRA `B` (whose rows are
    the output rows of q_proj/k_proj) written from HF/PEFT weights needs the same reordering.
    """
    out = b.shape[0]
    head_dim = out // n_head
    return b.reshape(n_head, 2, head_dim // 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)


def unpermute_llama_qk_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of `permute_llama_qk_rows`: GGUF row order back to the HF checkpoint's, for
    a trainer that loads a llama GGUF into HF-layout modules."""
    head_dim = rows.shape[0] // n_head
    return rows.reshape(n_head, head_dim // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)
