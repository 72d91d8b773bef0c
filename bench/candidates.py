"""Every candidate of a store's latest learning run, served on scenarios' held-out prompts.

Each share is that of a scenario's held-out prompts whose greedy reply passes its check, as
`bench/nights.py` scores what it deployed.

A night deploys one candidate after judging a few. Whether a lesson that missed was in another
candidate (the choice to mend) or in none (the training to mend) takes them all served. Run the
night with the back-off told to judge everything, so every checkpoint is exported and registered
(no patience, a budget it never reaches, a margin that always looks past the first candidate):

    python bench/nights.py --json --learn backoff_s=3000 --learn backoff_patience=0 \
        --learn overfit_margin=-100 a.json,b.json,c.json          # its output names its "home"
    python bench/candidates.py --json --home HOME a.json b.json c.json

Output: {"home", "run", "chosen", "bare": {name: share}, "candidates": [{"name", "status",
"passed", "regression_qa_after", "shares": {name: share}}, ...]}, candidates in the order the
night judged them. The reference is the bare experts (no personal adapter), served in the same run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import emit, macaron_home
from learning import bare_stack, heldout_shares, load_scenario, scenario_checks

from macaron_local.errors import MacaronError
from macaron_local.session import Session
from macaron_local.settings import Settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenarios", nargs="+", metavar="SCENARIO", help="scenario files to serve each candidate on")
    parser.add_argument("--home", required=True, help="the MACARON_HOME of the run (bench/nights.py prints it)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    scenarios = [load_scenario(Path(p), corrections=False) for p in args.scenarios]
    home = macaron_home(args.home)
    try:
        session = Session(Settings.load(home), engine_config={"n_ctx": 2048})
    except MacaronError as exc:
        raise SystemExit(f"error: {exc}") from None
    try:
        runs = session.store.learning_runs()
        if not runs:
            raise SystemExit(f"error: {home} holds no learning run")
        run = runs[-1]
        versions = session.store.adapter_versions(learning_run_id=run.id)

        checks = scenario_checks(scenarios)

        def shares(stack) -> dict[str, float]:
            return heldout_shares(session, stack, checks)

        result = {"home": str(home), "run": run.id, "chosen": run.metrics.get("chosen")}
        result["bare"] = shares(bare_stack(session))
        served = []
        for version in versions:
            candidate = version.evaluations.get("candidate", {})
            handle = session.engine.load_adapter(Path(version.path))
            served.append(
                {
                    "name": candidate.get("name"),
                    "status": version.status,
                    "passed": candidate.get("passed"),
                    "regression_qa_after": candidate.get("regression_qa_after"),
                    "shares": shares(bare_stack(session, handle)),
                }
            )
        result["candidates"] = served
    finally:
        session.close()
    return emit(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
