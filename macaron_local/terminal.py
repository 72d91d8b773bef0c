"""Text from files on its way to a terminal: control characters made visible, never obeyed.

A tensor name, a conversation title or a manifest field can carry ESC sequences that move the
cursor, rewrite earlier lines, retitle the window or (in some terminals) answer back. Every
string that came from a file passes through `printable` before it is printed, so it shows as
`\\x1b[2J` instead of clearing the screen. Newlines and tabs are kept only where asked.
"""

from __future__ import annotations

import re

# C0 controls, DEL, C1 controls, and the bidirectional overrides that can reorder what is shown.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_CONTROL_NO_NEWLINES = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object, *, keep_newlines: bool = False) -> str:
    """`text` as a string with every control character shown as an escape (`\\x1b`)."""
    pattern = _CONTROL if keep_newlines else _CONTROL_NO_NEWLINES
    return pattern.sub(_escape, str(text))
