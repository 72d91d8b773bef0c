"""Experience that teaches, on the embedded model: after trajectories in which the user denied
one kind of call (deleting files with `run_command`), the nightly run's candidate gives that
call less probability on held-out requests than the model did, and the gate records the run.

The trajectories are stored as the agent stores them: the request, the reply that made the
call, the -1 rating the denial earned (`tools.agent.experience`), the tool message saying it
was not run, and the expert's text answer after it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from macaron_local.catalog import Catalog  # noqa: E402
from macaron_local.engine import Engine, EngineConfig  # noqa: E402
from macaron_local.learn.gate import MIN_HELDOUT_GAIN  # noqa: E402
from macaron_local.learn.loop import LearnConfig  # noqa: E402
from macaron_local.learn.run import learn_once  # noqa: E402
from macaron_local.store import open_default_store  # noqa: E402
from macaron_local.tools.agent import ToolStep, experience  # noqa: E402

pytestmark = pytest.mark.slow
SYSTEM = "You are a helpful assistant."
FILES = ["old", "notes", "draft", "backup", "cache", "log", "temp", "report", "list", "data", "copy", "trash"]
HELD_OUT = ["junk", "photos", "music", "budget"]


def call_text(name: str) -> str:
    arguments = {"command": f"rm {name}.txt"}
    return "<tool_call>\n" + json.dumps({"name": "run_command", "arguments": arguments}) + "\n</tool_call>"


def request(name: str) -> str:
    return f"Please delete the file {name}.txt."


def call_logprob(engine: Engine, name: str) -> float:
    """log p(the delete call | the request), as the chat template renders the turn."""
    prompt = engine.render_tokens([{"role": "system", "content": SYSTEM}, {"role": "user", "content": request(name)}])
    completion = engine.tokenize(call_text(name), special=False)
    return float(engine.token_logprobs(prompt, completion).sum())


def test_denied_calls_teach_the_candidate_to_propose_them_less(home):
    catalog = Catalog(home)
    manifest = catalog.get(home.get("model"))
    with open_default_store(home) as store:
        for name in FILES:
            conversation = store.new_conversation(manifest.name, SYSTEM)
            asked = store.add_message(conversation, "user", request(name))
            call, _ = store.add_reply(conversation, asked, call_text(name), {"model": manifest.name, "expert": "L1"})
            step = ToolStep("run_command", {"command": f"rm {name}.txt"}, "denied", "denied",
                            "run_command was not run: the user denied it.", 0.1, call)  # fmt: skip
            value, comment = experience([step])
            store.add_feedback(call, "rating", value=value, text=comment)
            result = store.add_message(conversation, "tool", step.result, call)
            store.set_turn_tool_calls(call, [step.record() | {"result_message_id": result}])
            store.add_reply(conversation, result, "I did not delete it.", {"model": manifest.name, "expert": "L1"})
        config = LearnConfig(steps=12, lr=2e-3, max_new_tokens=32, refresh_every=4, backoff_s=0.0, backend="torch")
        [night] = learn_once(store, catalog, manifest, config)
        version = store.adapter_version(night.version_id)
        [run] = store.learning_runs()

    base_path = catalog.base_path(manifest)
    with Engine(EngineConfig(model_path=base_path, n_ctx=1024)) as engine:
        before = np.array([call_logprob(engine, name) for name in HELD_OUT])
        engine.set_adapters([engine.load_adapter(Path(version.path))])
        after = np.array([call_logprob(engine, name) for name in HELD_OUT])
    assert value == -1 and comment.startswith("tool call run_command denied")
    assert (after < before).all() and (before - after).mean() > 1.0, (before, after)  # nats, per call
    # The gate judged the candidate on held-out denials and recorded what it saw. Which 2 or 3
    # conversations are held out follows their (random) ids, and on so few greedy replies the
    # reward moved either way by hundredths across CI runs (-0.184 -> -0.191 once): the decision
    # must follow the recorded figures, the teaching is the log-probability measured above.
    assert run.decision == night.decision and run.metrics["heldout_episodes"] >= 2
    before_reward, after_reward = run.metrics["heldout_reward_before"], run.metrics["heldout_reward_after"]
    if run.decision == "deployed":
        assert after_reward >= before_reward + MIN_HELDOUT_GAIN - 1e-3  # figures rounded to 4 places
    else:
        assert run.reason and run.metrics["candidates"][0]["reasons"]
