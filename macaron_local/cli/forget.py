"""`macaron forget CONVERSATION`: delete a conversation and everything that learned from it.

Deleting the rows is not enough once a nightly run has trained on them: the adapter carries
what it learned. So every version that learned from it (and every version grown from one)
stops serving at once (each deployment rolls back to its newest untainted ancestor, or to the
bare expert), their adapter files are deleted, their runs are marked tainted (the registry
says why), and the next learning run retrains on the rest of the feedback without it.
"""

from __future__ import annotations

import argparse

from macaron_local.cli.common import load_settings, print_json
from macaron_local.store import open_default_store


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("forget", help="delete a conversation and every learned version that knew it")
    parser.add_argument("conversation", help="the conversation's full id (see `macaron logs list`)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # The full id only, no prefix matching: deleting the wrong conversation cannot be undone.
    with open_default_store(load_settings()) as store:
        result = store.forget(args.conversation)
    if args.json:
        print_json({**vars(result), "summary": result.summary()})
        return 0
    print(result.summary())
    if result.tainted_runs:  # the details, for the curious: which runs and versions
        print(f"tainted learning runs: {', '.join(result.tainted_runs)}")
    if result.adapter_versions:
        print(f"removed versions: {', '.join(result.adapter_versions)}")
    return 0
