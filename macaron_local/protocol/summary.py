"""The summary hop: after a task's final answer, the same expert says in a sentence or two what
it did. Hidden from the user; stored on the turn, where the other experts' views read it.

It runs on the expert's adapter set with thinking off and greedy decoding, from the task's own
trace plus the profile's summary instruction (the published layout), as a one-off engine view:
the expert's own view KV is saved before and restored after, untouched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from macaron_local.engine import AdapterHandle, Engine, GenerationParams
from macaron_local.protocol.features import split_reasoning
from macaron_local.protocol.profile import RoutingProfile
from macaron_local.protocol.views import Task, summary_view

SUMMARY_VIEW = "summary"


@dataclass(frozen=True)
class SummaryHop:
    text: str
    ms: float
    prompt_tokens: int


def run_summary_hop(
    engine: Engine,
    profile: RoutingProfile,
    task: Task,
    system_prompt: str,
    adapters: Sequence[AdapterHandle],
    *,
    max_tokens: int = 192,
) -> SummaryHop:
    started = time.perf_counter()
    engine.set_adapters(adapters, view=SUMMARY_VIEW, remember=False)
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.1)
    tokens, _ = engine.prompt_for(summary_view(task, system_prompt, profile), max_tokens, enable_thinking=False)
    done = engine.generate(tokens, params)
    text = " ".join(split_reasoning(done.text)[1].split())
    return SummaryHop(text, (time.perf_counter() - started) * 1000, len(tokens))
