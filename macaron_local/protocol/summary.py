"""The summary hop: after a task's final answer, the same expert says in a sentence or two what
it did. Hidden from the user; stored on the turn, where the other experts' views read it.

It runs on the expert's adapter set with thinking off and greedy decoding, from the task's own
trace plus the profile's summary instruction (the published layout), as a one-off engine view:
the expert's own view KV is saved before and restored after, untouched. The text is kept to
one line of at most two sentences, as the instruction asks (a small model may run on).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from macaron_local.engine import AdapterHandle, Engine, GenerationParams
from macaron_local.protocol.features import split_reasoning
from macaron_local.protocol.profile import RoutingProfile
from macaron_local.protocol.views import Task, summary_view

SUMMARY_VIEW = "summary"
MAX_SENTENCES = 2  # the summary is "one or two sentences"; a small model may run on past them
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


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
    return SummaryHop(clip_summary(done.text), (time.perf_counter() - started) * 1000, len(tokens))


def clip_summary(text: str) -> str:
    """The reply without its reasoning block, on one line, cut after its second sentence."""
    flat = " ".join(split_reasoning(text)[1].split())
    return " ".join(_SENTENCE_END.split(flat)[:MAX_SENTENCES])
