"""A progress bar for long commands: redrawn in place on a terminal, one line per update when the
output goes to a file or a pipe (logs stay readable)."""

from __future__ import annotations

import sys
from typing import TextIO


class ProgressBar:
    def __init__(self, total: int, label: str = "", stream: TextIO | None = None, width: int = 24) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.interactive = self.stream.isatty()
        self._drawn = False

    def render(self, done: int, detail: str = "") -> str:
        filled = round(self.width * min(done, self.total) / self.total)
        bar = "█" * filled + "░" * (self.width - filled)
        return f"{self.label} {bar} {done}/{self.total} {detail}".strip()

    def update(self, done: int, detail: str = "") -> None:
        line = self.render(done, detail)
        if self.interactive:
            self.stream.write("\r\x1b[2K" + line)
            self._drawn = True
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def finish(self) -> None:
        """End the bar's line, so what follows starts on its own."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
