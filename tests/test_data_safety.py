"""kill -9 in the middle of a generation, 20 times: the store stays intact and no feedback that
was recorded before a kill is missing.

The child process drives the same session API the app uses: it keeps generating long replies
and, while each one streams, rates and corrects the previous reply, printing every feedback id
once its transaction has returned. The parent kills it at a random moment.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

from macaron_local.settings import Settings
from macaron_local.store import open_default_store

DRIVER = textwrap.dedent(
    """
    import sys
    from macaron_local.engine import GenerationParams
    from macaron_local.session import Session
    session = Session()
    session.load()
    previous = None
    recent = session.list_conversations(limit=1)
    if recent:  # carry on where the killed run stopped, as the app does
        session.open_conversation(recent[0].id)
        replies = [m.id for m in session.store.path(session.leaf_id) if m.role == "assistant"]
        previous = replies[-1] if replies else None
    print("ready", flush=True)
    for i in range(1000):
        reply = session.send(f"Tell me a long story about robot number {i}.",
                             params=GenerationParams(max_tokens=60, repeat_penalty=1.1))
        if previous is not None:  # the reply is about to stream: prefill and decode follow
            print(f"feedback {session.rate(previous, 1, 'before')}", flush=True)
        for j, _ in enumerate(reply):
            if previous is not None and j in (1, 4):
                if j == 1:
                    fid = session.rate(previous, 1 if i % 2 else -1, "ok")
                else:
                    fid = session.store.add_feedback(previous, "correction", text=f"better story {i}")
                print(f"feedback {fid}", flush=True)
        previous = reply.message_id
    """
)


def test_kill_9_during_generation_loses_no_feedback(home):
    rng = random.Random(1234)
    env = {**os.environ, "MACARON_HOME": str(home.data_dir.parent)}
    recorded: set[int] = set()
    kills = 0
    # One answered turn to carry on from: every child rates it as soon as its own reply starts,
    # even one killed during its first turn's route hop (the protocol's hops come first).
    with open_default_store(Settings.load(home.data_dir.parent)) as store:
        conversation = store.new_conversation("embedded", "You are a helpful assistant.")
        question = store.add_message(conversation, "user", "Tell me a story.")
        store.add_reply(conversation, question, "Once upon a time.", {"model": "embedded", "expert": "L0"})
    for _ in range(20):
        child = subprocess.Popen(
            [sys.executable, "-c", DRIVER], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
        )
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        # Its first reply is streaming once it rates the turn before (the route hop's time varies
        # with the machine); then the kill lands at a random point of the generation that follows.
        lines: list[str] = [child.stdout.readline()]
        reader = threading.Thread(target=lines.extend, args=(child.stdout,), daemon=True)
        reader.start()
        time.sleep(rng.uniform(0.0, 2.5))
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        reader.join(timeout=10)
        kills += child.returncode == -signal.SIGKILL
        recorded |= {int(line.split()[1]) for line in lines if line.startswith("feedback ")}

    assert kills == 20
    with open_default_store(Settings.load(home.data_dir.parent)) as store:
        assert store.integrity_check() == "ok"
        stored = {item.feedback.id for item in store.feedback_rows()}
        conversations = store.list_conversations(limit=100)
    assert recorded, "the children must have recorded feedback before being killed"
    assert recorded <= stored
    assert 1 <= len(conversations) <= 20
    print(f"\n20 kills, {len(recorded)} feedback rows recorded before a kill, all present")
