"""The validator's finite-value check reads block scales instead of dequantizing (a Tall expert
is 5 GB at Q8_0); it must agree with dequantizing everything, for every storage type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from macaron_local.adapters.gguf_lora import STORAGE_TYPES, read_tensor_values
from macaron_local.adapters.validate import all_finite


@pytest.mark.parametrize("dtype", list(STORAGE_TYPES))
@pytest.mark.parametrize("poison", [None, np.nan, np.inf, -np.inf])
def test_finite_check_agrees_with_dequantizing(tmp_path, dtype, poison):
    qtype = STORAGE_TYPES[dtype]
    values = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    data = gguf.quants.quantize(values, qtype)
    if poison is not None:
        data = data.copy()
        if dtype in ("F32", "F16"):
            data[3, 17] = poison
        else:  # BF16 stores raw bits; block types: poison the second block's first scale
            offset = 2 if dtype == "BF16" else gguf.GGML_QUANT_SIZES[qtype][1]
            bits = np.float16(poison) if dtype != "BF16" else np.float32(poison)
            raw = np.frombuffer(bits.tobytes(), np.uint8)[-2:]
            data[3, offset : offset + 2] = raw
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("t", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    with np.errstate(invalid="ignore"):
        expected = bool(np.isfinite(read_tensor_values(tensor)).all())
    assert all_finite(tensor) == expected
    assert expected == (poison is None)
