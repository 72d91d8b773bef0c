"""Agent benchmark: what the tool loop costs on top of the tools and the model.

1. Per call, without a model: the loop's own work (parse the reply's call, check it, decide the
   approval, dispatch, record the trajectory on the turn and the result as a tool message in
   SQLite) against the tool's own run time (`read_file` on a 64 KB file, `list_folder`, and a
   `run_command` of `true`), each measured alone in the same run. Reference: the tool alone.
2. On the embedded model: decode tokens/s of a tool-using turn (the grammar-held call) against
   a plain turn (no tools offered) on the same request, interleaved (order alternating after a
   warm-up turn), medians of --rounds.
   Reference: the plain turn.

Usage: python bench/agent.py [--json] [--calls N] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import emit

from macaron_local.engine import GenerationParams
from macaron_local.protocol.features import parse_tool_calls
from macaron_local.session import Session
from macaron_local.settings import Settings
from macaron_local.store import open_default_store
from macaron_local.tools.agent import Agent
from macaron_local.tools.approval import Approvals, fixed
from macaron_local.tools.builtin import builtin_tools
from macaron_local.tools.config import tools_config

REQUEST = "Write the word hello into the file notes.txt."


def median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1000, 4)


def loop_overhead(settings: Settings, work: Path, calls: int) -> dict:
    (work / "big.txt").write_text("x" * 65536)
    config = tools_config({"write_folders": [str(work)]}, cwd=work)
    agent = Agent(None, builtin_tools(config), Approvals(fixed("approve")), config)
    out = {}
    with open_default_store(settings) as store:
        conversation = store.new_conversation("embedded")
        question = store.add_message(conversation, "user", "hi")
        for tool, arguments in (
            ("read_file", '{"path": "big.txt"}'),
            ("list_folder", '{"path": "."}'),
            ("run_command", '{"command": "true"}'),
        ):
            text = f'<tool_call>\n{{"name": "{tool}", "arguments": {arguments}}}\n</tool_call>'
            spec = agent.by_name[tool]
            alone, parse, loop, record = [], [], [], []
            for _ in range(calls):
                started = time.perf_counter()
                [call] = parse_tool_calls(text, "hermes")
                parse.append(time.perf_counter() - started)
                started = time.perf_counter()
                spec.run(call.arguments)
                alone.append(time.perf_counter() - started)
                started = time.perf_counter()
                step = agent.execute(call, "m")
                loop.append(time.perf_counter() - started)
                reply, _ = store.add_reply(conversation, question, text, {"model": "embedded", "expert": "L1"})
                started = time.perf_counter()
                result = store.add_message(conversation, "tool", step.result, reply)
                store.set_turn_tool_calls(reply, [step.record() | {"result_message_id": result}])
                record.append(time.perf_counter() - started)
            tool_ms = median_ms(alone)
            overhead_ms = median_ms(parse) + (median_ms(loop) - tool_ms) + median_ms(record)
            out[tool] = {
                "tool_ms": tool_ms,
                "parse_ms": median_ms(parse),
                "dispatch_ms": round(median_ms(loop) - tool_ms, 4),
                "record_ms": median_ms(record),
                "overhead_ms": round(overhead_ms, 4),
                "overhead_vs_tool": round(overhead_ms / max(tool_ms, 1e-6), 3),
            }
    return out


def decode_rate(done) -> float:
    seconds = max((done.total_ms - done.ttft_ms) / 1000, 1e-9)
    return (len(done.tokens) - 1) / seconds if len(done.tokens) > 1 else 0.0


def turn_speed(settings: Settings, work: Path, rounds: int) -> dict:
    config = tools_config({"write_folders": [str(work)]}, cwd=work)
    tools = builtin_tools(config)
    params = GenerationParams(max_tokens=64, temperature=0.0, repeat_penalty=1.1)
    plain, tooled, tokens = [], [], {"plain": [], "tool": []}
    with Session(settings, engine_config={"n_ctx": 2048}) as session:
        session.send("Hello.", expert="L1", params=params).wait()  # warm up: load and first decode
        for index in range(rounds):
            for kind in ("plain", "tool") if index % 2 == 0 else ("tool", "plain"):
                session.new_conversation()
                offered = {"tools": tools, "tool_choice": "write_file"} if kind == "tool" else {}
                done = session.send(REQUEST, expert="L1", params=params, **offered).wait().completion
                (tooled if kind == "tool" else plain).append(decode_rate(done))
                tokens[kind].append(len(done.tokens))
    return {
        "plain_tokens_per_s": round(statistics.median(plain), 2),
        "tool_turn_tokens_per_s": round(statistics.median(tooled), 2),
        "tool_vs_plain_tokens_per_s": round(statistics.median(tooled) / max(statistics.median(plain), 1e-9), 3),
        "tokens": tokens,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MACARON_HOME"] = str(Path(tmp) / "home")
        settings = Settings.load()
        settings.ensure_dirs()
        work = Path(tmp) / "work"
        work.mkdir()
        result = {
            "reference": "each tool run alone; the same request answered without tools, interleaved",
            "per_call": loop_overhead(settings, work, args.calls),
            "turns": turn_speed(settings, work, args.rounds),
        }
    return emit(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
