"""`macaron learn`: one learning run now (`--dry-run`: what it would train on).

The run happens in this process, at the lowest CPU and IO priority, so a chat open in the app
(another process) keeps its speed. Learning paused in the settings means no run.
"""

from __future__ import annotations

import argparse

from macaron_local.cli.common import add_model_option, load_settings, print_json
from macaron_local.cli.progress import ProgressBar
from macaron_local.errors import MacaronError
from macaron_local.learn.backends import BACKENDS, choose_backend
from macaron_local.learn.episodes import episodes_from_store
from macaron_local.store import open_default_store


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("learn", help="learn from your corrections (--dry-run: show what it would use)")
    parser.add_argument("--dry-run", action="store_true", help="list the episodes a run would train on")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--since", type=int, default=0, help="only feedback with a larger id")
    parser.add_argument("--steps", type=int, help="at most this many training steps (default: settings [learn])")
    parser.add_argument("--slot", action="append", help="only feedback on these experts' turns (L0..L3); repeatable")
    parser.add_argument("--force", action="store_true", help="run even if learning is paused")
    parser.add_argument("--backend", choices=BACKENDS, help="trainer: torch, mlx or auto (default: settings)")
    add_model_option(parser)
    parser.set_defaults(func=run)


def _clip(text: str | None, width: int = 60) -> str:
    if text is None:
        return "-"
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def run(args: argparse.Namespace) -> int:
    if not args.dry_run:
        return run_learning(args)
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
                    "also_rejected": list(e.also_rejected),
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
        for sibling in episode.also_rejected:
            print(f"    also:     {_clip(sibling)}")
    return 0


def lowest_priority() -> None:
    """Nice 19 and idle IO class (Linux), so learning never slows anything the user does."""
    import contextlib
    import os

    with contextlib.suppress(OSError, AttributeError):
        os.nice(19)
    with contextlib.suppress(Exception):
        import psutil

        psutil.Process().ionice(psutil.IOPRIO_CLASS_IDLE)


def run_learning(args: argparse.Namespace) -> int:
    import dataclasses

    from macaron_local.catalog import Catalog
    from macaron_local.daemon.config import learn_config
    from macaron_local.learn.run import learn_once
    from macaron_local.router import normalize_slot

    settings = load_settings()
    if settings.get("learning_paused") and not args.force:
        raise MacaronError("learning is paused (resume it in the app's learning panel, or pass --force)")
    lowest_priority()
    catalog = Catalog(settings)
    manifest = catalog.get(args.model) if args.model else catalog.default()
    slots = [normalize_slot(s) for s in args.slot] if args.slot else None
    config = learn_config(settings)  # the same [learn] settings the nightly daemon uses
    backend = args.backend or config.backend
    config = dataclasses.replace(config, steps=args.steps or config.steps, backend=choose_backend(backend))
    bar = ProgressBar(config.steps, label=f"learning ({config.backend})")

    def progress(log) -> None:
        bar.total = log.total or bar.total
        bar.update(log.step + 1, f"loss {log.loss:.3f}  kl {log.kl:.3f}  reward {log.reward_mean:+.3f}")
        if log.step + 1 == bar.total:
            bar.finish()
            print("evaluating the candidate against the deployed version...", flush=True)

    def notice(line: str) -> None:
        bar.finish()  # a notice mid-run (training stopped early) starts on its own line
        print(f"note: {line}", flush=True)

    with open_default_store(settings) as store:
        try:
            reports = learn_once(store, catalog, manifest, config, slots, on_step=progress, on_notice=notice)
        finally:
            bar.finish()
    if not reports:
        print("nothing to learn from yet: correct, rate or regenerate some replies first")
    for report in reports:
        version = f" as {report.version_id}" if report.version_id else ""
        print(f"{report.slot}: {report.decision}{version}: {report.reason}")
    return 0
