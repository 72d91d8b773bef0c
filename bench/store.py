"""Store benchmark: feedback writes while a reply is being saved, and search over 100,000 messages.

Figures (printed as JSON with --json), all measured in one run on one store file:
- `feedback_write_p50_ms` / `feedback_write_p99_ms`: `Store.add_feedback` latency WHILE a second
  process, with its own connection to the same file, simulates generation (a user message, then
  a ~1.5 KB reply and its turn, one write every ~50 ms) and CPU-bound processes stand in for
  llama.cpp's threads. Target: p99 <= 5 ms.
- `feedback_write_idle_p50_ms` / `feedback_write_idle_p99_ms`: the same writes with nothing else
  running: the reference for the figures above.
- `feedback_write_thread_p99_ms`: the concurrent writer as a thread of the same process (how the
  app saves a reply from its generation thread), with the same CPU load.
- `search_p50_ms` / `search_p99_ms`: `Store.search` (quoted words, bm25 order, 20 hits) over a
  store seeded with `messages` messages (one executemany in one transaction: `seed_s`). Queries
  mix rare and common words, two-word queries and prefixes.

Usage: python bench/store.py [--json] [--messages N] [--writes N] [--burners N]
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import random
import sqlite3
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from common import emit, pct

from macaron_local.store import Store, open_store
from macaron_local.store.ids import new_id, now_iso

TARGET_FEEDBACK_P99_MS = 5.0
WRITER_INTERVAL_S = 0.05
TURN = {
    "model": "embedded",
    "expert": "L2",
    "route_method": "keywords",
    "route_reason": "bench",
    "adapters": ["L2-coding.gguf", "personal-v1"],
    "sampling": {"temperature": 0.7, "top_p": 0.95},
    "prompt_tokens": 400,
    "completion_tokens": 300,
    "ttft_ms": 45.0,
    "total_ms": 3000.0,
    "finish_reason": "stop",
}


def vocabulary(rng: random.Random, size: int = 20_000) -> list[str]:
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"]
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(syllables) for _ in range(rng.randint(2, 4))))
    return sorted(words)


def text(rng: random.Random, words: list[str], cum_weights: list[float], n: int) -> str:
    return " ".join(rng.choices(words, cum_weights=cum_weights, k=n))


def seed(store: Store, n_messages: int, rng: random.Random, words: list[str], cum: list[float]) -> float:
    """Insert `n_messages` (20 per conversation, alternating user/assistant) in one transaction;
    returns the seconds the inserts took (FTS indexing included, text generation not)."""
    conversations, messages = [], []
    per = 20
    for _ in range(0, n_messages, per):
        cid, now = new_id(), now_iso()
        parent = None
        for i in range(min(per, n_messages - len(messages))):
            mid = new_id()
            length = rng.randint(8, 40) if i % 2 == 0 else rng.randint(30, 150)
            messages.append(
                (
                    mid,
                    cid,
                    parent,
                    "user" if i % 2 == 0 else "assistant",
                    text(rng, words, cum, length),
                    now,
                )
            )
            parent = mid
        conversations.append((cid, None, "embedded", "", now, now, parent))
    conn = store.db.conn
    started = time.perf_counter()
    conn.execute("BEGIN IMMEDIATE")
    conn.executemany("INSERT INTO conversations VALUES (?, ?, ?, ?, ?, ?, ?)", conversations)
    conn.executemany(
        "INSERT INTO messages (id, conversation_id, parent_id, role, content, created_at) VALUES (?, ?, ?, ?, ?, ?)",
        messages,
    )
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return time.perf_counter() - started


def burn(stop: mp.synchronize.Event) -> None:
    """A CPU-bound loop standing in for one llama.cpp thread."""
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF


def generation_writer(path: str, stop: threading.Event | mp.synchronize.Event, counter: list[int] | None) -> int:
    """Simulated chat: a user message, then its reply and turn, one write every ~50 ms."""
    rng = random.Random(11)
    with open_store(Path(path)) as store:
        cid = store.new_conversation("embedded", "bench")
        parent = None
        written = 0
        while not stop.is_set():
            parent = store.add_message(cid, "user", "another question about lists " * 4, parent)
            time.sleep(WRITER_INTERVAL_S)
            reply = " ".join(rng.choice(["token", "stream", "reply", "words", "python"]) for _ in range(250))
            parent, _ = store.add_reply(cid, parent, reply, TURN)
            written += 1
            time.sleep(WRITER_INTERVAL_S)
    if counter is not None:
        counter.append(written)
    return written


def process_writer(path: str, stop: mp.synchronize.Event, result: mp.queues.Queue) -> None:
    result.put(generation_writer(path, stop, None))


def measure(fn: Callable[[], object], n: int, rng: random.Random) -> list[float]:
    """Latency of `n` calls in ms, spaced 0-4 ms apart so they land at all phases of the writer."""
    out = []
    for _ in range(n):
        time.sleep(rng.uniform(0, 0.004))
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1000)
    return out


def bench(n_messages: int, n_writes: int, n_burners: int) -> dict[str, object]:
    rng = random.Random(5)
    words = vocabulary(rng)
    cum = list(itertools.accumulate(1 / (rank + 1) for rank in range(len(words))))  # Zipf-like
    with tempfile.TemporaryDirectory(prefix="macaron-bench-") as tmp:
        path = Path(tmp) / "data" / "macaron.db"
        store = open_store(path)
        seed_s = seed(store, n_messages, rng, words, cum)
        cid = store.new_conversation("embedded", "bench")
        question = store.add_message(cid, "user", "rate me", None)
        answer, _ = store.add_reply(cid, question, "a reply to rate", TURN)

        def write() -> object:
            return store.add_feedback(answer, "rating", 1)

        measure(write, 50, rng)  # warm up
        idle = measure(write, n_writes, rng)

        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        burners = [ctx.Process(target=burn, args=(stop,), daemon=True) for _ in range(n_burners)]
        results = ctx.Queue()
        writer = ctx.Process(target=process_writer, args=(str(path), stop, results), daemon=True)
        for p in (*burners, writer):
            p.start()
        time.sleep(1.0)  # let the writer and burners get going (spawn imports take a moment)
        busy = measure(write, n_writes, rng)
        stop.set()
        replies_process = results.get(timeout=30)
        for p in (*burners, writer):
            p.join(timeout=10)

        stop_thread = threading.Event()
        stop_burn = ctx.Event()
        burners = [ctx.Process(target=burn, args=(stop_burn,), daemon=True) for _ in range(n_burners)]
        for p in burners:
            p.start()
        counter: list[int] = []
        thread = threading.Thread(target=generation_writer, args=(str(path), stop_thread, counter))
        thread.start()
        time.sleep(0.5)
        busy_thread = measure(write, n_writes, rng)
        stop_thread.set()
        stop_burn.set()
        thread.join()
        for p in burners:
            p.join(timeout=10)

        kinds: dict[str, Callable[[], str]] = {
            "rare_word": lambda: rng.choice(words[2000:]),
            "common_word": lambda: rng.choice(words[:200]),  # in thousands of messages
            "two_words": lambda: " ".join(rng.choices(words[:3000], k=2)),
            "prefix": lambda: rng.choice(words[100:5000])[:4] + "*",
        }
        queries = [(kind, make()) for _ in range(75) for kind, make in kinds.items()]
        search_ms, by_kind, hits = [], {kind: [] for kind in kinds}, 0
        for kind, query in queries:
            started = time.perf_counter()
            hits += len(store.search(query))
            elapsed = (time.perf_counter() - started) * 1000
            search_ms.append(elapsed)
            by_kind[kind].append(elapsed)
        total_messages = store.db.execute("SELECT count(*) FROM messages").fetchone()[0]
        size_mb = path.stat().st_size / 1e6
        store.close()

    return {
        "messages": total_messages,
        "seeded_messages": n_messages,
        "seed_s": round(seed_s, 2),
        "seed_messages_per_s": round(n_messages / seed_s),
        "db_size_mb": round(size_mb, 1),
        "feedback_writes": n_writes,
        "feedback_write_p50_ms": pct(busy, 0.50),
        "feedback_write_p99_ms": pct(busy, 0.99),
        "feedback_write_max_ms": round(max(busy), 3),
        "feedback_write_idle_p50_ms": pct(idle, 0.50),
        "feedback_write_idle_p99_ms": pct(idle, 0.99),
        "feedback_write_thread_p50_ms": pct(busy_thread, 0.50),
        "feedback_write_thread_p99_ms": pct(busy_thread, 0.99),
        "concurrent_writer": (
            "separate process: a user message, then a ~1.5 KB reply + turn, one write every "
            f"{WRITER_INTERVAL_S * 1000:.0f} ms; "
            f"{n_burners} CPU-bound process(es) standing in for llama.cpp"
        ),
        "concurrent_replies_written": replies_process,
        "concurrent_replies_written_thread": counter[0] if counter else 0,
        "target_feedback_write_p99_ms": TARGET_FEEDBACK_P99_MS,
        "feedback_target_met": pct(busy, 0.99) <= TARGET_FEEDBACK_P99_MS,
        "search_queries": len(queries),
        "search_hits": hits,
        "search_p50_ms": pct(search_ms, 0.50),
        "search_p99_ms": pct(search_ms, 0.99),
        "search_max_ms": round(max(search_ms), 3),
        "search_p99_ms_by_kind": {kind: pct(ms, 0.99) for kind, ms in by_kind.items()},
        "sqlite_version": sqlite3.sqlite_version,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--messages", type=int, default=100_000, help="messages to seed (default 100000)")
    parser.add_argument("--writes", type=int, default=1000, help="feedback writes per phase")
    parser.add_argument("--burners", type=int, default=1, help="CPU-bound processes during the busy phases")
    args = parser.parse_args(argv)
    result = bench(args.messages, args.writes, args.burners)
    return emit(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
