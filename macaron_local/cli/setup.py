"""`macaron setup`: set nightly learning up, with consent, from a terminal.

It says what is missing and what setting up would do (the schedule, and the trainer with its
download size), asks, then installs the schedule and the trainer (pip, with a progress bar) into
this app's environment, or remembers "not now". The line-mode chat asks the same on its first
run in a terminal. `--yes` and `--decline` answer without asking; `--dry-run` shows the
schedule's files and installs nothing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from macaron_local.cli.common import load_settings
from macaron_local.cli.progress import ProgressBar
from macaron_local.errors import InvalidInputError
from macaron_local.learning_setup import LearningSetup
from macaron_local.learning_setup.install import InstallProgress
from macaron_local.settings import Settings
from macaron_local.store import open_default_store


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("setup", help="set up nightly learning: the schedule and a trainer")
    answer = parser.add_mutually_exclusive_group()
    answer.add_argument("--yes", "-y", action="store_true", help="set it up without asking")
    answer.add_argument("--decline", action="store_true", help='remember "not now" (reversible: run setup again)')
    parser.add_argument("--no-trainer", action="store_true", help="install the schedule only")
    parser.add_argument("--no-enable", action="store_true", help="write the schedule's files but do not start them")
    parser.add_argument("--dry-run", action="store_true", help="print the schedule's files; install nothing")
    parser.set_defaults(func=run)


def describe(setup: LearningSetup, store) -> list[str]:
    """What is here and what setting up would do, a line each."""
    status = setup.readiness(store)
    trainer = setup.trainer()
    lines = []
    if trainer.backend:
        lines.append(f"  trainer:  {trainer.label} is installed")
    else:
        lines.append(f"  trainer:  none installed. {setup.plan().summary()}")
    if status.schedule_installed:
        lines.append(f"  schedule: installed ({', '.join(status.schedule_files)})")
    else:
        lines.append(f"  schedule: not installed; setting up starts a nightly run in the window {status.window}")
    return lines


def ask(question: str, read: Callable[[str], str] = input) -> bool:
    try:
        return read(f"{question} [y/N] ").strip().lower() in ("y", "yes")
    except EOFError:
        return False


def interactive_setup(
    settings: Settings,
    setup: LearningSetup | None = None,
    read: Callable[[str], str] = input,
    with_trainer: bool = True,
) -> int:
    """Ask on a terminal and act on the answer (`macaron setup`, and the line-mode chat's first run)."""
    setup = setup or LearningSetup(settings)
    with open_default_store(settings) as store:
        print("macaron learns from your corrections each night, on this computer.")
        for line in describe(setup, store):
            print(line)
    if not ask("Set up learning now?", read):
        return decline(settings, setup)
    return accept(settings, setup, with_trainer)


def decline(settings: Settings, setup: LearningSetup) -> int:
    setup.decline()
    print("Not now: remembered. Set it up later with `macaron setup` or in the app's learning panel (Ctrl+L).")
    return 0


def accept(settings: Settings, setup: LearningSetup, with_trainer: bool = True, remember: bool = True) -> int:
    bar: ProgressBar | None = None
    shown = [-1]

    def progress(update: InstallProgress) -> None:
        nonlocal bar
        if bar is None:
            print(f"installing {setup.plan().summary()}", file=sys.stderr)
            bar = ProgressBar(max(update.total_bytes // 1_000_000, 1), "trainer (MB)")
        mb = update.done_bytes // 1_000_000
        if mb != shown[0]:
            shown[0] = mb
            bar.total = max(update.total_bytes // 1_000_000, 1)
            bar.update(mb, f"step {update.step}/{update.steps}")

    try:
        outcome = setup.accept(with_trainer=with_trainer, on_progress=progress, remember=remember)
    finally:
        if bar is not None:
            bar.finish()
    schedule = outcome.schedule
    print(schedule.message)
    if schedule.mode == "dry-run":
        for unit in schedule.files:
            print(f"# {unit.path}")
            print(unit.content.rstrip("\n"))
    if schedule.problem:
        print(f"warning: {schedule.problem}", file=sys.stderr)
    if outcome.installed_trainer:
        print(f"installed {outcome.trainer.label} into {setup.plan().prefix}")
    with open_default_store(settings) as store:
        print(setup.readiness(store).sentence())
    return 0


def run(args: argparse.Namespace) -> int:
    settings = load_settings()
    mode = "dry-run" if args.dry_run else "files" if args.no_enable else None
    setup = LearningSetup(settings, schedule_mode=mode)
    if args.decline:
        return decline(settings, setup)
    if args.dry_run:  # a preview: nothing installed, nothing remembered
        return accept(settings, setup, with_trainer=False, remember=False)
    if args.yes:
        return accept(settings, setup, with_trainer=not args.no_trainer)
    if not sys.stdin.isatty():
        raise InvalidInputError("macaron setup asks before installing anything: add --yes (or --decline)")
    return interactive_setup(settings, setup, with_trainer=not args.no_trainer)
