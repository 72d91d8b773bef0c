"""Nights that build on each other: several nights of real learning, each adding new scenarios'
corrections, and after each night every scenario seen so far scored with what is deployed.

Each NIGHT is a comma-separated list of scenario files (the format of bench/learning.py) whose
corrections the simulated user makes that day. After the night's real learning pass (exactly
`macaron learn`: `learn_once` with the settings' `[learn]` config), every scenario seen so far
is scored on its held-out prompts (greedy replies, routed and served as the chat serves them).

Output: {"learn": the settings given, "home": the store's folder, kept for bench/candidates.py,
"before": {name: share}, "nights": [{"scenarios": [names], "wall_s": s, "shares": {name: share},
"decisions": [per slot: decision, reason, candidates tried with their gate figures]}, ...]}.
Each night's decision also goes to stderr.

Target: two nights with different scenarios keep night 1's share within 0.1 of its value
after night 1; three scenarios taught on one night each reach >= 0.6.

Usage: python bench/nights.py --json [--learn steps=72] a.json,b.json c.json
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common import emit
from learning import checker, heldout_shares, learn_setting, load_scenario, scenario_checks, seed_feedback, served_stack

from macaron_local.daemon.config import learn_config
from macaron_local.errors import MacaronError
from macaron_local.learn.run import learn_once
from macaron_local.session import Session
from macaron_local.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("nights", nargs="+", metavar="NIGHT", help="comma-separated scenario files taught that day")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--learn", action="append", default=[], metavar="KEY=VALUE",
        help="a [learn] setting for every night (e.g. steps=72), as a user would set it; recorded in the output",
    )  # fmt: skip
    args = parser.parse_args(argv)
    nights = [[load_scenario(Path(p)) | {"_path": p} for p in night.split(",") if p] for night in args.nights]
    if not all(nights):
        raise SystemExit("error: every NIGHT names at least one scenario file")
    names = [s["name"] for night in nights for s in night]
    if len(set(names)) != len(names):
        raise SystemExit("error: scenario names must differ across nights")

    home = Path(tempfile.mkdtemp(prefix="macaron-nights-bench-"))
    settings = Settings.load(home)
    settings.ensure_dirs()
    overrides = dict(learn_setting(item) for item in args.learn)
    if overrides:
        settings.save(learn=overrides)
    try:
        config = learn_config(settings)
    except MacaronError as exc:  # an unknown or mistyped --learn setting: one line, no traceback
        raise SystemExit(f"error: {exc}") from None

    def shares(session: Session, scenarios: list[dict]) -> dict[str, float]:
        """Each of `scenarios`' held-out share under what `session` serves now."""
        return heldout_shares(session, served_stack(session), scenario_checks(scenarios))

    session = Session(settings, engine_config={"n_ctx": 2048})
    before = shares(session, [s for night in nights for s in night])
    report: dict = {"learn": overrides, "home": str(home), "before": before}  # home: bench/candidates.py reads it
    report["nights"] = []
    seen: list[dict] = []
    for night in nights:
        for scenario in night:
            seed_feedback(session, scenario, checker(scenario), ratings_only=False)
        seen.extend(night)
        started = time.perf_counter()
        reports = learn_once(session.store, session.catalog, session.manifest, config)
        wall = time.perf_counter() - started
        decisions = []
        for r in reports:
            print(f"night {len(report['nights']) + 1}: {r.slot} {r.decision}: {r.reason}", file=sys.stderr)
            figures = ("heldout_reward_after", "old_heldout_reward_after", "regression_nll_delta")
            figures += ("regression_qa_after", "regression_lost", "taught_tokens", "taught_drop")
            candidates = [
                {"name": c.get("name"), "passed": c.get("passed"), "reasons": c.get("reasons", [])}
                | {k: c.get(k) for k in figures}
                for c in (r.metrics or {}).get("candidates", [])
            ]
            decisions.append({"slot": r.slot, "decision": r.decision, "reason": r.reason, "candidates": candidates})
        session.close()
        session = Session(settings, engine_config={"n_ctx": 2048})  # serves what was deployed
        report["nights"].append(
            {
                "scenarios": [s["name"] for s in night],
                "wall_s": round(wall, 1),
                "shares": shares(session, seen),
                "decisions": decisions,
            }
        )
    session.close()
    return emit(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
