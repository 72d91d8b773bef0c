"""`macaron learn`: what a learning run would train on (`--dry-run`).

The full nightly run (train, export, parity, gate, deploy) is being built; until it lands,
`macaron learn` without `--dry-run` says so and exits 1 instead of pretending to learn.
"""

from __future__ import annotations

import argparse

from macaron_local.cli.common import load_settings, print_json
from macaron_local.errors import MacaronError
from macaron_local.learn.episodes import episodes_from_store
from macaron_local.store import open_default_store


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("learn", help="learn from your corrections (--dry-run: show what it would use)")
    parser.add_argument("--dry-run", action="store_true", help="list the episodes a run would train on")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--since", type=int, default=0, help="only feedback with a larger id")
    parser.set_defaults(func=run)


def _clip(text: str | None, width: int = 60) -> str:
    if text is None:
        return "-"
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def run(args: argparse.Namespace) -> int:
    if not args.dry_run:
        raise MacaronError(
            "the learning run is not available yet in this version; `macaron learn --dry-run` shows its data"
        )
    with open_default_store(load_settings()) as store:
        episodes = episodes_from_store(store, since_id=args.since)
    if args.json:
        print_json(
            [
                {
                    "slot": e.slot,
                    "prompt": e.messages[-1]["content"] if e.messages else "",
                    "chosen": e.chosen,
                    "rejected": e.rejected,
                    "weight": e.weight,
                    "feedback_ids": e.feedback_ids,
                    "conversation_id": e.conversation_id,
                }
                for e in episodes
            ]
        )
        return 0
    if not episodes:
        print("nothing to learn from yet: correct, rate or regenerate some replies first")
        return 0
    by_slot: dict[str, int] = {}
    for episode in episodes:
        by_slot[episode.slot] = by_slot.get(episode.slot, 0) + 1
    summary = ", ".join(f"{slot}: {count}" for slot, count in sorted(by_slot.items()))
    print(f"{len(episodes)} episode(s) would be used ({summary})")
    for episode in episodes:
        prompt = episode.messages[-1]["content"] if episode.messages else ""
        print(f"- [{episode.slot}] {_clip(prompt, 40)}")
        print(f"    chosen:   {_clip(episode.chosen)}")
        print(f"    rejected: {_clip(episode.rejected)}")
    return 0
