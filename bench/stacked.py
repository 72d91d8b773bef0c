"""Lessons learned on separate nights' homes, served alone and stacked on one expert.

A night of three lessons trains one adapter on all of them, and a fact applied to advice has
missed beside two other lessons where alone it forms. Whether separate adapters, one per
lesson, would keep each lesson is cheap to ask before building it: llama.cpp serves several
LoRAs at once and adds their deltas, so stacking the adapters that single-lesson nights deployed
serves exactly the sum a per-lesson learner would merge (at `--scales`, each adapter's weight).

    python bench/learning.py --scenario a.json --json      # once per lesson; note each "home"
    python bench/stacked.py --json --home HOME_A --home HOME_B a.json b.json

Output: {"homes", "bare", "alone": [...], "stacked": {scale: ...}}, each entry {"shares": {name:
share}, "regression_qa", "regression_nll"}: a scenario's share is that of its held-out prompts
whose greedy reply passes its check, and the factual answers and passage NLL are the gate's
regression set, all served as the chat serves a turn. The reference is the bare experts, served in
the same run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import emit, macaron_home
from learning import bare_stack, heldout_shares, load_scenario, scenario_checks

from macaron_local.catalog import Catalog
from macaron_local.errors import MacaronError
from macaron_local.learn.personal import PERSONAL_SLOT
from macaron_local.learn.regression import score as regression_score
from macaron_local.learn.run import serve_params
from macaron_local.session import Session
from macaron_local.settings import Settings
from macaron_local.store import open_default_store


def deployed_adapter(home: Path) -> Path:
    """The personal adapter a home serves its default model now (the registry's deployment
    of that slot, as the session looks it up), read without loading a model."""
    settings = Settings.load(macaron_home(home))
    try:
        store = open_default_store(settings, readonly=True)
        try:
            deployed = store.deployed_adapter(PERSONAL_SLOT, Catalog(settings).default().name)
        finally:
            store.close()
    except MacaronError as exc:
        raise SystemExit(f"error: {exc}") from None
    if deployed is None:
        raise SystemExit(f"error: {home} has deployed no personal adapter")
    return Path(deployed.path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenarios", nargs="+", metavar="SCENARIO", help="scenario files to serve on")
    parser.add_argument("--home", action="append", required=True, help="a home whose deployed adapter to stack")
    parser.add_argument("--scales", default="1.0", help="comma-separated weights for the stacked adapters")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        scales = [float(s) for s in args.scales.split(",")]
    except ValueError:
        raise SystemExit(f"error: --scales {args.scales!r} is not a list of numbers") from None
    scenarios = [load_scenario(Path(p), corrections=False) for p in args.scenarios]
    homes = [Path(h) for h in args.home]
    adapters = [deployed_adapter(h) for h in homes]
    checks = scenario_checks(scenarios)

    session = Session(Settings.load(homes[0]), engine_config={"n_ctx": 2048})
    try:
        handles = [session.engine.load_adapter(path) for path in adapters]
        params = serve_params(session.catalog)

        def served(extra: list) -> dict:
            experts = bare_stack(session)
            stack = lambda slot: [*experts(slot), *extra]  # noqa: E731
            regression = regression_score(session.engine, stack, session.system_prompt, params)
            return {
                "shares": heldout_shares(session, stack, checks),
                "regression_qa": regression.qa_right,
                "regression_nll": round(regression.passage_nll, 4),
            }

        result = {"homes": [str(h) for h in homes], "bare": served([])}
        result["alone"] = [served([handle]) for handle in handles]
        result["stacked"] = {str(scale): served([(h, scale) for h in handles]) for scale in scales}
    finally:
        session.close()
    return emit(result, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
