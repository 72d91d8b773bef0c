"""The `macaron` entry point: the chat app for `macaron` / `macaron chat`, the CLI otherwise.

It lives in the UI package so that the core (`macaron_local`) never imports the UI: the core's
CLI knows nothing of Textual, and this thin dispatcher decides which front end runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from macaron_local.cli import main as cli_main

TUI_FLAGS = {"--model", "-m"}


def wants_tui(argv: Sequence[str]) -> bool:
    """`macaron`, `macaron chat` and `macaron [chat] --model NAME` open the app; `--plain`
    (or no terminal) keeps the line-mode chat."""
    args = list(argv)
    if args and args[0] == "chat":
        args = args[1:]
    if "--plain" in args or not sys.stdout.isatty() or not sys.stdin.isatty():
        return False
    while args and args[0] in TUI_FLAGS and len(args) >= 2:
        args = args[2:]
    return not args


def model_option(argv: Sequence[str]) -> str | None:
    for flag in TUI_FLAGS:
        if flag in argv and argv.index(flag) + 1 < len(argv):
            return argv[argv.index(flag) + 1]
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not wants_tui(argv):
        return cli_main([a for a in argv if a != "--plain"] or ["chat"])
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from macaron_local.errors import MacaronError
    from macaron_local.settings import Settings
    from macaron_ui.app import MacaronApp

    try:
        settings = Settings.load()
        settings.ensure_dirs()
    except MacaronError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    MacaronApp(settings, model=model_option(argv)).run()
    return 0
