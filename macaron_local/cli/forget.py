"""`macaron forget CONVERSATION`: delete a conversation and mark what learned from it.

Deleting the rows is not enough once a nightly run has trained on them: the adapter still
carries what it learned. So this reports the learning runs and adapter versions now marked
tainted, for the learner to retrain without them.
"""

from __future__ import annotations

import argparse

from macaron_local.cli.common import load_settings, print_json
from macaron_local.store import open_default_store


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("forget", help="delete a conversation and taint what learned from it")
    parser.add_argument("conversation", help="the conversation's full id (see `macaron logs list`)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # The full id only, no prefix matching: deleting the wrong conversation cannot be undone.
    with open_default_store(load_settings()) as store:
        result = store.forget(args.conversation)
    if args.json:
        print_json(vars(result))
        return 0
    counts = f"{result.messages} messages, {result.feedback} feedback entries"
    print(f"forgot conversation {result.conversation_id}: {counts}")
    if not result.tainted_runs:
        print("no learning run had learned from it")
        return 0
    print(f"marked {len(result.tainted_runs)} learning run(s) tainted: {', '.join(result.tainted_runs)}")
    if result.adapter_versions:
        print(f"adapter versions to retrain or drop: {', '.join(result.adapter_versions)}")
    return 0
