"""A bounded GGUF header reader: every count, length and offset checked against the file size.

gguf-py trusts the header. An array whose declared element count is far beyond the file makes
it loop and grow memory without end (it returns empty arrays past the end), a legal multi-MB
array takes it a minute element by element, and tensor data regions that overlap, leave gaps,
come out of order or wrap around 2^64 pass. llama.cpp's own loader (ggml/src/gguf.cpp) refuses
most of these, and aborts the process on some (a key of the wrong type hits a GGML_ASSERT).

So every GGUF we open is read here first, in pure Python over a read-only memory map, with the
same rules as llama.cpp's loader: magic and version; no count or length beyond the bytes left;
keys non-empty, unique, UTF-8; no nested arrays; tensor names under 64 bytes, unique; at most
four dimensions whose product fits in int64 and whose first is a whole number of blocks; a
known storage type; `general.alignment` a UINT32 power of two; tensor data in order, each
region exactly where the previous one (padded to the alignment) ends, and inside the file.
Only then does gguf-py see the file. The work is linear in the header's real size and never
allocates more than the file holds, so a 1 MB file is answered in milliseconds whatever it claims.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf

from macaron_local.errors import AdapterError, MacaronError
from macaron_local.untrusted import open_regular

MAGIC = b"GGUF"
VERSIONS = (2, 3)
#: llama.cpp's GGML_MAX_NAME (the terminating NUL included) and GGML_MAX_DIMS.
MAX_NAME_BYTES = 63
MAX_DIMS = 4
DEFAULT_ALIGNMENT = 32
INT64_MAX = 2**63 - 1

# GGUF value types (gguf.GGUFValueType) and the byte width of the fixed-size ones.
T = gguf.GGUFValueType
SCALAR_SIZES: dict[int, int] = {
    T.UINT8: 1,
    T.INT8: 1,
    T.UINT16: 2,
    T.INT16: 2,
    T.UINT32: 4,
    T.INT32: 4,
    T.FLOAT32: 4,
    T.BOOL: 1,
    T.UINT64: 8,
    T.INT64: 8,
    T.FLOAT64: 8,
}
SCALAR_FORMATS: dict[int, str] = {
    T.UINT8: "<B",
    T.INT8: "<b",
    T.UINT16: "<H",
    T.INT16: "<h",
    T.UINT32: "<I",
    T.INT32: "<i",
    T.FLOAT32: "<f",
    T.BOOL: "<?",
    T.UINT64: "<Q",
    T.INT64: "<q",
    T.FLOAT64: "<d",
}

#: Keys llama.cpp reads with a type-asserting getter (a wrong type aborts it, or it refuses the
#: file): the type each must have. ARRAY entries give the element type.
KEY_TYPES: dict[str, tuple[int, int | None]] = {
    "general.alignment": (T.UINT32, None),
    "general.type": (T.STRING, None),
    "general.architecture": (T.STRING, None),
    "general.name": (T.STRING, None),
    "adapter.type": (T.STRING, None),
    "adapter.lora.alpha": (T.FLOAT32, None),
    "adapter.alora.invocation_tokens": (T.ARRAY, T.UINT32),
}


@dataclass(frozen=True)
class Limits:
    """Ceilings beyond what the file size already bounds (None: only the file size)."""

    #: Metadata array elements summed over every array (gguf-py reads them one by one).
    max_array_elements: int | None = None
    max_tensors: int | None = None
    max_kv: int | None = None


#: An adapter holds a few scalar keys and at most a few thousand tensors (Tall: under 1,000);
#: gguf-py spends ~40 us on each array element and ~150 us on each tensor, so these keep any
#: adapter header under a second.
ADAPTER_LIMITS = Limits(max_array_elements=4_096, max_tensors=4_096, max_kv=1_024)
#: A base model's tokenizer arrays run to a few hundred thousand entries; the file bounds the rest.
MODEL_LIMITS = Limits()


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF (ggml) order: dims[0] is the row length
    type: int
    offset: int  # from the start of the data section
    n_bytes: int


@dataclass(frozen=True)
class Header:
    """What the header says, once every claim in it has been checked against the file."""

    version: int
    file_size: int
    alignment: int
    data_start: int
    #: key -> (value type, value): scalars and strings decoded, arrays as (element type, count,
    #: first element or None).
    kv: dict[str, tuple[int, object]] = field(default_factory=dict)
    tensors: tuple[TensorInfo, ...] = ()

    def value(self, key: str) -> object | None:
        """A scalar or string value (an array's first number), or None when absent."""
        kind, value = self.kv.get(key, (None, None))
        if kind == T.ARRAY:
            return value[2]  # type: ignore[index]
        return value


class _Bounded:
    """A cursor over the mapped file that refuses to read past its end."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path, error: type[MacaronError]) -> None:
        self.buf, self.pos, self.size, self.path, self.error = buf, 0, len(buf), path, error

    def fail(self, what: str) -> MacaronError:
        return self.error(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes but only {self.size - self.pos} remain (corrupt or truncated)")

    def scalar(self, kind: int, what: str) -> object:
        width = SCALAR_SIZES[kind]
        self.need(width, what)
        (value,) = struct.unpack_from(SCALAR_FORMATS[kind], self.buf, self.pos)
        self.pos += width
        return value

    def u32(self, what: str) -> int:
        return int(self.scalar(T.UINT32, what))  # type: ignore[call-overload]

    def u64(self, what: str) -> int:
        return int(self.scalar(T.UINT64, what))  # type: ignore[call-overload]

    def raw_string(self, what: str) -> bytes:
        length = self.u64(f"the length of {what}")
        if length > self.size - self.pos:
            raise self.fail(
                f"{what} claims {length} bytes but only {self.size - self.pos} remain (corrupt or truncated)"
            )
        data = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        return data

    def text(self, what: str) -> str:
        data = self.raw_string(what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not valid UTF-8") from None

    def skip_strings(self, count: int, what: str) -> None:
        """Walk `count` strings without keeping them (each is at least its 8-byte length)."""
        if count > (self.size - self.pos) // 8:
            raise self.fail(f"{what} claims {count} strings, more than the {self.size - self.pos} bytes left can hold")
        for _ in range(count):
            length = self.u64(what)
            if length > self.size - self.pos:
                raise self.fail(f"a string of {what} claims {length} bytes; only {self.size - self.pos} remain")
            self.pos += length


def read_header(
    path: str | os.PathLike[str], error: type[MacaronError] = AdapterError, limits: Limits = ADAPTER_LIMITS
) -> Header:
    """Check and return the header of the GGUF at `path`; `error` (one line) on any bad claim."""
    path = Path(path)
    fd = open_regular(path, "", error)  # never blocks on a FIFO, never opens a directory
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise error(f"{path}: empty file")
        if size < 24:
            raise error(f"{path}: not a GGUF file (bad magic or too short)")
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Bounded(buf, path, error), limits)
    finally:
        os.close(fd)


def _parse(r: _Bounded, limits: Limits) -> Header:
    if bytes(r.buf[:4]) != MAGIC:
        raise r.fail("not a GGUF file (bad magic or too short)")
    r.pos = 4
    version = r.u32("the version")
    if version not in VERSIONS:
        raise r.fail(f"unsupported GGUF version {version}")
    n_tensors = r.u64("the tensor count")
    n_kv = r.u64("the metadata count")
    # Every tensor info and key-value pair takes at least this many bytes: a count the file
    # cannot hold is refused before any loop runs.
    if n_kv > (r.size - r.pos) // (8 + 4 + 1):
        raise r.fail(f"the header claims {n_kv} metadata keys, more than the file can hold")
    if n_tensors > (r.size - r.pos) // (8 + 4 + 4 + 8):
        raise r.fail(f"the header claims {n_tensors} tensors, more than the file can hold")
    if limits.max_kv is not None and n_kv > limits.max_kv:
        raise r.fail(f"the header has {n_kv} metadata keys; at most {limits.max_kv} are allowed")
    if limits.max_tensors is not None and n_tensors > limits.max_tensors:
        raise r.fail(f"the header has {n_tensors} tensors; at most {limits.max_tensors} are allowed")

    kv: dict[str, tuple[int, object]] = {}
    elements = 0
    for index in range(n_kv):
        key = r.text(f"metadata key {index}")
        if not key:
            raise r.fail(f"metadata key {index} is empty")
        if key in kv:
            raise r.fail(f"metadata key {key!r} appears twice")
        kind = r.u32(f"the type of {key!r}")
        if kind == T.ARRAY:
            item = r.u32(f"the element type of {key!r}")
            count = r.u64(f"the element count of {key!r}")
            elements += count
            if limits.max_array_elements is not None and elements > limits.max_array_elements:
                raise r.fail(f"metadata array {key!r} takes the header past {limits.max_array_elements} array elements")
            first = None
            if item == T.STRING:
                r.skip_strings(count, f"metadata array {key!r}")
            elif item in SCALAR_SIZES:
                r.need(count * SCALAR_SIZES[item], f"metadata array {key!r} of {count} elements")
                if count:
                    (first,) = struct.unpack_from(SCALAR_FORMATS[item], r.buf, r.pos)
                r.pos += count * SCALAR_SIZES[item]
            else:
                raise r.fail(f"metadata array {key!r} has invalid element type {item}")
            kv[key] = (T.ARRAY, (item, count, first))
        elif kind == T.STRING:
            data = r.raw_string(f"the value of {key!r}")
            kv[key] = (kind, data.decode("utf-8", "replace"))
        elif kind in SCALAR_SIZES:
            kv[key] = (kind, r.scalar(kind, f"the value of {key!r}"))
        else:
            raise r.fail(f"metadata key {key!r} has invalid type {kind}")
        _check_key_type(r, key, kind, kv[key][1])

    alignment = int(kv.get("general.alignment", (T.UINT32, DEFAULT_ALIGNMENT))[1])  # type: ignore[call-overload]
    if alignment == 0 or alignment & (alignment - 1):
        raise r.fail(f"general.alignment {alignment} is not a power of two")

    infos = []
    names: set[str] = set()
    for index in range(n_tensors):
        name = r.text(f"the name of tensor {index}")
        if len(name.encode()) > MAX_NAME_BYTES:
            raise r.fail(f"tensor {index}'s name is {len(name.encode())} bytes; llama.cpp allows {MAX_NAME_BYTES}")
        if name in names:
            raise r.fail(f"tensor name {name!r} appears twice")
        names.add(name)
        n_dims = r.u32(f"the dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise r.fail(f"tensor {name!r} claims {n_dims} dimensions; at most {MAX_DIMS}")
        dims = tuple(r.u64(f"a dimension of tensor {name!r}") for _ in range(n_dims))
        n_elements = 1
        for dim in dims:
            if dim > INT64_MAX:
                raise r.fail(f"tensor {name!r} has a negative or huge dimension")
            n_elements *= dim
            if n_elements > INT64_MAX:
                raise r.fail(f"tensor {name!r} claims more elements than int64 can count")
        kind = r.u32(f"the type of tensor {name!r}")
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise r.fail(f"tensor {name!r} has unknown storage type {kind}") from None
        row = dims[0] if dims else 1
        if row % block:
            raise r.fail(f"tensor {name!r} rows of {row} are not whole blocks of {block} for its type")
        offset = r.u64(f"the data offset of tensor {name!r}")
        infos.append(TensorInfo(name, dims, kind, offset, n_elements // block * type_size))

    data_start = r.pos + (-r.pos % alignment) if infos else r.pos
    expected = 0
    for info in infos:
        if info.offset != expected:
            how = (
                "overlaps the previous one"
                if info.offset < expected
                else "leaves a gap or is out of order"
                if info.offset < 2**63
                else "wraps around"
            )
            raise r.fail(f"tensor {info.name!r} data starts at {info.offset}, expected {expected}: it {how}")
        if data_start + info.offset + info.n_bytes > r.size:
            raise r.fail(f"tensor {info.name} runs past the end of the file (truncated)")
        expected = info.offset + info.n_bytes + (-info.n_bytes % alignment)
    return Header(version, r.size, alignment, data_start, kv, tuple(infos))


def _check_key_type(r: _Bounded, key: str, kind: int, value: object) -> None:
    wanted = KEY_TYPES.get(key)
    if wanted is None:
        return
    want_kind, want_item = wanted
    got_item = value[0] if kind == T.ARRAY and isinstance(value, tuple) else None
    if kind != want_kind or (want_item is not None and got_item != want_item):
        name = T(want_kind).name + (f" of {T(want_item).name}" if want_item is not None else "")
        got = T(kind).name + (f" of {T(got_item).name}" if got_item is not None else "")
        raise r.fail(f"{key} must be {name}, found {got} (llama.cpp refuses or aborts on it)")
