"""Styles the user keeps adding, applied to every correction of the night: preferences add up.

Each correction fixes what the user noticed in one reply. A user who wants every answer to end
with "Anything else?" and every answer to open in bold, and who taught both on one night, wrote
twelve corrections with the closing line and twelve with the bold lead, and none with both. To
the learner those corrections disagree: two in three end right after the answer, so the
end-of-turn token wins the place where the closing line goes. Measured on the embedded model,
the closing line reached 1.0 of its held-out prompts when taught alone and 0.0 beside a bold
lead and a cat's name (stop 47), while lessons that open a reply (a greeting, a bold lead) won:
at the first token the other corrections' openings are many different words, at the end they
are one token.

So before training, each style tonight's corrections keep adding is found (`night_styles`) and
applied to the night's other corrections that lack it (`compose`): the bold lead's corrections
get the closing line, the closing line's the bold lead, the cat's both. A style is a change a
machine can make to any reply without knowing what it says, and without moving what the reply
says from where the user put it:

- `ClosingLine`: a fixed last line ("Anything else?");
- `TrailingAddress`: the user's name or title after a comma at the end ("..., Dr. Okafor.");
- `BoldLead`: the first sentence (or its first clause) in bold;
- `Case`: every letter lower case, or every letter upper case.

A label that opens the reply ("TL;DR:", "Hi Sam,", "Dr. Okafor,") is not composed. Lessons
that open a reply already win on a night of several (a greeting 1.0, a bold lead 0.875, stop
47), and put in front of a fact's corrections the label took the place the fact was learned
in: composed into a bad knee's and an old car's corrections ("Dr. Okafor, with your bad knee,
..."), the address rose from 0.5 to 0.875 and the two facts fell to 0.125 and 0.25 ("Dr.
Okafor, start with light walks and gradually increase the distance"; one run, stop 48).

A style counts when at least `MIN_ADDED` of tonight's new corrections added it (their rejected
reply lacked it, the correction has it) and none of them took it away (a user who deletes a
greeting from a reply does not want it, whatever older corrections said). Facts, formats that
rewrite the whole reply (a list, JSON, a heading) and lengths are not styles here: nothing can
add them to a reply about something else. The held-out corrections the gate reads and the
anchors (content only, learn/anchors.py) are never changed.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from macaron_local.learn.episodes import Episode
from macaron_local.learn.rewards import first_sentence

#: Tonight's new corrections that must add a style (and none remove it) before it is composed.
MIN_ADDED = 3
#: A closing line is at most this many words.
CLOSING_WORDS = 8
# A name or title after the last comma, then the sentence's end: "..., Dr. Okafor." A name is
# capitalised, so ", your Civic." (a fact) is not an address.
_ADDRESS = re.compile(r",\s+([A-Z][\w.' -]{1,30}?)\s*[.!?]\s*\Z")
#: A bold lead is at most this many characters: the gist, not the answer.
BOLD_CHARS = 80
_BOLD = re.compile(rf"\A\s*\*\*[^*\n]{{2,{BOLD_CHARS}}}\*\*")


class Style(Protocol):
    name: str

    def holds(self, text: str) -> bool: ...

    def apply(self, text: str) -> str: ...


@dataclass(frozen=True)
class ClosingLine:
    line: str  # "Anything else?"
    separator: str  # what stands between the answer and the line, as the user wrote it

    @property
    def name(self) -> str:
        return f"ends with {self.line!r}"

    def holds(self, text: str) -> bool:
        return text.rstrip().endswith(self.line)

    def apply(self, text: str) -> str:
        return f"{text.rstrip()}{self.separator}{self.line}"


@dataclass(frozen=True)
class TrailingAddress:
    address: str  # "Dr. Okafor"

    @property
    def name(self) -> str:
        return f"ends addressing {self.address!r}"

    def holds(self, text: str) -> bool:
        return self.address in text

    def apply(self, text: str) -> str:
        body = text.rstrip()
        if body[-1:] in ".!?":
            return f"{body[:-1]}, {self.address}{body[-1]}"
        return f"{body}, {self.address}."


@dataclass(frozen=True)
class BoldLead:
    name: str = "opens with its first sentence in bold"

    def holds(self, text: str) -> bool:
        return bool(_BOLD.match(text))

    def apply(self, text: str) -> str:
        """The first sentence in bold, or its first clause where the sentence is longer than
        a gist (the user's bold leads are a few words: "**Soak them overnight.**")."""
        body = text.strip()
        lead = first_sentence(body)
        if len(lead) > BOLD_CHARS:
            clause = body.split(",", 1)[0]
            lead = clause + "," if len(clause) < BOLD_CHARS and clause != body else lead
        return f"**{lead}**{body[len(lead) :]}"


@dataclass(frozen=True)
class Case:
    upper: bool

    @property
    def name(self) -> str:
        return "all upper case" if self.upper else "all lower case"

    def holds(self, text: str) -> bool:
        letters = [c for c in text if c.isalpha()]
        return bool(letters) and all(c.isupper() if self.upper else c.islower() for c in letters)

    def apply(self, text: str) -> str:
        return text.upper() if self.upper else text.lower()


def _pairs(episodes: Sequence[Episode]) -> list[tuple[str, str]]:
    """(rejected, correction) of every correction with a rejected reply."""
    return [(e.rejected, e.chosen) for e in episodes if e.corrected and e.chosen and e.rejected is not None]


def _stands(style: Style, pairs: Sequence[tuple[str, str]]) -> bool:
    """Added by at least MIN_ADDED corrections and taken away by none."""
    added = sum(1 for rejected, chosen in pairs if style.holds(chosen) and not style.holds(rejected))
    removed = sum(1 for rejected, chosen in pairs if style.holds(rejected) and not style.holds(chosen))
    return added >= MIN_ADDED and removed == 0


def _closings(corrections: Sequence[str]) -> list[ClosingLine]:
    lines: Counter[tuple[str, str]] = Counter()
    for text in corrections:
        body = text.rstrip()
        head, sep, last = body.rpartition("\n")
        if sep and head.strip() and 0 < len(last.split()) <= CLOSING_WORDS:
            separator = body[len(head.rstrip()) : len(body) - len(last)]  # "\n\n", as the user wrote it
            lines[(last.strip(), separator)] += 1
    return [ClosingLine(line, separator) for (line, separator), n in lines.items() if n >= MIN_ADDED]


def _addresses(corrections: Sequence[str]) -> list[TrailingAddress]:
    ends = Counter(m.group(1) for text in corrections if (m := _ADDRESS.search(text)))
    return [TrailingAddress(address) for address, n in ends.items() if n >= MIN_ADDED]


def night_styles(tonight: Sequence[Episode]) -> list[Style]:
    """The styles tonight's new corrections (trained and held out) keep adding, in the order
    `compose` applies them: the case last, so what the others add is cased too."""
    pairs = _pairs(tonight)
    corrections = [chosen for _, chosen in pairs]
    candidates: list[Style] = [BoldLead(), *_addresses(corrections), *_closings(corrections), Case(False), Case(True)]
    return [s for s in candidates if _stands(s, pairs)]


def compose(episodes: Sequence[Episode], styles: Sequence[Style]) -> tuple[list[Episode], int]:
    """`episodes` with every style applied to each correction that lacks it, and how many
    corrections changed. Only corrections change: a rating's liked reply is the model's own,
    and an anchor is judged on its content alone."""
    out, changed = [], 0
    for episode in episodes:
        if not (episode.corrected and episode.chosen) or episode.content_only:
            out.append(episode)
            continue
        text = styled(episode.chosen, styles)
        changed += text != episode.chosen
        out.append(replace(episode, chosen=text) if text != episode.chosen else episode)
    return out, changed


def styled(text: str, styles: Sequence[Style]) -> str:
    """`text` with each of `styles` it lacks applied, in order."""
    for style in styles:
        if not style.holds(text):
            text = style.apply(text)
    return text
