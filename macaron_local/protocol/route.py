"""The route hop: L0 picks the expert for a new request, exactly as Mind Lab serves Tall.

One user message holds the raw current request, a blank line and the route instruction; an
assistant message holds the literal `model_id=`, which the model continues (rendered by the
model's own template, cut after the prefill: no new generation prompt). Thinking is off,
decoding is greedy, at most 24 tokens, and only the labels' tokens can be chosen (label
scoring on llama.cpp's logits). An output that is still not a label (a label that needs more
than the budget) gives the profile's default label.

The request is not quoted or escaped: the published hop passes it raw and the route
instruction itself tells L0 to treat it as untrusted text to classify. The keyword rules
(`macaron_local.router.keyword_scores`) remain as an explicit fallback mode, never a first step.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from macaron_local.engine import AdapterHandle, Engine
from macaron_local.engine.template import Message
from macaron_local.protocol.profile import PREFILL, RoutingProfile

ROUTE_VIEW = "route"  # the engine's KV view for route prompts (one-off: not kept)
_LABEL = re.compile(r"\s*(L\d+)\s*", re.IGNORECASE)


@dataclass(frozen=True)
class RouteHop:
    """What the route hop did: the label chosen, the raw continuation, and what it cost."""

    label: str
    raw: str
    is_label: bool  # False: the output was not a label (or the hop did not fit) and the default was used
    ms: float
    prompt_tokens: int


def route_messages(profile: RoutingProfile, request: str) -> list[Message]:
    """The hop's two messages: the raw request plus the instruction, then the prefill."""
    return [
        {"role": "user", "content": f"{request.strip()}\n\n{profile.route_instruction}"},
        {"role": "assistant", "content": PREFILL},
    ]


def route_prompt(engine: Engine, profile: RoutingProfile, request: str) -> list[int]:
    """The exact tokens the hop decodes from (the template's rendering, continued)."""
    return engine.render_tokens(route_messages(profile, request), continue_final=True, enable_thinking=False)


def constrained_greedy(
    engine: Engine, prompt: Sequence[int], options: Sequence[Sequence[int]], max_tokens: int
) -> list[int]:
    """Greedy decoding where only a continuation of one of `options` (token sequences) may be
    chosen: at each step the most likely allowed token, until an option is complete. This is
    the published hop's `choice` constraint, done on the engine's logits (in process, a text
    grammar sampler aborts when a vocabulary cannot spell it; a remote engine takes token ids)."""
    chosen: list[int] = []
    while len(chosen) < max_tokens:
        candidates = [o for o in options if list(o[: len(chosen)]) == chosen and len(o) > len(chosen)]
        if not candidates:
            break
        allowed = sorted({o[len(chosen)] for o in candidates})
        if len(allowed) == 1:
            chosen.append(allowed[0])  # forced: no need to evaluate
        else:
            chosen.append(engine.best_next([*prompt, *chosen], allowed))
        if any(list(o) == chosen for o in options):
            break
    return chosen


def parse_label(raw: str, labels: Sequence[str]) -> str | None:
    """A complete canonical label (surrounding whitespace allowed), else None."""
    match = _LABEL.fullmatch(raw or "")
    label = match.group(1).upper() if match else None
    return label if label in labels else None


def run_route_hop(
    engine: Engine,
    profile: RoutingProfile,
    request: str,
    l0_adapters: Sequence[AdapterHandle],
    *,
    max_tokens: int = 24,
) -> RouteHop:
    """Run the hop on L0's adapter set and return its decision."""
    started = time.perf_counter()
    engine.set_adapters(l0_adapters, view=ROUTE_VIEW, remember=False)
    tokens = route_prompt(engine, profile, request)
    if len(tokens) + max_tokens > engine.config.n_ctx:
        # No room for the hop: the default label answers (and a request too long for the answer
        # itself gets the answer hop's clear context error).
        return RouteHop(profile.default_label, "", False, (time.perf_counter() - started) * 1000, len(tokens))
    options = [engine.tokenize(label, special=False) for label in profile.labels]
    raw = engine.detokenize(constrained_greedy(engine, tokens, options, max_tokens))
    label = parse_label(raw, profile.labels)
    ms = (time.perf_counter() - started) * 1000
    return RouteHop(label or profile.default_label, raw, label is not None, ms, len(tokens))
