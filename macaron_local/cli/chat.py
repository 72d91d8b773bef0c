"""`macaron` / `macaron chat`: an interactive conversation in the terminal.

This line-mode loop is the fallback front end; it uses the same session API as every other.
"""

from __future__ import annotations

import argparse
import sys

from macaron_local.cli.common import add_model_option, load_settings
from macaron_local.cli.setup import interactive_setup
from macaron_local.learning_setup.choice import current_choice
from macaron_local.session import Session


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("chat", help="chat in the terminal (the default command)")
    add_model_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = load_settings()
    if sys.stdin.isatty() and sys.stdout.isatty() and current_choice(settings) is None:
        interactive_setup(settings)  # the first run in a terminal asks about learning, once
    with Session(settings, model=getattr(args, "model", None)) as session:
        print(f"macaron-local on {session.manifest.name} ({session.manifest.description})")
        print("Type a message; /new starts a new chat; /quit or Ctrl-D leaves.")
        session.engine  # load now, so the first reply is not slowed by loading  # noqa: B018
        while True:
            try:
                text = input("> ")
            except EOFError:
                print()
                return 0
            if text.strip() in ("/quit", "/exit"):
                return 0
            if text.strip() == "/new":
                session.new_conversation()
                continue
            if not text.strip():
                continue
            reply = session.send(text)
            try:
                for chunk in reply:
                    sys.stdout.write(chunk)
                    sys.stdout.flush()
            except KeyboardInterrupt:
                reply.generation.close()
            print(f"\n  [{reply.route.slot} {reply.route.expert_name}]")
