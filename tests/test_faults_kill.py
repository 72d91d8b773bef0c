"""Fault suite: kill -9 at random points of learning, export and deployment, 30 times.

A child process rates a reply, runs the real nightly pass on a tiny model (train -> export ->
parity -> gate -> register -> deploy or reject, `learn_once`), then exports (PEFT -> GGUF, as
learning does, or a fresh random LoRA), registers, deploys and now and then rolls back, in a
loop. Eight kills are aimed at the phases of the learning pass (it is slow on a busy machine);
22 land at random instants of the loop without the pass. After every kill:
- the store passes `PRAGMA integrity_check` and every feedback row the child saw committed is there;
- every registered version's file exists under its content hash (no half-written file is
  referenced), and the deployed version passes `validate_adapter` and loads in the engine;
and after the 30 kills, a learning pass runs to completion on the same store and a garbage
collection clears the half-written temporary files the kills left.

Importing torch takes seconds, so the children are forked from one process that imported
everything once (it never touches the store, a model or torch's thread pools before forking).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("peft")

from test_plugins import peft_dir  # noqa: E402

from macaron_local.adapters import BaseModelInfo, validate_adapter  # noqa: E402
from macaron_local.catalog import Catalog  # noqa: E402
from macaron_local.engine import Engine, EngineConfig  # noqa: E402
from macaron_local.hashing import sha256_file  # noqa: E402
from macaron_local.store import open_default_store  # noqa: E402
from macaron_local.store.adapter_files import CONTENT_NAME, TEMP_NAME  # noqa: E402

pytestmark = pytest.mark.faults

TRIALS = 30
TURN = {"model": "tiny", "expert": "L0", "route_method": "default"}

ZYGOTE = textwrap.dedent(
    """
    import json, os, random, sys
    from pathlib import Path
    import numpy as np
    import torch, transformers, peft  # noqa: F401  (the slow imports, paid once)
    import macaron_local.learn.backends.torch_backend  # noqa: F401
    import macaron_local.learn.run as run
    from macaron_local.adapters import BaseModelInfo, LoraAdapter, LoraPair, write_adapter
    from macaron_local.adapters.peft import convert_peft_dir
    from macaron_local.catalog import Catalog
    from macaron_local.learn.loop import LearnConfig
    from macaron_local.settings import Settings
    from macaron_local.store import Store, open_default_store

    def random_lora(base, rng):
        pairs = {}
        for name, shape in base.tensors.items():
            if name.endswith(("attn_q.weight", "attn_v.weight")):
                out, inp = shape
                a = rng.normal(0, 0.3, (2, inp)).astype(np.float32)
                b = rng.normal(0, 0.3, (out, 2)).astype(np.float32)
                pairs[name] = LoraPair(a, b)
        return LoraAdapter(architecture=base.architecture, alpha=4.0, pairs=pairs)

    def trial(spec):
        log = os.open(spec["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        say = lambda line: os.write(log, (line + "\\n").encode())  # in the kernel at once: survives kill -9
        say("phase start")
        settings = Settings.load(spec["home"])
        catalog = Catalog(settings)
        manifest = catalog.get("tiny")
        base = BaseModelInfo.from_gguf(catalog.base_path(manifest))
        store = open_default_store(settings)
        # Note each phase as it starts; the functions themselves run unchanged.
        export = run.export_gguf
        run.export_gguf = lambda *a, **k: (say("phase export"), export(*a, **k))[1]
        for name in ("register_adapter", "deploy_adapter", "rollback_adapter"):
            method = getattr(Store, name)
            phase = name.split("_")[0]
            setattr(Store, name, lambda self, *a, _m=method, _p=phase, **k: (say(f"phase {_p}"), _m(self, *a, **k))[1])
        rng = np.random.default_rng(spec["seed"])
        pick = random.Random(spec["seed"])
        config = LearnConfig(steps=2, episodes_per_step=2, group_size=2, max_new_tokens=4, refresh_every=10)
        workdir = Path(spec["workdir"])
        for i in range(100_000):
            fid = store.add_feedback(pick.choice(spec["replies"]), "rating", value=pick.choice([1, -1]))
            say(f"feedback {fid}")
            if spec["learn"]:
                say("phase train")
                run.learn_once(store, catalog, manifest, config)
            # Export as learning does (PEFT directory -> validated GGUF), or a fresh random LoRA.
            say("phase export")
            out = workdir / f"cycle-{os.getpid()}-{i}.gguf"
            if i % 2:
                path = convert_peft_dir(spec["peft"], base, out, dtype="F32")
            else:
                path = write_adapter(out, random_lora(base, rng))
            current = store.deployed_adapter("L0", "tiny")
            version = store.register_adapter(
                path, slot="L0", base_model="tiny", rank=2, parent_id=current.id if current else None
            )
            store.deploy_adapter(version.id)
            if pick.random() < 0.3:
                store.rollback_adapter("L0", "tiny")

    print("ready", flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os.dup2(2, 1)  # the control pipes are the zygote's alone: the child neither
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # writes to one nor reads from the other
            code = 0
            try:
                trial(spec)
            except BaseException as exc:
                os.write(2, f"trial failed: {exc!r}\\n".encode())
                code = 3
            os._exit(code)
        print(f"pid {pid}", flush=True)
        print(f"status {os.waitpid(pid, 0)[1]}", flush=True)
    """
)


def seed(store, n: int) -> list[str]:
    """`n` corrected conversations (what a learning pass trains on); returns the reply ids."""
    replies = []
    for i in range(n):
        conversation = store.new_conversation("tiny")
        question = store.add_message(conversation, "user", f"ab {i}")
        reply, _ = store.add_reply(conversation, question, "cd cd", TURN)
        store.add_feedback(reply, "correction", text=f"ba {i} ba")
        replies.append(reply)
    return replies


def expect(zygote: subprocess.Popen, word: str, errors: Path) -> int:
    """The next control line from the zygote, `<word> <number>`."""
    line = zygote.stdout.readline().split()
    assert len(line) == 2 and line[0] == word, f"expected {word!r}, got {line}: {errors.read_text()[-2000:]}"
    return int(line[1])


def wait_for(log: Path, marker: str, pid: int, errors: Path, timeout: float = 240) -> None:
    """Until the child has written `marker` to its log (it must stay alive meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists() and marker in log.read_text():
            return
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise AssertionError(f"the child died before {marker!r}: {errors.read_text()[-2000:]}") from None
        time.sleep(0.01)
    tail = log.read_text()[-300:] if log.exists() else "(no log)"
    raise AssertionError(f"the child never reached {marker!r} in {timeout:.0f} s; its log ends {tail!r}")


def check_intact(home, base: BaseModelInfo, engine: Engine, expected_feedback: set[int]) -> str | None:
    """Assert the store and registry are whole; returns the deployed version's id (or None)."""
    with open_default_store(home) as store:
        assert store.integrity_check() == "ok"
        stored = {item.feedback.id for item in store.feedback_rows()}
        assert expected_feedback <= stored, f"lost feedback rows {sorted(expected_feedback - stored)}"
        files = {(Path(v.path), v.sha256) for v in store.adapter_versions()}
        for path, digest in files:  # each distinct file once: versions share them
            assert CONTENT_NAME.match(path.name) and path.parent == store.adapters_dir
            assert path.is_file() and sha256_file(path) == digest, f"{path} is not whole"
        deployed = store.deployed_adapter("L0", "tiny")
        if deployed is None:
            return None
        validate_adapter(deployed.path, base)
        engine.set_adapters([engine.load_adapter(deployed.path)])
        assert engine.logits([0, 5, 9]).shape[-1] == 64
        engine.set_adapters([])
        return deployed.id


def test_kill_9_during_learn_export_and_deploy(home, tiny_model, tmp_path, fault_counts):
    model = tiny_model("llama", False, n_ctx_train=2048)
    catalog = Catalog(home)
    manifest = catalog.add_local("tiny", model.path)
    base = BaseModelInfo.from_gguf(model.path)
    with open_default_store(home) as store:
        replies = seed(store, 8)
        seeded = {item.feedback.id for item in store.feedback_rows()}

    workdir, scratch = tmp_path / "exports", tmp_path / "tmp"
    workdir.mkdir()
    scratch.mkdir()
    errors = tmp_path / "zygote.err"
    env = {**os.environ, "TMPDIR": str(scratch), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    zygote = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors.open("w"),
        text=True,
        env=env,
    )
    assert zygote.stdin is not None and zygote.stdout is not None
    rng = random.Random(6)
    # 8 kills aimed at the phases of a real learning pass, 22 at random instants of a fast
    # export/register/deploy/rollback loop.
    plan = [f"learn:{phase}" for phase in ("train", "export", "register", "deploy")] * 2 + ["cycle"] * (TRIALS - 8)
    rng.shuffle(plan)
    peft = peft_dir(tmp_path / "peft", model)
    logged: set[int] = set()
    phases: Counter[str] = Counter()
    deployed_seen: set[str] = set()
    kills = intact = 0
    child: int | None = None
    try:
        assert zygote.stdout.readline().strip() == "ready", errors.read_text()
        with Engine(EngineConfig(model_path=model.path, n_ctx=64)) as engine:
            for n, kind in enumerate(plan):
                log = tmp_path / f"trial-{n}.log"
                spec = {
                    "home": str(home.data_dir.parent),
                    "log": str(log),
                    "seed": n,
                    "replies": replies,
                    "workdir": str(workdir),
                    "peft": str(peft),
                    "learn": kind != "cycle",
                }
                zygote.stdin.write(json.dumps(spec) + "\n")
                zygote.stdin.flush()
                pid = child = expect(zygote, "pid", errors)
                if kind == "cycle":
                    time.sleep(rng.uniform(0.05, 1.0))
                else:  # a learning pass is slow on a busy machine: aim at a phase, then a random instant
                    target = kind.split(":")[1]
                    wait_for(log, f"phase {target}", pid, errors)
                    time.sleep(rng.uniform(0, 0.5 if target in ("train", "export") else 0.02))
                os.kill(pid, signal.SIGKILL)
                status = expect(zygote, "status", errors)
                child = None
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, errors.read_text()
                kills += 1
                lines = log.read_text().splitlines()
                logged |= {int(line.split()[1]) for line in lines if line.startswith("feedback ")}
                phases[[line.split()[1] for line in lines if line.startswith("phase ")][-1]] += 1
                deployed = check_intact(home, base, engine, seeded | logged)
                if deployed:
                    deployed_seen.add(deployed)
                intact += 1
    finally:  # on a failure, leave nothing running behind
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        zygote.stdin.close()
        try:
            zygote.wait(timeout=30)
        except subprocess.TimeoutExpired:
            zygote.kill()
            zygote.wait()

    assert kills == intact == len(plan) == TRIALS
    assert logged, "the children must have recorded feedback before being killed"
    assert {"train", "export"} <= set(phases) and phases["register"] + phases["deploy"] + phases["rollback"] > 0, phases
    assert deployed_seen, "some trial must have deployed a version before its kill"

    # The next run starts clean: a whole learning pass on the same store, then a collection.
    from macaron_local.learn.loop import LearnConfig
    from macaron_local.learn.run import learn_once

    with open_default_store(home) as store:
        config = LearnConfig(steps=2, episodes_per_step=2, group_size=2, max_new_tokens=4, refresh_every=10)
        [report] = learn_once(store, catalog, manifest, config)
        assert report.decision in ("deployed", "rejected") and report.version_id
        collected = store.collect_garbage(stale_temp_s=0)
        leftovers = [p.name for p in store.adapters_dir.iterdir() if TEMP_NAME.match(p.name)]
        assert leftovers == []
        versions = len(store.adapter_versions())
    with Engine(EngineConfig(model_path=model.path, n_ctx=64)) as engine:
        check_intact(home, base, engine, seeded | logged)

    where = ", ".join(f"{phase} {count}" for phase, count in sorted(phases.items()))
    fault_counts["kill -9 during learn/export/deploy"] = (
        f"{kills} trials, {intact} intact (killed during: {where}); {len(logged)} feedback rows seen committed, "
        f"all present; {versions} versions whole; {len(collected.stale_temps)} half-written temporary file(s) "
        f"collected; the next learning pass {report.decision}"
    )
    print(f"\nfaults: {fault_counts['kill -9 during learn/export/deploy']}")
