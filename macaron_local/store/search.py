"""Turning what a user typed into a safe FTS5 query.

FTS5 has its own query language: a stray `"`, a bare `*`, `AND OR`, or `NEAR(` is a syntax
error, and a user's search box must never crash on that. Each whitespace-separated word
becomes a quoted phrase (internal quotes doubled), so every word must appear, in any order.
A word ending in `*` keeps its meaning as a prefix search; words with no letters or digits
are dropped, since the tokenizer would drop them anyway.
"""

from __future__ import annotations

import re

#: How `SearchHit.snippet` marks the matched words (Markdown bold: readable as plain text too).
#: Front ends that render markup must still escape the snippet: it is the user's own text.
HIGHLIGHT_START = "**"
HIGHLIGHT_END = "**"
SNIPPET_ELLIPSIS = "…"
SNIPPET_TOKENS = 12

_WORD = re.compile(r"[^\W_]")  # a letter or digit


def fts_query(text: str) -> str | None:
    """The FTS5 MATCH expression for the user's `text`, or None if nothing is searchable."""
    terms = []
    for word in str(text).split():
        core = word.rstrip("*")
        if not _WORD.search(core):
            continue
        phrase = '"' + core.replace('"', '""') + '"'
        terms.append(phrase + ("*" if core != word else ""))
    return " ".join(terms) or None
