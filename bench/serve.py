"""Serving benchmark: `macaron serve` (a real server process, streamed over HTTP) against the
in-process session, on the same model and the same prompts, measured side by side in one run.

Figures (printed as JSON with --json):
- `tokens_per_s_ratio`: decode tokens/s seen by an HTTP client streaming from the server /
  decode tokens/s of `Session.send` iterated in process (target >= 0.95). Rounds alternate
  server/in-process so machine noise hits both; the ratio is the median of per-pair ratios.
  Decode rate is timed from the first streamed piece to the last.
- `ttft_ms_*`: time to the first streamed text piece, each way (the server's includes HTTP,
  JSON parsing, recording the user message and the SSE framing).
- `same_text`: the greedy replies were identical both ways (the server adds no sampling of its own).
- `concurrency`: latency (p50/p95/max seconds) and TTFT p50 at 1, 4 and 16 concurrent
  clients, with aggregate tokens/s and how many got 429. The engine generates one reply at a
  time, so latency grows with the queue while throughput should hold.

Usage: python bench/serve.py [--json] [--tokens N] [--rounds K]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from common import emit, pct

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the test suite's server runner
from serving import sse_events, start_server  # noqa: E402

from macaron_local.session import Session  # noqa: E402
from macaron_local.settings import Settings  # noqa: E402

TARGET_RATIO = 0.95
PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a bicycle gear system works.",
    "Describe a walk through a busy market in the morning.",
    "Write a letter to a friend about learning to bake bread.",
]


def rate(times: list[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) >= 3 else float("nan")


def in_process(session: Session, prompt: str, tokens: int) -> dict:
    session.new_conversation()
    started = time.perf_counter()
    params = replace(session.default_params(), max_tokens=tokens, temperature=0.0)  # what the server uses
    reply = session.send(prompt, params=params)
    times, text = [], []
    for piece in reply:
        times.append(time.perf_counter())
        text.append(piece)
    return {"ttft_ms": (times[0] - started) * 1000, "rate": rate(times), "text": "".join(text)}


def over_http(server, prompt: str, tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0, "stream": True}
    connection = server.connection(timeout=600)
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        connection.close()
        return {"status": response.status}
    times, text = [], []
    for event in sse_events(response):
        piece = event["choices"][0]["delta"].get("content") if event["choices"] else None
        if piece:
            times.append(time.perf_counter())
            text.append(piece)
    done = time.perf_counter()
    connection.close()
    return {
        "status": 200,
        "ttft_ms": (times[0] - started) * 1000 if times else float("nan"),
        "rate": rate(times),
        "text": "".join(text),
        "seconds": done - started,
        "pieces": len(times),
    }


def concurrent(server, clients: int, tokens: int) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients)

    def one(n: int) -> None:
        barrier.wait()
        result = over_http(server, PROMPTS[n % len(PROMPTS)], tokens)
        with lock:
            results.append(result)

    started = time.perf_counter()
    threads = [threading.Thread(target=one, args=(n,)) for n in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    ok = [r for r in results if r["status"] == 200]
    seconds = [r["seconds"] for r in ok]
    return {
        "clients": clients,
        "ok": len(ok),
        "rejected_429": sum(1 for r in results if r["status"] == 429),
        "latency_s_p50": pct(seconds, 0.5),
        "latency_s_p95": pct(seconds, 0.95),
        "latency_s_max": round(max(seconds), 3),
        "ttft_ms_p50": pct([r["ttft_ms"] for r in ok], 0.5, 1),
        "aggregate_tokens_per_s": round(sum(r["pieces"] for r in ok) / wall, 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=64, help="reply length per request")
    parser.add_argument("--rounds", type=int, default=4, help="server/in-process pairs")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        served_home, local_home = Path(tmp) / "served", Path(tmp) / "local"
        server = start_server(served_home)
        try:
            os.environ["MACARON_HOME"] = str(local_home)
            settings = Settings.load()
            settings.ensure_dirs()
            pairs = []
            with Session(settings) as session:
                session.load()
                in_process(session, "Hello", 4)  # warm both up
                over_http(server, "Hello", 4)
                for n in range(args.rounds):
                    prompt = PROMPTS[n % len(PROMPTS)]
                    first, second = (over_http, in_process) if n % 2 else (in_process, over_http)
                    a = first(server if first is over_http else session, prompt, args.tokens)
                    b = second(server if second is over_http else session, prompt, args.tokens)
                    http_run, local_run = (a, b) if first is over_http else (b, a)
                    pairs.append((http_run, local_run))
            levels = {str(c): concurrent(server, c, args.tokens // 2) for c in (1, 4, 16)}
        finally:
            server.stop()
    ratios = [h["rate"] / loc["rate"] for h, loc in pairs]
    result = {
        "model": "embedded (SmolLM2-135M-Instruct Q4_1)",
        "tokens_per_request": args.tokens,
        "rounds": args.rounds,
        "tokens_per_s_server": round(statistics.median(h["rate"] for h, _ in pairs), 2),
        "tokens_per_s_in_process": round(statistics.median(loc["rate"] for _, loc in pairs), 2),
        "tokens_per_s_ratio": round(statistics.median(ratios), 3),
        "tokens_per_s_ratios": [round(r, 3) for r in ratios],
        "target_ratio": TARGET_RATIO,
        "meets_target": statistics.median(ratios) >= TARGET_RATIO,
        "ttft_ms_server_p50": round(statistics.median(h["ttft_ms"] for h, _ in pairs), 1),
        "ttft_ms_in_process_p50": round(statistics.median(loc["ttft_ms"] for _, loc in pairs), 1),
        "same_text": all(h["text"] == loc["text"] for h, loc in pairs),
        "concurrency": levels,
        "note": "2 shared cores; absolute figures are noisy, the ratio is measured side by side",
    }
    return emit(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
