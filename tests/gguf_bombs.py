"""GGUF header bombs: files under 1 MB whose headers claim far more than they hold.

Each is written byte by byte (no gguf-py writer, whose own checks would refuse them), so the
header can lie in every way the format allows: element counts, string lengths, tensor and key
counts, dimension counts and sizes, data offsets that overlap, leave gaps, run out of order or
wrap around 2^64, and alignments that are zero, odd or of the wrong type.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from pathlib import Path

U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
F32_TYPE = 0  # ggml type F32
ONE_MB = 1 << 20


def gstr(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def kv_str(key: str, value: str | bytes) -> bytes:
    return gstr(key) + struct.pack("<I", STR) + gstr(value)


def kv_f32(key: str, value: float) -> bytes:
    return gstr(key) + struct.pack("<If", F32, value)


def kv_u32(key: str, value: int) -> bytes:
    return gstr(key) + struct.pack("<II", U32, value)


def tensor_info(name: str, dims: Sequence[int], offset: int, kind: int = F32_TYPE, n_dims: int | None = None) -> bytes:
    n = len(dims) if n_dims is None else n_dims
    return (
        gstr(name)
        + struct.pack("<I", n)
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", kind, offset)
    )


def adapter_kvs(arch: str = "llama") -> list[bytes]:
    return [
        kv_str("general.architecture", arch),
        kv_str("general.type", "adapter"),
        kv_str("adapter.type", "lora"),
        kv_f32("adapter.lora.alpha", 8.0),
    ]


def gguf_bytes(
    kvs: Sequence[bytes],
    tensors: Sequence[bytes] = (),
    *,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    data: bytes = b"",
    pad_to: int = 0,
    alignment: int = 32,
) -> bytes:
    head = b"GGUF" + struct.pack(
        "<IQQ", 3, len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv
    )
    body = head + b"".join(kvs) + b"".join(tensors)
    if tensors:
        body += b"\0" * (-len(body) % alignment)
    body += data
    return body + b"\0" * max(0, pad_to - len(body))


def _two_tensors(offsets: tuple[int, int], dims: tuple[int, int] = (16, 4)) -> bytes:
    infos = [
        tensor_info("blk.0.attn_q.weight.lora_a", dims, offsets[0]),
        tensor_info("blk.0.attn_q.weight.lora_b", (dims[1], 64), offsets[1]),
    ]
    return gguf_bytes(adapter_kvs(), infos, data=b"\0" * 4096)


def bombs() -> dict[str, bytes]:
    """{name: file bytes}, every file under 1 MB, every one malformed or beyond an adapter's limits."""
    kvs = adapter_kvs()
    out: dict[str, bytes] = {}

    def array(key: str, item: int, count: int, payload: bytes = b"") -> bytes:
        return gstr(key) + struct.pack("<IIQ", ARR, item, count) + payload

    out["array_count_2e40_u8"] = gguf_bytes([*kvs, array("x.bomb", U8, 1 << 40)], pad_to=ONE_MB - 64)
    out["array_count_2e64_u64"] = gguf_bytes([*kvs, array("x.bomb", U64, (1 << 64) - 1)], pad_to=4096)
    out["array_count_strings"] = gguf_bytes([*kvs, array("x.bomb", STR, 1 << 50)], pad_to=ONE_MB - 64)
    out["array_strings_long_each"] = gguf_bytes(
        [*kvs, array("x.bomb", STR, 4, struct.pack("<Q", 1 << 62))], pad_to=4096
    )
    out["array_nested"] = gguf_bytes([*kvs, array("x.bomb", ARR, 3)], pad_to=4096)
    out["array_bad_element_type"] = gguf_bytes([*kvs, array("x.bomb", 99, 3)], pad_to=4096)
    out["array_legal_900k_u8"] = gguf_bytes([*kvs, array("x.big", U8, 900_000, b"\1" * 900_000)])
    strings = b"".join(gstr(f"t{i}") for i in range(60_000))
    out["array_legal_60k_strings"] = gguf_bytes([*kvs, array("x.tokens", STR, 60_000, strings)])
    out["string_length_2e63"] = gguf_bytes([*kvs, gstr("x.s") + struct.pack("<IQ", STR, 1 << 63)], pad_to=4096)
    out["key_length_2e64"] = gguf_bytes([struct.pack("<Q", (1 << 64) - 1), *kvs], pad_to=4096)
    out["key_empty"] = gguf_bytes([kv_str("", "x"), *kvs], pad_to=4096)
    out["key_duplicate"] = gguf_bytes([*kvs, kv_str("general.type", "adapter")], pad_to=4096)
    out["key_not_utf8"] = gguf_bytes([*kvs, kv_str("x", "y").replace(b"x", b"\xff", 1)], pad_to=4096)
    out["value_type_invalid"] = gguf_bytes([*kvs, gstr("x.v") + struct.pack("<I", 77)], pad_to=4096)
    out["n_kv_2e63"] = gguf_bytes(kvs, n_kv=1 << 63, pad_to=ONE_MB - 64)
    out["n_kv_5000_small"] = gguf_bytes([*kvs, *(kv_u32(f"x.k{i}", i) for i in range(5000))], pad_to=4096)
    out["n_tensors_2e60"] = gguf_bytes(kvs, n_tensors=1 << 60, pad_to=ONE_MB - 64)
    out["n_tensors_40k_declared"] = gguf_bytes(kvs, n_tensors=40_000, pad_to=ONE_MB - 64)
    many = [tensor_info(f"blk.0.x{i}.lora_a", (1,), 0) for i in range(15_000)]
    out["tensors_15k_same_offset"] = gguf_bytes(kvs, many, data=b"\0" * 32)
    tiny = [tensor_info(f"blk.{i}.attn_q.weight.lora_a", (8,), 32 * i) for i in range(8_000)]
    out["tensors_8k_legal_layout"] = gguf_bytes(kvs, tiny, data=b"\0" * 32 * 8_000)
    out["n_dims_2e31"] = gguf_bytes(kvs, [tensor_info("a.lora_a", (4, 4), 0, n_dims=1 << 31)], pad_to=4096)
    out["n_dims_5"] = gguf_bytes(kvs, [tensor_info("a.lora_a", (1, 1, 1, 1, 1), 0)], pad_to=4096)
    out["dims_product_overflow"] = gguf_bytes(kvs, [tensor_info("a.lora_a", (1 << 40, 1 << 40), 0)], pad_to=4096)
    out["dim_negative_int64"] = gguf_bytes(kvs, [tensor_info("a.lora_a", ((1 << 64) - 4, 4), 0)], pad_to=4096)
    out["dims_huge_claims_1e15_bytes"] = gguf_bytes(kvs, [tensor_info("a.lora_a", (1 << 25, 1 << 25), 0)], pad_to=4096)
    out["tensor_type_unknown"] = gguf_bytes(kvs, [tensor_info("a.lora_a", (4, 4), 0, kind=99)], pad_to=4096)
    out["tensor_rows_not_blocks"] = gguf_bytes(kvs, [tensor_info("a.lora_a", (33, 4), 0, kind=8)], pad_to=4096)
    out["tensor_name_64_bytes"] = gguf_bytes(kvs, [tensor_info("n" * 64, (4,), 0)], pad_to=4096)
    out["tensor_name_length_2e63"] = gguf_bytes(kvs, [struct.pack("<Q", 1 << 63)], pad_to=4096)
    out["tensor_name_duplicate"] = gguf_bytes(
        kvs, [tensor_info("a.lora_a", (8,), 0), tensor_info("a.lora_a", (8,), 32)], data=b"\0" * 64
    )
    out["offset_wraps_2e64"] = _two_tensors((0, (1 << 64) - 256))
    out["offset_wraps_first"] = _two_tensors(((1 << 64) - 32, 256))
    out["regions_overlap"] = _two_tensors((0, 128))
    out["regions_gap"] = _two_tensors((0, 1024))
    out["regions_out_of_order"] = _two_tensors((1024, 0))
    out["offset_unaligned"] = _two_tensors((0, 257))
    out["offset_past_end"] = gguf_bytes(kvs, [tensor_info("a.lora_a", (1 << 16, 64), 0)], data=b"\0" * 1024)
    out["alignment_zero"] = gguf_bytes([*kvs, kv_u32("general.alignment", 0)], pad_to=4096)
    out["alignment_not_power_of_two"] = gguf_bytes([*kvs, kv_u32("general.alignment", 48)], pad_to=4096)
    out["alignment_wrong_type"] = gguf_bytes([*kvs, kv_str("general.alignment", "32")], pad_to=4096)
    out["alignment_2e31_past_end"] = gguf_bytes(
        [*kvs, kv_u32("general.alignment", 1 << 31)], [tensor_info("a.lora_a", (8,), 0)], pad_to=4096, alignment=1
    )
    out["alpha_wrong_type"] = gguf_bytes([*kvs[:3], kv_str("adapter.lora.alpha", "8")], pad_to=4096)
    out["architecture_wrong_type"] = gguf_bytes([kv_u32("general.architecture", 1), *kvs[1:]], pad_to=4096)
    out["alora_tokens_wrong_type"] = gguf_bytes([*kvs, array("adapter.alora.invocation_tokens", F32, 1, b"\0" * 4)])
    out["version_1"] = b"GGUF" + struct.pack("<IQQ", 1, 0, 0) + b"\0" * 64
    out["version_huge"] = b"GGUF" + struct.pack("<IQQ", 0xFFFFFFFF, 0, 0) + b"\0" * 64
    out["header_only_24_bytes"] = b"GGUF" + struct.pack("<IQQ", 3, 1, 1)
    for name, data in out.items():
        assert len(data) < ONE_MB, name
    return out


def write_bombs(directory: Path, select: Callable[[str], bool] = lambda _: True) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, data in bombs().items():
        if select(name):
            path = directory / f"{name}.gguf"
            path.write_bytes(data)
            paths[name] = path
    return paths
