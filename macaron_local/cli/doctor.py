"""`macaron doctor`: report the model, adapters, backend, paths and versions, and the learning
section (trainer, schedule, next window, feedback waiting); exit 1 on a problem.

`--json` prints {"checks": [...], "learning": {...}}.
"""

from __future__ import annotations

import argparse

from macaron_local.cli.common import add_model_option, load_settings, print_json
from macaron_local.doctor import learning_lines, learning_section, run_checks
from macaron_local.terminal import printable


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("doctor", help="check that everything needed is here and sound")
    parser.add_argument("--load", action="store_true", help="also load the model and generate a few tokens")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    add_model_option(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = load_settings(readonly=not args.load)
    checks = run_checks(settings, model=args.model, load=args.load)
    learning = learning_section(settings)  # reported, never a failure: learning is the user's choice
    if args.json:
        print_json({"checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in checks], "learning": learning})
    else:
        width = max(len(c.name) for c in checks)
        for check in checks:
            mark = "ok  " if check.ok else "FAIL"
            print(printable(f"{mark} {check.name:<{width}}  {check.detail}"))
        print(printable("\n".join(learning_lines(learning)), keep_newlines=True))  # the section spans lines
    return 0 if all(c.ok for c in checks) else 1
