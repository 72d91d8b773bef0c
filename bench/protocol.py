"""Protocol benchmark: own views against the whole transcript, on one 10-turn conversation that
alternates two experts, in the same run.

The model is the embedded base (SmolLM2-135M) with two random LoRA experts on L0 and L2 (rank 4
on every linear layer; the embedded model ships none), so each expert's KV is computed under its
own adapters, as with Tall. The experts alternate L0, L2, L0, ... by schedule (the route hop
still runs every turn on L0 and is timed, but a 135M router sends nearly everything to L0).

- **own views** (the protocol): route hop, then the expert answers from its own view (its own
  tasks verbatim, the other expert's as summaries) with the engine's per-(adapter set, view)
  KV cache, then the hidden summary hop.
- **transcript** (the baseline, on a second engine, turn by turn with the first): every expert
  reads the whole transcript verbatim, with the per-adapter-set KV cache the engine had before
  (each expert extends its own saved KV). No route or summary hop runs for it: the baseline at
  its best.

Per turn and mode: `prefill_tokens` (prompt tokens not taken from a saved KV prefix) and
`ttft_ms`; for own views also `route_ms` and `summary_ms`. Both modes generate greedily with
the same budget. The machine may be shared: compare the ratios, measured side by side.

Usage: python bench/protocol.py [--json] [--turns N] [--max-tokens T] [--threads T]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from common import embedded_model, emit, random_lora

from macaron_local.adapters import BaseModelInfo, write_adapter
from macaron_local.engine import Engine, EngineConfig, GenerationParams
from macaron_local.protocol.features import split_reasoning
from macaron_local.protocol.profile import shipped_profile
from macaron_local.protocol.route import run_route_hop
from macaron_local.protocol.summary import run_summary_hop
from macaron_local.protocol.views import Step, own_view, tasks_of, transcript_view

SYSTEM = "You are a helpful assistant."
QUESTIONS = (
    "Explain in a few sentences why the sky is blue.",
    "Write a Python function that returns the squares of a list of numbers.",
    "What are three good habits for a calm morning?",
    "Write a Python class for a simple bank account with deposit and withdraw.",
    "Describe how bread rises, step by step.",
    "Write a Python function that counts the words in a text file.",
    "Give me advice for learning to play the guitar.",
    "Write a Python script that prints the first twenty prime numbers.",
    "Why do cats purr? Explain briefly.",
    "Write a Python function that reverses the words of a sentence.",
    "What makes a good cup of tea?",
    "Write a Python generator for the Fibonacci numbers.",
)


class Conversation:
    """One mode's conversation on its own engine, advanced one turn at a time (the two modes
    take turns, so the machine's load falls on both alike)."""

    def __init__(self, mode: str, engine: Engine, experts: dict[str, Path], args: argparse.Namespace) -> None:
        self.mode, self.engine, self.args = mode, engine, args
        self.profile = shipped_profile("embedded")
        self.handles = {slot: [engine.load_adapter(path)] for slot, path in experts.items()}
        self.params = GenerationParams(max_tokens=args.max_tokens, temperature=0.0, repeat_penalty=1.1)
        self.steps: list[Step] = []
        self.out: dict[str, list] = {"expert": [], "prompt_tokens": [], "prefill_tokens": [], "ttft_ms": []}
        if mode == "own_views":
            self.out |= {"route_label": [], "route_ms": [], "summary_ms": [], "summary_tokens": []}

    def turn(self, index: int) -> None:
        engine, out, profile = self.engine, self.out, self.profile
        expert = ("L0", "L2")[index % 2]
        self.steps.append(Step("user", QUESTIONS[index % len(QUESTIONS)]))
        if self.mode == "own_views":
            hop = run_route_hop(engine, profile, self.steps[-1].content, self.handles["L0"])
            out["route_label"].append(hop.label)
            out["route_ms"].append(round(hop.ms, 1))
            engine.set_adapters(self.handles[expert], view=expert)
            view = own_view(self.steps, expert, SYSTEM, profile)
        else:
            engine.set_adapters(self.handles[expert])
            view = transcript_view(self.steps, SYSTEM, profile)
        tokens, _ = engine.prompt_for(view, self.params.max_tokens)
        done = engine.generate(tokens, self.params)
        reply = split_reasoning(done.text)[1]
        out["expert"].append(expert)
        out["prompt_tokens"].append(done.prompt_tokens)
        out["prefill_tokens"].append(done.prompt_tokens - done.reused_prompt_tokens)
        out["ttft_ms"].append(round(done.ttft_ms, 1))
        summary = None
        if self.mode == "own_views":
            task = tasks_of([*self.steps, Step("assistant", reply, expert=expert)])[-1]
            handles = self.handles[expert]
            hop = run_summary_hop(engine, profile, task, SYSTEM, handles, max_tokens=self.args.summary_tokens)
            summary = hop.text
            out["summary_ms"].append(round(hop.ms, 1))
            out["summary_tokens"].append(len(engine.tokenize(hop.text)))
        self.steps.append(Step("assistant", reply, expert=expert, summary=summary))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=96, help="longest reply")
    parser.add_argument("--summary-tokens", type=int, default=64, help="longest summary")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.turns < 3:
        print("error: --turns must be at least 3", file=sys.stderr)
        return 2
    model = embedded_model()
    info = BaseModelInfo.from_gguf(model)
    with tempfile.TemporaryDirectory() as tmp:
        experts = {
            slot: write_adapter(Path(tmp) / f"{slot}.gguf", random_lora(info, rank=4, seed=seed, magnitude=0.005))
            for slot, seed in (("L0", 1), ("L2", 2))
        }
        config = EngineConfig(model_path=model, n_ctx=4096, n_threads=args.threads)
        with Engine(config) as first, Engine(config) as second:
            modes = [Conversation("own_views", first, experts, args), Conversation("transcript", second, experts, args)]
            for index in range(args.turns):
                for conversation in modes:
                    conversation.turn(index)
        own, baseline = modes[0].out, modes[1].out
    later = slice(2, None)  # turn 3 on: both experts have answered before
    own_prefill, base_prefill = sum(own["prefill_tokens"][later]), sum(baseline["prefill_tokens"][later])
    answer_ms = sum(own["ttft_ms"])
    result = {
        "model": "SmolLM2-135M-Instruct Q4_1 + random rank-4 L0 and L2 experts",
        "turns": args.turns,
        "own_views": own,
        "transcript": baseline,
        "own_views_prefill_fewer_every_turn_from_3": all(
            o < b for o, b in zip(own["prefill_tokens"][later], baseline["prefill_tokens"][later], strict=True)
        ),
        "prefill_ratio_from_turn_3": round(own_prefill / max(base_prefill, 1), 3),
        "ttft_ratio_from_turn_3": round(sum(own["ttft_ms"][later]) / max(sum(baseline["ttft_ms"][later]), 1e-9), 3),
        "route_ms_median": statistics.median(own["route_ms"]),
        "summary_ms_median": statistics.median(own["summary_ms"]),
        "summary_ms_per_turn_vs_ttft": round(sum(own["summary_ms"]) / max(answer_ms, 1e-9), 3),
        "threads": args.threads,
    }
    return emit(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
