"""Does a night's cost follow its new feedback, not all history? The real learning pass
(`learn_once`, the settings' config) timed with 50 and with 500 stored corrections, 10 of them
new each time, in the same run, on the same model.

History is seeded straight into the store: conversations whose reply ("Sure.") the user
corrected (the scenario's corrections, cycled and numbered), and one recorded earlier night
that learned the old ones (deployed, with a quarter of them held out), so the pass under test
sees 40 or 490 learned corrections and 10 new ones. What is timed is the whole pass: reading
the store, planning (new, replay, held-out windows), training, export, parity, the gate.

Output: wall_s for each size, their ratio (the target: under 2), and each pass's plan figures.

Usage: python bench/learning_scale.py --scenario ../shared/scenarios/tldr.json --json
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from common import emit
from learning import load_scenario

from macaron_local.catalog import Catalog
from macaron_local.daemon.config import learn_config
from macaron_local.learn.personal import PERSONAL_SLOT
from macaron_local.learn.plan import split_new
from macaron_local.learn.run import learn_once
from macaron_local.settings import Settings
from macaron_local.store import open_default_store

NEW = 10


def seed(store, scenario: dict, model: str, first: int, n: int) -> list[tuple[str, int]]:
    """n corrected conversations; returns (conversation id, feedback id) pairs."""
    made = []
    train = scenario["train"]
    for i in range(first, first + n):
        item = train[i % len(train)]
        conversation = store.new_conversation(model, "You are a helpful assistant.")
        question = store.add_message(conversation, "user", f"{item['prompt']} (#{i})")
        reply, _ = store.add_reply(conversation, question, "Sure.", {"model": model, "expert": "L0"})
        made.append((conversation, store.add_feedback(reply, "correction", text=item["correction"])))
    return made


def one_pass(scenario: dict, stored: int, steps: int | None, threads: int | None) -> dict:
    home = Path(tempfile.mkdtemp(prefix="macaron-scale-bench-"))
    settings = Settings.load(home)
    settings.ensure_dirs()
    if threads:
        settings.save(n_threads=threads)
    config = learn_config(settings)
    if steps:
        config = dataclasses.replace(config, steps=steps)
    catalog = Catalog(settings)
    manifest = catalog.default()
    with open_default_store(settings) as store:
        old = seed(store, scenario, manifest.name, 0, stored - NEW)
        held = split_new([c for c, _ in old])
        store.record_learning_run(
            slot=PERSONAL_SLOT,
            status="done",
            feedback_ids=[f for _, f in old],
            decision="deployed",
            reason="seeded history",
            metrics={"heldout_conversations": sorted(held)},
        )
        seed(store, scenario, manifest.name, stored - NEW, NEW)
        started = time.perf_counter()
        [report] = learn_once(store, catalog, manifest, config)
        wall = time.perf_counter() - started
    keys = ("new_episodes", "replay_episodes", "heldout_episodes", "old_heldout_episodes")
    keys += ("steps", "train_s", "judge_s")
    return {"stored": stored, "wall_s": round(wall, 1), "decision": report.decision} | {
        k: report.metrics.get(k) for k in keys
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scenario", type=Path, required=True)
    parser.add_argument("--steps", type=int, help="override the settings' [learn] steps (both passes)")
    parser.add_argument("--threads", type=int, help="llama.cpp threads (the n_threads setting)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    scenario = load_scenario(args.scenario)
    small = one_pass(scenario, 50, args.steps, args.threads)
    large = one_pass(scenario, 500, args.steps, args.threads)
    return emit(
        {
            "reference": "the same pass with 50 stored corrections, 10 new, measured in this run",
            "small": small,
            "large": large,
            "ratio": round(large["wall_s"] / small["wall_s"], 3),
        },
        args.json,
    )


if __name__ == "__main__":
    sys.exit(main())
