"""A corpus of malformed adapter files for one tiny base model.

Each case is a file that must never reach llama.cpp: some would abort the process (float64
alpha), some would be served silently as garbage (NaN weights), most are simply broken. Files
are built with gguf-py directly, bypassing our writer's own checks.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from tinymodels import TinyModel

from macaron_local.adapters import write_adapter
from macaron_local.adapters.gguf_lora import LoraAdapter, LoraPair

Tensors = dict[str, np.ndarray]


def valid_pairs(model: TinyModel, rank: int = 4, seed: int = 0) -> Tensors:
    rng = np.random.default_rng(seed)
    tensors: Tensors = {}
    for name in ("blk.0.attn_q.weight", "blk.0.ffn_down.weight", "blk.1.attn_v.weight"):
        out, inp = model.weights[name].shape
        tensors[f"{name}.lora_a"] = rng.normal(0, 0.1, (rank, inp)).astype(np.float32)
        tensors[f"{name}.lora_b"] = rng.normal(0, 0.1, (out, rank)).astype(np.float32)
    return tensors


def raw_adapter(
    path: Path,
    tensors: Tensors,
    *,
    arch: str = "llama",
    general_type: str | None = "adapter",
    adapter_type: str | None = "lora",
    alpha: object = 8.0,
    alpha_kind: str = "f32",
    raw_types: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    if general_type is not None:
        writer.add_string("general.type", general_type)
    if adapter_type is not None:
        writer.add_string("adapter.type", adapter_type)
    if alpha_kind == "f32":
        writer.add_float32("adapter.lora.alpha", float(alpha))  # type: ignore[arg-type]
    elif alpha_kind == "f64":
        writer.add_float64("adapter.lora.alpha", float(alpha))  # type: ignore[arg-type]
    elif alpha_kind == "str":
        writer.add_string("adapter.lora.alpha", str(alpha))
    elif alpha_kind == "u32":
        writer.add_uint32("adapter.lora.alpha", int(alpha))  # type: ignore[call-overload]
    for name, values in tensors.items():
        qtype = (raw_types or {}).get(name)
        if qtype is not None:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def build_corpus(model: TinyModel, directory: Path, seed: int = 7) -> dict[str, Path]:
    """Write every malformed case into `directory`; returns {case name: path}."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    cases: dict[str, Path] = {}
    good = valid_pairs(model)

    def case(name: str, make: Callable[[Path], object]) -> None:
        path = directory / f"{name}.gguf"
        make(path)
        cases[name] = path

    valid = directory / "_valid.gguf"
    write_adapter(
        valid,
        LoraAdapter(
            "llama",
            8.0,
            {k[: -len(".lora_a")]: LoraPair(v, good[k[:-1] + "b"]) for k, v in good.items() if k.endswith("_a")},
        ),
    )
    blob = valid.read_bytes()

    for i, cut in enumerate(sorted(rng.sample(range(1, len(blob)), 16))):
        case(f"truncated_{i:02d}_at_{cut}", lambda p, cut=cut: p.write_bytes(blob[:cut]))
    for i in range(4):
        case(f"random_bytes_{i}", lambda p, i=i: p.write_bytes(rng.randbytes(64 + 500 * i)))
    case("magic_then_random", lambda p: p.write_bytes(b"GGUF" + rng.randbytes(400)))
    case("magic_then_garbage_counts", lambda p: p.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64))
    case("gguf_version_1", lambda p: p.write_bytes(b"GGUF\x01\x00\x00\x00" + blob[8:]))
    case("bad_magic", lambda p: p.write_bytes(b"GGML" + blob[4:]))
    case("zero_length", lambda p: p.write_bytes(b""))
    case(
        "flipped_bytes_in_header",
        lambda p: p.write_bytes(blob[:40] + bytes(b ^ 0xFF for b in blob[40:120]) + blob[120:]),
    )

    case("wrong_architecture_qwen3", lambda p: raw_adapter(p, good, arch="qwen3"))
    case("wrong_architecture_gpt2", lambda p: raw_adapter(p, good, arch="gpt2"))
    case("not_an_adapter_base_model", lambda p: p.write_bytes(model.path.read_bytes()))
    case("general_type_missing", lambda p: raw_adapter(p, good, general_type=None))
    case("general_type_model", lambda p: raw_adapter(p, good, general_type="model"))
    case("adapter_type_control_vector", lambda p: raw_adapter(p, good, adapter_type="control_vector"))
    case("adapter_type_missing", lambda p: raw_adapter(p, good, adapter_type=None))

    def without(suffix_name: str) -> Tensors:
        return {k: v for k, v in good.items() if k != suffix_name}

    case("missing_lora_b_half", lambda p: raw_adapter(p, without("blk.0.attn_q.weight.lora_b")))
    case("missing_lora_a_half", lambda p: raw_adapter(p, without("blk.1.attn_v.weight.lora_a")))

    def changed(name: str, values: np.ndarray) -> Tensors:
        return {**good, name: values}

    qa, qb = good["blk.0.attn_q.weight.lora_a"], good["blk.0.attn_q.weight.lora_b"]
    da = good["blk.0.ffn_down.weight.lora_a"]
    case(
        "lora_a_wrong_in_dim",
        lambda p: raw_adapter(p, changed("blk.0.attn_q.weight.lora_a", np.zeros((4, qa.shape[1] + 1), np.float32))),
    )
    case(
        "lora_b_wrong_out_dim",
        lambda p: raw_adapter(p, changed("blk.0.attn_q.weight.lora_b", np.zeros((qb.shape[0] + 2, 4), np.float32))),
    )
    case(
        "lora_a_transposed",
        lambda p: raw_adapter(p, changed("blk.0.ffn_down.weight.lora_a", np.ascontiguousarray(da.T))),
    )
    case(
        "lora_b_transposed",
        lambda p: raw_adapter(p, changed("blk.0.attn_q.weight.lora_b", np.ascontiguousarray(qb.T))),
    )
    case(
        "rank_mismatch",
        lambda p: raw_adapter(p, changed("blk.0.attn_q.weight.lora_b", np.zeros((qb.shape[0], 8), np.float32))),
    )
    case(
        "lora_a_three_dims",
        lambda p: raw_adapter(p, changed("blk.0.attn_q.weight.lora_a", np.zeros((2, 4, qa.shape[1]), np.float32))),
    )
    case(
        "lora_a_one_dim",
        lambda p: raw_adapter(p, changed("blk.0.attn_q.weight.lora_a", np.zeros((qa.shape[1],), np.float32))),
    )
    case(
        "rank_zero",
        lambda p: raw_adapter(
            p,
            {
                "blk.0.attn_q.weight.lora_a": np.zeros((0, qa.shape[1]), np.float32),
                "blk.0.attn_q.weight.lora_b": np.zeros((qb.shape[0], 0), np.float32),
            },
        ),
    )

    case(
        "unknown_layer",
        lambda p: raw_adapter(p, {**good, "blk.9.attn_q.weight.lora_a": qa, "blk.9.attn_q.weight.lora_b": qb}),
    )
    case(
        "unknown_tensor_name",
        lambda p: raw_adapter(p, {**good, "foo.weight.lora_a": qa, "foo.weight.lora_b": qb}),
    )
    case("tensor_not_a_lora_half", lambda p: raw_adapter(p, {**good, "blk.0.attn_q.weight": qb}))
    case(
        "lora_on_norm_missing_from_base",
        lambda p: raw_adapter(
            p, {**good, "blk.0.attn_q_norm.weight.lora_a": qa, "blk.0.attn_q_norm.weight.lora_b": qb}
        ),
    )

    def poisoned(name: str, value: float, dtype: str = "F32") -> Callable[[Path], object]:
        values = good[name].copy()
        values.flat[3] = value
        types = {name: gguf.GGMLQuantizationType.F16} if dtype == "F16" else None

        def make(path: Path) -> None:
            with np.errstate(over="ignore"):  # the F16 overflow to inf is the point of that case
                raw_adapter(path, {**good, name: values}, raw_types=types)

        return make

    case("nan_in_lora_a", poisoned("blk.0.attn_q.weight.lora_a", np.nan))
    case("inf_in_lora_b", poisoned("blk.1.attn_v.weight.lora_b", np.inf))
    case("neg_inf_in_lora_b", poisoned("blk.0.ffn_down.weight.lora_b", -np.inf))
    case("nan_in_f16_lora_a", poisoned("blk.0.ffn_down.weight.lora_a", np.nan, "F16"))
    case("f16_overflow_to_inf", poisoned("blk.0.attn_q.weight.lora_b", 1e6, "F16"))

    case("alpha_float64", lambda p: raw_adapter(p, good, alpha_kind="f64"))
    case("alpha_missing", lambda p: raw_adapter(p, good, alpha_kind="none"))
    case("alpha_string", lambda p: raw_adapter(p, good, alpha_kind="str"))
    case("alpha_uint32", lambda p: raw_adapter(p, good, alpha=8, alpha_kind="u32"))
    case("alpha_nan", lambda p: raw_adapter(p, good, alpha=float("nan")))
    case("alpha_negative", lambda p: raw_adapter(p, good, alpha=-4.0))
    case("alpha_zero", lambda p: raw_adapter(p, good, alpha=0.0))

    case("no_tensors", lambda p: raw_adapter(p, {}))
    case(
        "tensor_type_i8",
        lambda p: raw_adapter(p, changed("blk.0.attn_q.weight.lora_a", qa.astype(np.int8))),
    )
    case(
        "tensor_type_f64",
        lambda p: raw_adapter(p, changed("blk.0.attn_q.weight.lora_a", qa.astype(np.float64))),
    )
    case(
        "tensor_type_i32",
        lambda p: raw_adapter(p, changed("blk.0.attn_q.weight.lora_a", qa.astype(np.int32))),
    )
    case("directory_not_file", lambda p: p.mkdir())
    valid.unlink()
    return cases
