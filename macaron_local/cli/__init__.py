"""The `macaron` command: one module per command group, each a thin layer over the core.

Every user-caused failure is a MacaronError: it is printed as one line (`error: ...`) and the
process exits with the error's code (2 for bad input). No traceback reaches the user.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from macaron_local import __version__
from macaron_local.errors import MacaronError
from macaron_local.terminal import printable


class CommandParser(argparse.ArgumentParser):
    """argparse, with a usage error as one line like every other error: `error: ...` and the
    command's own help named, exit 2. Sub-command parsers are this class too (argparse builds
    them from the parent's type)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {printable(message)} (`{self.prog} --help` shows how)\n")


def build_parser() -> argparse.ArgumentParser:
    from macaron_local.cli import adapters, ask, auth, chat, daemon, doctor, forget, learn, logs, models, plugins, serve
    from macaron_local.cli import setup as learning_setup

    parser = CommandParser(
        prog="macaron",
        description="A personal AI agent that runs on your computer and learns from your corrections.",
    )
    parser.add_argument("--version", action="version", version=f"macaron-local {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (chat, ask, models, adapters, doctor, logs, forget, learn, daemon, auth, plugins, serve):
        module.register(commands)
    learning_setup.register(commands)
    parser.set_defaults(func=chat.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Local-first: huggingface_hub must not phone home; only an explicit pull touches the network.
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MacaronError as exc:
        print(f"error: {printable(exc)}", file=sys.stderr)  # file-borne names never drive the terminal
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
