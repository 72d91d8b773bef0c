"""Inference benchmark: the engine against raw llama-cpp-python, measured side by side in one run.

Figures (printed as JSON with --json):
- `overhead_ratio`: decode tokens/s of the engine / raw llama-cpp-python on the same model,
  the same adapter and greedy settings (target >= 0.97). Runs alternate engine/raw so that
  machine noise hits both; the ratio is the median of per-pair ratios.
- `switch_ms`: time to the first token of a reply right after an expert switch, for
  `reset` (clear the KV cache, re-prefill the conversation) and `state` (restore a KV state
  saved under that adapter set), next to `unchanged` (no switch: prefix cache reused).
- `ttft_followup_ms`: time to first token of a follow-up turn after ~200 and ~2000 tokens of
  history with the adapter set unchanged; it must not grow with history (only attention over a
  longer KV cache adds a little). `ttft_followup_raw_ms` is raw llama-cpp-python doing the same
  turn on its own cached prefix; `ttft_cold_2000_ms` shows what the prefix cache saves.

Usage: python bench/inference.py [--json] [--model PATH] [--tokens N] [--reps K]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import llama_cpp
from common import embedded_model, emit, random_lora

from macaron_local.adapters import BaseModelInfo, write_adapter
from macaron_local.engine import Engine, EngineConfig, GenerationParams
from macaron_local.engine.llama_engine import default_threads
from macaron_local.engine.llama_load import open_llama

TARGET_OVERHEAD_RATIO = 0.97
DECODE_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
GREEDY = {"temp": 0.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0}


def decode_rate(token_times: list[float]) -> float:
    """Tokens per second after the first token (prefill excluded)."""
    if len(token_times) < 3:
        return float("nan")
    return (len(token_times) - 1) / (token_times[-1] - token_times[0])


def raw_decode(llm: llama_cpp.Llama, prompt: list[int], n_tokens: int) -> float:
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    llm.reset()
    times = []
    for token in llm.generate(prompt, **GREEDY):
        times.append(time.perf_counter())
        if llama_cpp.llama_vocab_is_eog(vocab, token) or len(times) >= n_tokens:
            break
    return decode_rate(times)


def engine_decode(engine: Engine, prompt: list[int], n_tokens: int) -> float:
    engine._clear_kv()
    times = []
    params = GenerationParams(max_tokens=n_tokens, temperature=0.0)
    for _ in engine.stream(prompt, params):
        times.append(time.perf_counter())
    return decode_rate(times)


def ttft(engine: Engine, messages: list[dict[str, str]], max_tokens: int = 8) -> float:
    tokens, _ = engine.prompt_for(messages, max_tokens)
    return engine.generate(tokens, GenerationParams(max_tokens=max_tokens)).ttft_ms


def raw_ttft(llm: llama_cpp.Llama, prompt: list[int]) -> float:
    """Time to first token of raw llama-cpp-python, which also reuses its cached prefix."""
    started = time.perf_counter()
    for _ in llm.generate(prompt, **GREEDY):
        return (time.perf_counter() - started) * 1000
    return float("nan")


def history(engine: Engine, target_tokens: int) -> list[dict[str, str]]:
    """A conversation of about `target_tokens` tokens (fixed text, so runs are comparable)."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    i = 0
    while len(engine.render_tokens(messages)) < target_tokens:
        messages.append({"role": "user", "content": f"Tell me fact number {i} about the ocean."})
        messages.append(
            {
                "role": "assistant",
                "content": f"Fact {i}: the ocean covers most of the planet and holds "
                "most of its water, and its currents move heat from the equator towards the poles.",
            }
        )
        i += 1
    return messages


def bench(model: Path, n_tokens: int, reps: int, n_ctx: int) -> dict:
    threads = default_threads()
    workdir = Path(tempfile.mkdtemp(prefix="macaron-bench-"))
    base = BaseModelInfo.from_gguf(model)
    adapter_a = write_adapter(workdir / "a.gguf", random_lora(base, 8, seed=1))
    adapter_b = write_adapter(workdir / "b.gguf", random_lora(base, 8, seed=2))

    # ---- decode: engine vs raw, same model, adapter and greedy settings, alternating
    raw = open_llama(model, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    pointer = llama_cpp.llama_adapter_lora_init(raw.model, str(adapter_a).encode())
    assert pointer, "raw llama.cpp refused the benchmark adapter"
    llama_cpp.llama_set_adapters_lora(
        raw.ctx, (llama_cpp.llama_adapter_lora_p_ctypes * 1)(pointer), 1, (ctypes.c_float * 1)(1.0)
    )
    engine = Engine(EngineConfig(model_path=model, n_ctx=n_ctx, n_threads=threads))
    engine.set_adapters([engine.load_adapter(adapter_a)])
    prompt = engine.render_tokens([{"role": "user", "content": DECODE_PROMPT}])
    raw_decode(raw, prompt, 8)
    engine_decode(engine, prompt, 8)  # warm-up
    raw_rates, engine_rates = [], []
    for rep in range(reps):
        pair = [("raw", raw_decode, raw), ("engine", engine_decode, engine)]
        for name, run, target in pair if rep % 2 == 0 else reversed(pair):
            (raw_rates if name == "raw" else engine_rates).append(run(target, prompt, n_tokens))
    ratios = [e / r for e, r in zip(engine_rates, raw_rates, strict=True)]

    # ---- switch cost, per KV policy
    switch: dict[str, float] = {}
    convo = [*history(engine, 500), {"role": "user", "content": "Summarise that in one line."}]
    for policy in ("reset", "state"):
        engine.config.kv_switch = policy
        ha, hb = engine.load_adapter(adapter_a), engine.load_adapter(adapter_b)
        engine.set_adapters([ha])
        ttft(engine, convo)
        engine.set_adapters([hb])
        ttft(engine, convo)  # each set has now seen the conversation once
        samples = []
        for i in range(reps):
            started = time.perf_counter()
            engine.set_adapters([ha] if i % 2 == 0 else [hb])
            switch_cost = (time.perf_counter() - started) * 1000
            samples.append(switch_cost + ttft(engine, convo))
        switch[policy] = statistics.median(samples)
    switch["unchanged"] = statistics.median(ttft(engine, convo) for _ in range(reps))
    engine.config.kv_switch = "reset"

    # ---- follow-up time to first token against history length (adapter set unchanged)
    followup: dict[str, float] = {}
    followup_raw: dict[str, float] = {}
    for size in (200, 2000):
        past = history(engine, size)
        samples, raw_samples = [], []
        for i in range(reps):
            turn = [*past, {"role": "user", "content": f"One more question, number {i}?"}]
            warm = [*past, {"role": "user", "content": "Warm up."}]
            ttft(engine, warm)  # the history is now cached
            samples.append(ttft(engine, turn))
            raw_ttft(raw, engine.render_tokens(warm))
            raw_samples.append(raw_ttft(raw, engine.render_tokens(turn)))
        followup[str(size)] = statistics.median(samples)
        followup_raw[str(size)] = statistics.median(raw_samples)
    engine._clear_kv()
    cold = ttft(engine, [*history(engine, 2000), {"role": "user", "content": "Cold question?"}])
    engine.close()
    raw.close()

    overhead = statistics.median(ratios)
    return {
        "model": str(model),
        "threads": threads,
        "reference": "raw llama-cpp-python Llama.generate, same adapter set via llama_set_adapters_lora",
        "decode_tokens_per_s": {
            "engine": statistics.median(engine_rates),
            "raw": statistics.median(raw_rates),
        },
        "overhead_ratio": round(overhead, 4),
        "overhead_ratio_runs": [round(r, 4) for r in ratios],
        "switch_ms": {k: round(v, 2) for k, v in switch.items()},
        "faster_switch_policy": min(("reset", "state"), key=lambda p: switch[p]),
        "ttft_followup_ms": {k: round(v, 2) for k, v in followup.items()},
        "ttft_followup_growth": round(followup["2000"] / followup["200"], 3),
        "ttft_followup_raw_ms": {k: round(v, 2) for k, v in followup_raw.items()},
        "ttft_cold_2000_ms": round(cold, 2),
        "targets": {"overhead_ratio": f">= {TARGET_OVERHEAD_RATIO}", "ttft_followup_growth": "about 1"},
        "meets_overhead_target": overhead >= TARGET_OVERHEAD_RATIO,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--model", type=Path, default=None, help="base GGUF (default: the embedded model)")
    parser.add_argument("--tokens", type=int, default=96, help="tokens decoded per run")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--n-ctx", type=int, default=4096)
    args = parser.parse_args(argv)
    result = bench(args.model or embedded_model(), args.tokens, args.reps, args.n_ctx)
    return emit(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
