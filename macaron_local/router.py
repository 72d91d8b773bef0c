"""Pick the expert (L0 Chat, L1 Agent, L2 Coding, L3 UI) that answers a turn: hard routing, one per turn.

In this order:
1. an explicit choice (`--expert`) wins;
2. a tool result goes back to the expert whose reply ended in the tool call (the pending
   route): no route hop runs;
3. the route hop (`macaron_local.protocol.route`): L0 reads the raw request and the model's
   route instruction and continues `model_id=` with one label; the profile's default label
   when its output is not a label;
4. keyword rules only in the explicit fallback mode (`routing = "keywords"` in the settings),
   for machines or models where the hop is not wanted; no clear winner gives the default.
The decision, the hop's raw output and its time are returned so the store records them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from macaron_local.catalog import SLOTS
from macaron_local.errors import InvalidInputError

if TYPE_CHECKING:
    from macaron_local.protocol.route import RouteHop

DEFAULT_SLOT = "L0"

KEYWORDS: dict[str, tuple[str, ...]] = {
    "L1": (
        "remind me",
        "schedule",
        "calendar",
        "send an email",
        "send a message",
        "book a",
        "run the",
        "run this",
        "execute",
        "automate",
        "download",
        "search the web",
        "look up",
        "open the file",
        "rename the files",
        "set a timer",
        "use the tool",
        "call the api",
    ),
    "L2": (
        "code",
        "python",
        "javascript",
        "typescript",
        "rust",
        "golang",
        "java",
        "c++",
        "sql",
        "function",
        "bug",
        "error",
        "exception",
        "traceback",
        "stack trace",
        "compile",
        "regex",
        "algorithm",
        "refactor",
        "unit test",
        "git",
        "api",
        "script",
        "variable",
        "debug",
        "```",
        "def",
        "import",
    ),
    "L3": (
        "css",
        "html",
        "layout",
        "button",
        "user interface",
        "ui",
        "ux",
        "web page",
        "webpage",
        "font",
        "colour",
        "color",
        "figma",
        "tailwind",
        "responsive",
        "navbar",
        "dark mode",
        "landing page",
        "component",
        "design",
    ),
}

ROUTING_MODES = ("model", "keywords")


@dataclass(frozen=True)
class Route:
    slot: str
    method: str  # explicit | pending | model | keywords | default
    reason: str
    raw: str | None = None  # the route hop's output, when it ran
    ms: float | None = None  # the route hop's time, when it ran

    @property
    def expert_name(self) -> str:
        return SLOTS[self.slot]


def _pattern(words: Sequence[str]) -> list[re.Pattern[str]]:
    """Whole-word matches: "code" must not fire on "decode"."""
    return [re.compile(rf"(?<![a-z]){re.escape(word)}(?![a-z])") for word in words]


_KEYWORD_PATTERNS = {slot: _pattern(words) for slot, words in KEYWORDS.items()}


def keyword_scores(text: str) -> dict[str, int]:
    """How many distinct keywords of each expert the request contains."""
    lowered = text.lower()
    return {slot: sum(1 for p in patterns if p.search(lowered)) for slot, patterns in _KEYWORD_PATTERNS.items()}


def route(
    text: str,
    *,
    explicit: str | None = None,
    pending_slot: str | None = None,
    hop: Callable[[str], RouteHop] | None = None,
    mode: str = "model",
    default: str = DEFAULT_SLOT,
) -> Route:
    """Decide which expert answers `text`. `pending_slot` is the expert waiting for a tool
    result; `hop` runs the route hop on L0; `mode` "keywords" uses the fallback rules instead."""
    if explicit:
        slot = normalize_slot(explicit)
        return Route(slot, "explicit", f"expert {slot} {SLOTS[slot]} was chosen explicitly")
    if pending_slot:
        return Route(pending_slot, "pending", f"tool result returns to {pending_slot}, which made the call")
    if mode not in ROUTING_MODES:
        raise InvalidInputError(f"routing must be one of {', '.join(ROUTING_MODES)}, not {mode!r}")
    if mode == "model" and hop is not None:
        decision = hop(text)
        if decision.is_label:
            return Route(decision.label, "model", f"L0 chose {decision.label}", decision.raw, decision.ms)
        why = (
            f"L0's output {decision.raw!r} is not a label; default {decision.label}"
            if decision.raw
            else f"the route hop does not fit the context; default {decision.label}"
        )
        return Route(decision.label, "default", why, decision.raw, decision.ms)
    scores = keyword_scores(text)
    best = max(scores.values())
    leaders = [slot for slot, score in scores.items() if score == best]
    if best > 0 and len(leaders) == 1:
        slot = leaders[0]
        return Route(slot, "keywords", f"{best} {SLOTS[slot]} keyword(s) matched")
    why = "no keyword matched" if best == 0 else f"keywords tied between {', '.join(leaders)}"
    return Route(default, "default", f"{why}; default expert")


def normalize_slot(value: str) -> str:
    """Accept "L2", "l2", "2" or "coding" for the Coding expert."""
    text = value.strip()
    for slot, name in SLOTS.items():
        if text.upper() in (slot, slot[1:]) or text.lower() == name.lower():
            return slot
    raise InvalidInputError(f"unknown expert {value!r}: use one of {', '.join(f'{s} ({n})' for s, n in SLOTS.items())}")
