"""Peak memory of converting a Tall-sized PEFT expert to GGUF: the converter must stream.

A published Tall expert is 7-14 GiB of PEFT safetensors (rank 64 on the 256 routed experts of 40
layers, in PEFT's packed layout). This writes a synthetic adapter with exactly those per-layer
shapes (random values, BF16 or F32 like the published files) for --layers layers, converts it in
a fresh process, and reports that process's peak RSS against the 2 GiB limit and against the
input size (a converter that loaded everything would need more than the input).

    python bench/tall_convert.py --json [--layers 8] [--type Q8_0] [--dtype F32]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import emit

from macaron_local.fit import TALL_EXPERT_TYPE, TallShapes

LIMIT_GIB = 2.0


def base_tensors(shapes: TallShapes, n_layer: int) -> dict[str, tuple[int, ...]]:
    """Numpy shapes of the Tall base tensors an expert adapts, for `n_layer` layers."""
    s, out = shapes, {}
    key_dim, value_dim = s.linear_k_heads * s.linear_head_dim, s.linear_v_heads * s.linear_head_dim
    for i in range(n_layer):
        b = f"blk.{i}."
        if (i + 1) % 4 == 0:
            out[b + "attn_q.weight"] = (s.n_head * s.head_dim * 2, s.hidden)
            out[b + "attn_k.weight"] = (s.n_head_kv * s.head_dim, s.hidden)
            out[b + "attn_v.weight"] = (s.n_head_kv * s.head_dim, s.hidden)
            out[b + "attn_output.weight"] = (s.hidden, s.n_head * s.head_dim)
        else:
            out[b + "attn_qkv.weight"] = (2 * key_dim + value_dim, s.hidden)
            out[b + "attn_gate.weight"] = (value_dim, s.hidden)
            out[b + "ssm_beta.weight"] = (s.linear_v_heads, s.hidden)
            out[b + "ssm_alpha.weight"] = (s.linear_v_heads, s.hidden)
            out[b + "ssm_out.weight"] = (s.hidden, value_dim)
        out[b + "ffn_gate_exps.weight"] = (s.n_expert, s.expert_ff, s.hidden)
        out[b + "ffn_up_exps.weight"] = (s.n_expert, s.expert_ff, s.hidden)
        out[b + "ffn_down_exps.weight"] = (s.n_expert, s.hidden, s.expert_ff)
        out[b + "ffn_gate_shexp.weight"] = (s.shared_ff, s.hidden)
        out[b + "ffn_up_shexp.weight"] = (s.shared_ff, s.hidden)
        out[b + "ffn_down_shexp.weight"] = (s.hidden, s.shared_ff)
        out[b + "ffn_gate_inp_shexp.weight"] = (1, s.hidden)
    return out


def peft_modules(shapes: TallShapes, n_layer: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """PEFT module -> (lora_A shape, lora_B shape), as peft saves a Tall expert."""
    s, r, out = shapes, shapes.rank, {}
    key_dim, value_dim = s.linear_k_heads * s.linear_head_dim, s.linear_v_heads * s.linear_head_dim
    for i in range(n_layer):
        p = f"base_model.model.model.layers.{i}."
        if (i + 1) % 4 == 0:
            for name, rows in (("q_proj", s.n_head * s.head_dim * 2), ("k_proj", 512), ("v_proj", 512)):
                out[p + "self_attn." + name] = ((r, s.hidden), (rows, r))
            out[p + "self_attn.o_proj"] = ((r, s.n_head * s.head_dim), (s.hidden, r))
        else:
            for name, rows in (
                ("in_proj_qkv", 2 * key_dim + value_dim),
                ("in_proj_z", value_dim),
                ("in_proj_b", s.linear_v_heads),
                ("in_proj_a", s.linear_v_heads),
            ):
                out[p + "linear_attn." + name] = ((r, s.hidden), (rows, r))
        out[p + "mlp.experts.base_layer"] = ((r * s.n_expert, s.hidden), (2 * s.expert_ff, r * s.n_expert))
        out[p + "mlp.experts"] = ((r * s.n_expert, s.expert_ff), (s.hidden, r * s.n_expert))
        for name, a, b in (
            ("gate_proj", (r, s.hidden), (s.shared_ff, r)),
            ("up_proj", (r, s.hidden), (s.shared_ff, r)),
            ("down_proj", (r, s.shared_ff), (s.hidden, r)),
        ):
            out[p + "mlp.shared_expert." + name] = (a, b)
        out[p + "mlp.shared_expert_gate"] = ((r, s.hidden), (1, r))
    return out


def write_safetensors(path: Path, tensors: dict[str, tuple[int, ...]], dtype: str, seed: int = 0) -> int:
    """Write random tensors one at a time (a safetensors header, then raw little-endian data)."""
    width = {"F32": 4, "BF16": 2}[dtype]
    header, offset = {}, 0
    for name, shape in tensors.items():
        n = int(np.prod(shape)) * width
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    rng = np.random.default_rng(seed)
    with path.open("wb") as handle:
        handle.write(len(head).to_bytes(8, "little") + head)
        for shape in tensors.values():
            values = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
            if dtype == "BF16":
                values = (values.view(np.uint32) >> 16).astype("<u2")
            values.tofile(handle)
    return path.stat().st_size


def child(peft_dir: str, out: str, layers: int, dtype: str) -> None:
    """Runs in a fresh process: convert and print peak RSS (the parent reads it)."""
    from macaron_local.adapters import BaseModelInfo
    from macaron_local.adapters.peft import convert_peft_dir

    shapes = TallShapes()
    base = BaseModelInfo(
        path=Path("tall-shapes"),
        architecture="qwen35moe",
        tensors=base_tensors(shapes, layers),
        n_head=shapes.n_head,
        n_head_kv=shapes.n_head_kv,
        n_layer=layers,
        hparams={
            "ssm.group_count": shapes.linear_k_heads,
            "ssm.time_step_rank": shapes.linear_v_heads,
            "ssm.state_size": shapes.linear_head_dim,
            "expert_count": shapes.n_expert,
        },
    )
    started = time.perf_counter()
    convert_peft_dir(peft_dir, base, out, dtype=dtype)
    seconds = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_rss_bytes": peak_kib * 1024, "seconds": seconds}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--layers", type=int, default=8, help="Tall has 40; 8 already outweighs the 2 GiB limit")
    parser.add_argument("--type", default=TALL_EXPERT_TYPE, help="GGUF storage type to convert to")
    parser.add_argument("--dtype", default="F32", choices=["F32", "BF16"], help="the PEFT file's dtype")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.layers, args.type)
        return 0
    with tempfile.TemporaryDirectory(prefix="tall-convert-") as tmp:
        peft_dir = Path(tmp) / "peft"
        peft_dir.mkdir()
        tensors = {}
        for module, (a, b) in peft_modules(TallShapes(), args.layers).items():
            tensors[module + ".lora_A.weight"], tensors[module + ".lora_B.weight"] = a, b
        size = write_safetensors(peft_dir / "adapter_model.safetensors", tensors, args.dtype)
        (peft_dir / "adapter_config.json").write_text(
            json.dumps({"peft_type": "LORA", "r": 64, "lora_alpha": 128, "target_parameters": ["mlp.experts"]})
        )
        out = Path(tmp) / "expert.gguf"
        done = subprocess.run(
            [
                sys.executable,
                __file__,
                "--layers",
                str(args.layers),
                "--type",
                args.type,
                "--child",
                str(peft_dir),
                str(out),
            ],
            capture_output=True,
            text=True,
            env={**os.environ},
        )
        if done.returncode != 0:
            print(done.stderr.strip().splitlines()[-1] if done.stderr else "conversion failed", file=sys.stderr)
            return 1
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        peak = measured["peak_rss_bytes"] / 1024**3
        result = {
            "layers": args.layers,
            "type": args.type,
            "input_dtype": args.dtype,
            "input_gib": round(size / 1024**3, 2),
            "output_gib": round(out.stat().st_size / 1024**3, 2),
            "peak_rss_gib": round(peak, 2),
            "limit_gib": LIMIT_GIB,
            "within_limit": peak < LIMIT_GIB,
            "peak_over_input": round(peak / (size / 1024**3), 2),
            "seconds": round(measured["seconds"], 1),
        }
    return emit(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
