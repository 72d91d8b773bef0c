"""`macaron daemon install|uninstall|status|run`: the nightly learning daemon.

`install` writes a systemd user service and timer (Linux) or a launchd agent (macOS) from the
templates in `packaging/` and enables it; `--dry-run` prints the files instead. `run` is what
the scheduler starts: at the lowest CPU and IO priority it checks its conditions and either
learns or says why not (`--now` skips the time window). `status` shows the schedule, the
conditions right now, recent runs and the log file.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from macaron_local.cli.common import load_settings, print_json
from macaron_local.daemon import service, units
from macaron_local.daemon.config import daemon_config
from macaron_local.errors import InvalidInputError, MacaronError


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("daemon", help="nightly learning: install the schedule, status, run now")
    actions = parser.add_subparsers(dest="daemon_command", metavar="ACTION", required=True)

    install = actions.add_parser("install", help="schedule nightly learning (systemd timer or launchd agent)")
    install.add_argument("--dry-run", action="store_true", help="print the files instead of installing them")
    install.add_argument("--platform", choices=units.PLATFORMS, help="render for this OS (with --dry-run)")
    install.add_argument("--no-enable", action="store_true", help="write the files but do not start the schedule")
    install.set_defaults(func=run_install)

    uninstall = actions.add_parser("uninstall", help="stop the schedule and remove its files")
    uninstall.set_defaults(func=run_uninstall)

    status = actions.add_parser("status", help="schedule, conditions now, recent runs, log file")
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=run_status)

    run = actions.add_parser("run", help="learn now if every condition holds, else say why not")
    run.add_argument("--now", action="store_true", help="skip the time window (the other conditions still apply)")
    run.add_argument("--json", action="store_true", help="print the outcome as JSON")
    run.set_defaults(func=run_run)


def run_install(args: argparse.Namespace) -> int:
    settings = load_settings()
    config = daemon_config(settings)
    platform = args.platform or units.current_platform()
    if args.platform and args.platform != units.current_platform() and not args.dry_run:
        raise InvalidInputError(f"--platform {args.platform} only previews files here; add --dry-run")
    files = units.render(settings, config, platform)
    if args.dry_run:
        for unit in files:
            print(f"# {unit.path}")
            print(unit.content.rstrip("\n"))
            print()
        return 0
    service.write_files(files)
    for unit in files:
        print(f"wrote {unit.path}")
    if not args.no_enable:
        service.enable(platform, files)
        print(f"scheduled: every {config.every_minutes} min between {config.window} (local time)")
    _warn_without_trainer()
    return 0


def _warn_without_trainer() -> None:
    from macaron_local.learn.backends import choose_backend

    try:
        choose_backend("auto")
    except MacaronError as exc:
        print(f"warning: {exc}", file=sys.stderr)


def run_uninstall(args: argparse.Namespace) -> int:
    platform = units.current_platform()
    notes = service.disable(platform) if service.installed_files(platform) else []
    removed = service.remove_files(platform)
    if removed:
        service.reload_after_removal(platform)
    for path in removed:
        print(f"removed {path}")
    if not removed:
        print("the learning daemon was not installed")
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return 0


def run_status(args: argparse.Namespace) -> int:
    from macaron_local.daemon.status import daemon_status
    from macaron_local.store import open_default_store

    settings = load_settings()
    with open_default_store(settings) as store:
        status = daemon_status(settings, store, conditions=True)
    if args.json:
        print_json(asdict(status))
        return 0
    if status.installed:
        print(f"schedule: installed ({status.schedule}): {', '.join(status.installed)}")
    else:
        print("schedule: not installed (run `macaron daemon install`)")
    if status.config_error:
        print(f"settings: {status.config_error}")
    else:
        print(f"window: {status.window} local time, a start every {status.every_minutes} min")
    print(f"running now: {'yes' if status.running else 'no'}")
    if status.conditions:
        print("conditions now:")
        for item in status.conditions:
            print(f"  [{'ok' if item.ok else 'no'}] {item.name}: {item.detail}")
    print("recent daemon runs:" if status.recent else "recent daemon runs: none yet")
    for past in status.recent:
        print(f"  {past.started_at.replace('T', ' ')}  {past.outcome}: {past.summary}")
    if status.learning_runs:
        print("learning runs:")
    for learned in status.learning_runs:
        version = f" {learned.adapter_version}" if learned.adapter_version else ""
        when = learned.started_at[:19].replace("T", " ")
        print(f"  {when}  {learned.slot} {learned.decision}{version}: {learned.reason}")
    print(f"log: {status.log_file}")
    return 0


def run_run(args: argparse.Namespace) -> int:
    from macaron_local.daemon.logs import daemon_logger
    from macaron_local.daemon.priority import current_priority, lowest_priority
    from macaron_local.daemon.runner import run_once

    settings = load_settings()
    try:
        low = daemon_config(settings).low_priority
    except InvalidInputError:
        low = True  # run_once records the bad settings in the log and history, then reports them
    priority = lowest_priority() if low else current_priority()
    daemon_logger(settings).info(
        "priority: nice %d, idle CPU class %s, idle IO class %s",
        priority.nice,
        priority.cpu_idle_class,
        priority.io_idle_class,
    )
    progress = None if args.json else (lambda line: print(line, flush=True))
    outcome = run_once(settings, skip_window=args.now, on_progress=progress)
    if args.json:
        print_json(asdict(outcome))
    return 0
