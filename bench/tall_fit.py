"""Will Tall fit, and what do its experts cost llama.cpp? Measured on the tiny qwen3_5_moe, scaled
to Tall's published shapes.

- `adapter_rss_ratio`: resident memory llama.cpp adds per adapter file byte when it loads an
  adapter (anonymous RSS, i.e. copied into its own buffers; file-backed RSS reported apart);
- `ram_gb` / `disk_gb`: Tall (base Q4_K_M + four experts) at each storage type, from the shapes
  (macaron_local.fit), with the measured ratio applied to the experts' RAM;
- `expert_switch_ms`: switching to another expert that is resident (set the adapter set, reset
  the KV cache) against loading it on demand (validate, load, switch, free the old one), on the
  tiny model, and the on-demand cost scaled by bytes to one Tall expert;
- `lora_decode_ratio`: decode tokens/s with an expert adapter (every target, rank 32) at each
  type over the base alone, measured side by side in the same run.

    python bench/tall_fit.py --json

Timings are CPU time of this process with llama.cpp on one thread (process_time), so other
processes on a shared machine do not count against a figure; compare ratios all the same.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp
from common import emit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import tiny_qwen35moe as tq  # noqa: E402

from macaron_local import fit  # noqa: E402
from macaron_local.adapters import BaseModelInfo, validate_adapter  # noqa: E402
from macaron_local.adapters.peft import convert_peft_dir  # noqa: E402
from macaron_local.engine import Engine, EngineConfig  # noqa: E402

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_1", "Q4_0")


def rss() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of this process."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["RssAnon"], fields["RssFile"]


def decode_tps(engine: Engine, n_tokens: int) -> float:
    """Single-token decode speed (what generation costs per token), prompt excluded."""
    llm = engine.llm
    engine._clear_kv()
    llm.eval([1, 5, 9, 13])
    started = time.process_time()
    for i in range(n_tokens):
        llm.eval([3 + i % 50])
    return n_tokens / (time.process_time() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=96, help="decode steps per speed sample")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rss-rank", type=int, default=1024, help="rank of the big adapter used to measure RSS")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="tall-fit-") as tmp:
        tmp = Path(tmp)
        tiny = tq.build(tmp, seed=0)
        base = BaseModelInfo.from_gguf(tiny.gguf_path)
        groups = ("attention", "linear_attention", "shared_expert")
        peft_model = tq.add_random_lora(copy.deepcopy(tiny.model), 32, 1, groups=groups, experts=True)
        peft_model.save_pretrained(tmp / "peft")
        adapters = {t: convert_peft_dir(tmp / "peft", base, tmp / f"expert-{t}.gguf", dtype=t) for t in TYPES}
        other = tq.add_random_lora(copy.deepcopy(tiny.model), 32, 2, groups=groups, experts=True)
        other.save_pretrained(tmp / "peft-other")
        other_path = convert_peft_dir(tmp / "peft-other", base, tmp / "other.gguf", dtype=fit.TALL_EXPERT_TYPE)
        big = tq.add_random_lora(copy.deepcopy(tiny.model), args.rss_rank, 3, groups=groups, experts=True)
        big.save_pretrained(tmp / "peft-big")
        big_path = convert_peft_dir(tmp / "peft-big", base, tmp / "big.gguf", dtype=fit.TALL_EXPERT_TYPE)
        del peft_model, other, big

        with Engine(EngineConfig(model_path=tiny.gguf_path, n_ctx=256, n_threads=1)) as engine:
            # RSS per adapter byte: validate first (our reader maps the file), then measure the load alone.
            started = time.process_time()
            validate_adapter(big_path, base)
            validate_ms = (time.process_time() - started) * 1000
            gc.collect()
            anon0, file0 = rss()
            started = time.process_time()
            pointer = llama_cpp.llama_adapter_lora_init(engine.llm.model, str(big_path).encode())
            init_ms = (time.process_time() - started) * 1000
            anon1, file1 = rss()
            size = big_path.stat().st_size
            llama_cpp.llama_adapter_lora_free(pointer)

            # Expert switch: resident (both loaded) vs on demand (load the routed one, free the other).
            current = engine.load_adapter(adapters[fit.TALL_EXPERT_TYPE])
            second = engine.load_adapter(other_path)
            resident, on_demand = [], []
            for _ in range(args.rounds):
                for handle in (second, current):
                    started = time.process_time()
                    engine.set_adapters([handle])
                    engine.logits([1, 2, 3])
                    resident.append((time.process_time() - started) * 1000)
            engine.set_adapters([])
            engine.unload_adapter(second)
            for _ in range(args.rounds):
                started = time.process_time()
                fresh = engine.load_adapter(other_path)
                engine.set_adapters([fresh])
                engine.unload_adapter(current)
                engine.logits([1, 2, 3])
                on_demand.append((time.process_time() - started) * 1000)
                current = engine.load_adapter(adapters[fit.TALL_EXPERT_TYPE])
                engine.set_adapters([current])
                engine.unload_adapter(fresh)
            engine.set_adapters([])
            engine.unload_adapter(current)

            # Decode speed with each type against the base alone, interleaved rounds.
            handles = {t: engine.load_adapter(p) for t, p in adapters.items()}
            speeds: dict[str, list[float]] = {"base": [], **{t: [] for t in TYPES}}
            for _ in range(args.rounds):
                for name in speeds:
                    engine.set_adapters([] if name == "base" else [handles[name]])
                    speeds[name].append(decode_tps(engine, args.tokens))
        base_tps = statistics.median(speeds["base"])

    ratio = (anon1 - anon0) / size
    resident_ms, on_demand_ms = statistics.median(resident), statistics.median(on_demand)
    real_bytes = fit.expert_bytes(fit.TALL_EXPERT_TYPE)
    per_byte_ms = (validate_ms + init_ms) / size  # validate + llama.cpp load, file in the page cache
    validate_ms_per_mb, init_ms_per_mb = validate_ms / size * 1e6, init_ms / size * 1e6
    table = {
        row.dtype: {
            "expert_gb": row.expert_gb,
            "disk_gb": row.disk_gb,
            "ram_gb": round(
                (fit.BASE_Q4_K_M_BYTES + 4 * fit.expert_bytes(row.dtype) * ratio + fit.RUNTIME_OVERHEAD_BYTES) / 1e9, 1
            ),
        }
        for row in fit.fit_table()
    }
    result = {
        "adapter_rss_ratio": round(ratio, 3),
        "adapter_rss_file_ratio": round((file1 - file0) / size, 3),
        "adapter_held": "copied" if ratio > 0.5 else "mmapped",
        "rss_adapter_bytes": size,
        "tall_expert_type": fit.TALL_EXPERT_TYPE,
        "tall": table,
        "expert_switch_ms": {
            "resident": round(resident_ms, 2),
            "on_demand": round(on_demand_ms, 2),
            "validate_ms_per_mb": round(validate_ms_per_mb, 3),
            "llama_load_ms_per_mb": round(init_ms_per_mb, 3),
            "tall_on_demand_estimate": round(on_demand_ms + per_byte_ms * real_bytes),
        },
        "lora_decode_ratio": {t: round(statistics.median(speeds[t]) / base_tps, 3) for t in TYPES},
        "base_decode_tps": round(base_tps, 1),
        "reference": "base alone, same process, interleaved rounds (shared 2-core machine)",
    }
    return emit(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
