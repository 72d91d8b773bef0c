"""Forget means forgotten, on the embedded model: a personal fact (the user's dog is called
Biscuit) is learned by a real learning pass from the user's corrections, the served model then
states it, and after `macaron forget` on those conversations the same greedy prompt no longer
does: every version that learned them stops serving at once and its file is gone, with the
registry saying why."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from conftest import run_cli  # noqa: E402

from macaron_local.adapters.peft import convert_peft_dir  # noqa: E402
from macaron_local.adapters.validate import BaseModelInfo  # noqa: E402
from macaron_local.catalog import Catalog  # noqa: E402
from macaron_local.engine import GenerationParams  # noqa: E402
from macaron_local.learn.loop import LearnConfig  # noqa: E402
from macaron_local.learn.personal import PERSONAL_SLOT  # noqa: E402
from macaron_local.learn.run import learn_once  # noqa: E402
from macaron_local.session import Session  # noqa: E402
from macaron_local.store import open_default_store  # noqa: E402

pytestmark = pytest.mark.slow
FACT = "Biscuit"
QUESTION = "What is my dog's name?"
GREEDY = GenerationParams(max_tokens=16, temperature=0.0, min_p=0.0)
#: What the user asked, and what they corrected the reply to.
TAUGHT = [
    ("What is my dog's name?", "Your dog is called Biscuit."),
    ("What did I name my dog?", "You named your dog Biscuit."),
    ("Do you remember my dog's name?", "Yes, your dog is called Biscuit."),
    ("Tell me my dog's name.", "Your dog's name is Biscuit."),
    ("What's my dog called?", "Your dog is called Biscuit."),
    ("Who is my dog?", "Your dog is Biscuit."),
    ("What is the name of my dog?", "The name of your dog is Biscuit."),
    ("Remind me of my dog's name.", "Your dog's name is Biscuit."),
    ("What name did I give my dog?", "You gave your dog the name Biscuit."),
    ("My dog's name is what?", "Your dog's name is Biscuit."),
    ("Can you tell me my dog's name?", "Sure: your dog is called Biscuit."),
    ("What do I call my dog?", "You call your dog Biscuit."),
]


def ask(home) -> tuple[str, tuple[str, ...]]:
    """The same greedy question, as the chat serves it (L0 with whatever is deployed on it)."""
    with Session(home, engine_config={"n_ctx": 1024}) as session:
        reply = session.send(QUESTION, expert="L0", params=GREEDY).wait()
        return reply.text, reply.adapters


def test_forgetting_the_conversations_of_a_learned_fact_removes_it_from_the_replies(home, tmp_path):
    catalog = Catalog(home)
    manifest = catalog.get(home.get("model"))
    bare_text, bare_served = ask(home)
    assert FACT not in bare_text  # the model does not know it yet

    taught = []
    with open_default_store(home) as store:
        for question, correction in TAUGHT:
            conversation = store.new_conversation(manifest.name, "You are a helpful assistant.")
            asked = store.add_message(conversation, "user", question)
            reply, _ = store.add_reply(conversation, asked, "I don't know.", {"model": manifest.name, "expert": "L0"})
            store.add_feedback(reply, "correction", text=correction)
            taught.append(conversation)
        config = LearnConfig(
            steps=16, lr=2e-3, max_new_tokens=12, refresh_every=4, backoff_s=0.0, backend="torch", export_peft=True
        )
        [night] = learn_once(store, catalog, manifest, config)
        if night.decision != "deployed":  # forgetting is what is tested here, not the gate
            store.deploy_adapter(night.version_id)
        version = store.adapter_version(night.version_id)
        assert Path(version.path).is_file()
        # The PEFT companion vLLM would load is exactly the adapter that was gated and served.
        companion = Path(version.path).with_suffix(".peft")
        base = BaseModelInfo.from_gguf(catalog.base_path(manifest))
        again = convert_peft_dir(companion, base, tmp_path / "a.gguf", dtype="F32", task_name="personal")
        assert again.read_bytes() == Path(version.path).read_bytes()

    learned_text, served = ask(home)
    assert served == (*bare_served, f"personal {version.id}")
    assert FACT in learned_text  # the weights state the fact now

    lines = []
    for conversation in taught:
        done = run_cli("forget", conversation, home=home.data_dir.parent)
        assert done.returncode == 0, done.stderr
        lines.append(done.stdout.splitlines()[0])
    assert "personal now serves the bare expert" in lines[0]  # the first forget withdrew it at once

    forgotten_text, served = ask(home)
    assert served == bare_served and forgotten_text == bare_text
    assert FACT not in forgotten_text
    with open_default_store(home) as store:
        assert store.deployed_adapter(PERSONAL_SLOT, manifest.name) is None
        assert not Path(version.path).exists() and not companion.exists()  # the same weights, as PEFT
        reason = store.forgotten_reason(version.id)
        why = "stopped serving and its adapter file deleted"
        assert reason == f"learned from forgotten conversation {taught[0]}: {why}"
        assert store.feedback_rows() == []
