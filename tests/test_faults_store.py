"""Fault suite: concurrent writers, a full disk, corrupt adapter files in the registry, and a
store left by a newer version. Each ends with an intact store, a loadable deployed adapter (or
the bare expert, said in one line), no lost feedback row, and a clear message."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli, write_random_adapter
from malformed import raw_adapter, valid_pairs

from macaron_local.adapters import BaseModelInfo, validate_adapter
from macaron_local.catalog import Catalog
from macaron_local.engine import Engine, EngineConfig, GenerationParams
from macaron_local.errors import MacaronError
from macaron_local.session import Session
from macaron_local.settings import Settings
from macaron_local.store import Store, StoreError, open_default_store
from macaron_local.store.registry import NewVersion

pytestmark = pytest.mark.faults

TURN = {"model": "tiny", "expert": "L0", "route_method": "default"}
#: Which fault cases ran in this session, per kind, for the summary line.
CASES: dict[str, Counter[str]] = {}


OUTCOMES = {
    "disk full": "each refused in one line; deployed unchanged, no partial file, nothing half-registered, "
    "no feedback lost; the retry after freeing space went in",
    "corrupt adapter in the registry": "each refused in one line; the app served the expert alone, found the "
    "damaged file, rolled back to a loadable version; no feedback lost",
}


def tally(fault_counts: dict[str, str], kind: str, case: str) -> None:
    seen = CASES.setdefault(kind, Counter())
    seen[case] += 1
    fault_counts[kind] = f"{sum(seen.values())} case(s) ({', '.join(sorted(seen))}): {OUTCOMES[kind]}"


@dataclass
class World:
    """A user's machine: the tiny model, a store with feedback, v1 then v2 deployed on L0."""

    home: Settings
    model: object
    base: BaseModelInfo
    replies: list[str]
    v1: str
    v2: str
    feedback: int

    def store(self) -> Store:
        return open_default_store(self.home)


@pytest.fixture
def world(home, tiny_model, tmp_path) -> World:
    model = tiny_model("llama", False)
    Catalog(home).add_local("tiny", model.path)
    home.save(model="tiny")
    with open_default_store(home) as store:
        replies = []
        for i in range(5):
            conversation = store.new_conversation("tiny")
            question = store.add_message(conversation, "user", f"question {i}")
            reply, _ = store.add_reply(conversation, question, f"answer {i}", TURN)
            store.add_feedback(reply, "correction", text=f"better answer {i}")
            store.add_feedback(reply, "rating", value=1)
            replies.append(reply)
        v1 = store.register_adapter(
            write_random_adapter(tmp_path / "v1.gguf", model, rank=2, seed=1), slot="L0", base_model="tiny", rank=2
        )
        store.deploy_adapter(v1.id)
        v2 = store.register_adapter(
            write_random_adapter(tmp_path / "v2.gguf", model, rank=2, seed=2),
            slot="L0",
            base_model="tiny",
            rank=2,
            parent_id=v1.id,
        )
        store.deploy_adapter(v2.id)
    return World(home, model, BaseModelInfo.from_gguf(model.path), replies, v1.id, v2.id, 10)


def assert_whole(world: World, deployed: str | None, feedback: int) -> None:
    """Intact store, `feedback` rows, `deployed` serving L0 and loadable in the engine."""
    with world.store() as store:
        assert store.integrity_check() == "ok"
        assert len(store.feedback_rows()) == feedback
        version = store.deployed_adapter("L0", "tiny")
        assert (version.id if version else None) == deployed
        if version is not None:
            validate_adapter(version.path, world.base)
            with Engine(EngineConfig(model_path=world.model.path, n_ctx=64)) as engine:
                engine.set_adapters([engine.load_adapter(version.path)])
                assert np.isfinite(engine.logits([0, 5, 9])).all()
        assert not [p for p in store.adapters_dir.iterdir() if p.name.endswith(".tmp")]


def one_line(message: str) -> str:
    assert message and "\n" not in message.strip() and "Traceback" not in message
    return message


# ----------------------------------------------------------------- concurrent writers
APP = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from macaron_local.store import open_store
    db, replies, n = Path(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
    go, out = Path(sys.argv[4]), sys.argv[5]
    store = open_store(db)
    Path(f"{go}.{os.getpid()}").touch()  # ready: imported and opened
    while not go.exists():
        time.sleep(0.001)
    ids = [store.add_feedback(replies[i % len(replies)], "rating", value=1 if i % 2 else -1) for i in range(n)]
    Path(out).write_text(json.dumps(ids))
    """
)

DAEMON = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from macaron_local.store import open_store
    from macaron_local.store.registry import NewVersion
    db, files, go, stop = Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])
    store = open_store(db)
    Path(f"{go}.{os.getpid()}").touch()  # ready: imported and opened
    while not go.exists():
        time.sleep(0.001)
    cycles = registered = 0
    seen = []  # feedback rows present after each cycle: proof the writers interleaved
    while not stop.exists() or cycles == 0:
        current = store.deployed_adapter("L0", "tiny")
        batch = [NewVersion(slot="L1", base_model="tiny", rank=2, file=Path(files[i % len(files)]), status="rejected",
                            tags=["nightly"]) for i in range(500)]
        registered += len(store.register_adapters(batch))
        version = store.register_adapter(Path(files[cycles % len(files)]), slot="L0", base_model="tiny", rank=2,
                                         parent_id=current.id if current else None)
        run = store.record_learning_run(slot="L0", status="done", feedback_ids=[], decision="deployed", reason="test")
        store.set_learning_run_adapter(run, version.id)
        store.deploy_adapter(version.id)
        if cycles % 3 == 2:
            store.rollback_adapter("L0", "tiny")
        cycles += 1
        registered += 1
        seen.append(store.db.execute("SELECT count(*) FROM feedback").fetchone()[0])
    print(json.dumps({"cycles": cycles, "registered": registered, "feedback_seen": seen}))
    """
)


def test_app_and_daemon_write_concurrently_and_lose_nothing(world, tmp_path, fault_counts):
    """Two app processes record 10,000 feedback rows between them while a daemon process
    registers, deploys and rolls back adapter versions and records learning runs."""
    db = world.home.data_dir / "macaron.db"
    go, stop = tmp_path / "go", tmp_path / "stop"
    files = [str(write_random_adapter(tmp_path / f"d{i}.gguf", world.model, rank=2, seed=10 + i)) for i in range(3)]
    apps = [
        subprocess.Popen(
            [sys.executable, "-c", APP, str(db), json.dumps(world.replies), "5000", str(go), str(tmp_path / f"app{i}")],
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    daemon = subprocess.Popen(
        [sys.executable, "-c", DAEMON, str(db), json.dumps(files), str(go), str(stop)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("go.*"))) < 3:  # all three have started: then they start together
        assert time.monotonic() < deadline and all(p.poll() is None for p in [*apps, daemon])
        time.sleep(0.01)
    go.touch()
    for app in apps:
        _, err = app.communicate(timeout=300)
        assert app.returncode == 0, err
    stop.touch()
    out, err = daemon.communicate(timeout=300)
    assert daemon.returncode == 0, err
    done = json.loads(out)

    written = [i for n in range(2) for i in json.loads((tmp_path / f"app{n}").read_text())]
    assert len(written) == len(set(written)) == 10_000
    with world.store() as store:
        stored = {item.feedback.id for item in store.feedback_rows()}
        deployed = store.deployed_adapter("L0", "tiny")
        versions = store.db.execute("SELECT count(*) FROM adapter_versions").fetchone()[0]
    assert set(written) <= stored and len(stored) == world.feedback + 10_000
    assert versions == 2 + done["registered"] and done["cycles"] >= 1
    during = [n for n in done["feedback_seen"] if world.feedback < n < world.feedback + 10_000]
    assert during, f"no daemon cycle finished while the apps were writing: {done['feedback_seen']}"
    assert_whole(world, deployed.id if deployed else None, world.feedback + 10_000)
    fault_counts["concurrent writers (2 app processes and the daemon)"] = (
        f"10000 feedback writes, {len(set(written) & stored)} present; the daemon registered "
        f"{done['registered']} versions in {done['cycles']} deploy/rollback cycles, {len(during)} of them while the "
        "apps wrote; no write failed"
    )


# ----------------------------------------------------------------- a full disk
def _half_then_enospc(source, target, *args, **kwargs):
    """shutil.copyfile on a disk that fills up halfway through the file."""
    data = Path(source).read_bytes()
    Path(target).write_bytes(data[: len(data) // 2])
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))


def _fsync_enospc(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["copy", "flush"])
def test_disk_full_while_an_export_enters_the_registry(world, tmp_path, monkeypatch, capsys, where, fault_counts):
    """The learner's exported candidate is copied into the registry when the disk fills up."""
    import macaron_local.store.adapter_files as files

    candidate = write_random_adapter(tmp_path / "candidate.gguf", world.model, rank=2, seed=3)
    with monkeypatch.context() as full:
        if where == "copy":
            full.setattr(files.shutil, "copyfile", _half_then_enospc)
        else:  # the bytes fit in the page cache; the disk says no when they are flushed
            full.setattr(files.os, "fsync", _fsync_enospc)
        with world.store() as store:
            before = sorted(p.name for p in store.adapters_dir.iterdir())
            with pytest.raises(StoreError, match="no space left") as caught:
                store.register_adapter(candidate, slot="L0", base_model="tiny", rank=2, parent_id=world.v2)
            one_line(str(caught.value))
            assert sorted(p.name for p in store.adapters_dir.iterdir()) == before  # no partial file
            assert len(store.adapter_versions()) == 2

        from macaron_local.cli import main

        assert main(["plugins", "import", str(candidate), "--slot", "L0", "--base-model", "tiny"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: no space left") and one_line(err)
    assert_whole(world, world.v2, world.feedback)

    with world.store() as store:  # space freed: the same export goes in
        assert store.register_adapter(candidate, slot="L0", base_model="tiny", rank=2, parent_id=world.v2).id
    tally(fault_counts, "disk full", where)


def test_disk_full_while_converting_a_peft_export(world, tmp_path, monkeypatch, fault_counts):
    """PEFT -> GGUF (the export step) runs out of space while writing the tensors."""
    import gguf
    from test_plugins import peft_dir

    from macaron_local.plugins import import_plugin

    def full(self, *args, **kwargs):  # the header and metadata are written; the tensors do not fit
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    source = peft_dir(tmp_path / "peft", world.model)
    with monkeypatch.context() as patched:
        patched.setattr(gguf.GGUFWriter, "write_tensors_to_file", full)  # a whole adapter at once
        patched.setattr(gguf.GGUFWriter, "write_tensor_data", full)  # the streaming converter, tensor by tensor
        with world.store() as store, pytest.raises(StoreError, match="no space left") as caught:
            before = sorted(p.name for p in store.adapters_dir.iterdir())
            import_plugin(store, Catalog(world.home), source, slot="L0", base_model="tiny", name="p")
        one_line(str(caught.value))
    assert list(scratch.iterdir()) == []  # the half-written export went with its folder
    with world.store() as store:
        assert sorted(p.name for p in store.adapters_dir.iterdir()) == before and store.plugins() == []
        assert import_plugin(store, Catalog(world.home), source, slot="L0", base_model="tiny", name="p").plugin
    assert_whole(world, world.v2, world.feedback)
    tally(fault_counts, "disk full", "peft export")


def test_a_full_database_refuses_the_write_and_keeps_what_was_there(world, tmp_path, fault_counts):
    """SQLite's own size limit (max_page_count) as a disk that fills during a bulk registration."""
    files = [write_random_adapter(tmp_path / "bulk.gguf", world.model, rank=2, seed=4)]
    batch = [NewVersion(slot="L1", base_model="tiny", rank=2, file=files[0], tags=["bulk"]) for _ in range(5000)]
    with world.store() as store:
        pages = store.db.execute("PRAGMA page_count").fetchone()[0]
        store.db.execute(f"PRAGMA max_page_count = {pages + 2}")
        with pytest.raises(StoreError, match="is full") as caught:
            store.register_adapters(batch)
        one_line(str(caught.value))
        assert store.find_adapters(tag="bulk") == []
        store.db.execute("PRAGMA max_page_count = 1073741823")  # space freed
        assert len(store.register_adapters(batch)) == 5000
    assert_whole(world, world.v2, world.feedback)
    tally(fault_counts, "disk full", "database")


# ----------------------------------------------------------------- corrupt files in the registry
def _garbage(path: Path, world: World, tmp: Path) -> None:
    path.write_bytes(os.urandom(path.stat().st_size))


def _truncated(path: Path, world: World, tmp: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def _empty(path: Path, world: World, tmp: Path) -> None:
    path.write_bytes(b"")


def _nan(path: Path, world: World, tmp: Path) -> None:
    shutil.copyfile(write_random_adapter(tmp / "nan.gguf", world.model, rank=2, seed=5, magnitude=float("nan")), path)


def _f64_alpha(path: Path, world: World, tmp: Path) -> None:
    """The one that would abort llama.cpp outright (GGML_ASSERT)."""
    shutil.copyfile(raw_adapter(tmp / "f64.gguf", valid_pairs(world.model), alpha_kind="f64"), path)


def _missing(path: Path, world: World, tmp: Path) -> None:
    path.unlink()


CORRUPTIONS = {f.__name__.strip("_"): f for f in (_garbage, _truncated, _empty, _nan, _f64_alpha, _missing)}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_corrupt_deployed_file_is_refused_and_the_app_goes_on(world, tmp_path, kind, fault_counts):
    with world.store() as store:
        path = Path(store.adapter_version(world.v2).path)
        sha = store.adapter_version(world.v2).sha256
    CORRUPTIONS[kind](path, world, tmp_path)

    with Session(world.home, model="tiny") as session:
        session.load()  # must not raise: the expert serves alone
        reply = session.send("hello there", params=GenerationParams(max_tokens=4)).wait()
        [notice] = [n for n in reply.notices if n.startswith("L0:")]
        assert "could not be loaded" in notice and "the expert serves alone" in notice and str(path) in notice
        one_line(notice)
        assert not any(label.startswith("personal") for label in reply.adapters)
        assert reply.message_id is not None
        problems = session.store.damaged_adapter_files(deep=True)
        assert [digest for digest, _ in problems] == [sha]
        assert session.rollback("L0").id == world.v1  # the previous version serves again
        again = session.send("and again", params=GenerationParams(max_tokens=4)).wait()
        assert f"personal {world.v1}" in again.adapters

    validated = run_cli("adapters", "validate", str(path), "--model", "tiny", home=world.home.data_dir.parent)
    assert validated.returncode == 2 and validated.stderr.startswith("error: ") and one_line(validated.stderr)
    assert_whole(world, world.v1, world.feedback)
    tally(fault_counts, "corrupt adapter in the registry", kind)


# ----------------------------------------------------------------- a newer store
def test_a_store_left_by_a_newer_version_is_refused_untouched(world, fault_counts):
    db = world.home.data_dir / "macaron.db"
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO _migrations VALUES ('m099_from_the_future', '2099-01-01T00:00:00Z')")
    conn.close()
    digest = hashlib.sha256(db.read_bytes()).hexdigest()

    with pytest.raises(StoreError, match="newer macaron-local") as caught:
        world.store()
    one_line(str(caught.value))
    for args in (("logs", "list"), ("plugins", "list"), ("adapters", "list", "--model", "tiny")):
        result = run_cli(*args, home=world.home.data_dir.parent)
        assert result.returncode == 1 and "newer macaron-local" in result.stderr, args
        one_line(result.stderr)
    with pytest.raises(MacaronError, match="newer macaron-local"):
        Session(world.home, model="tiny").load()
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest

    reader = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        assert reader.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert reader.execute("SELECT count(*) FROM feedback").fetchone()[0] == world.feedback
        (path,) = reader.execute(
            "SELECT v.path FROM deployments d JOIN adapter_versions v ON v.id = d.version_id WHERE d.slot = 'L0'"
        ).fetchone()
    finally:
        reader.close()
    validate_adapter(path, world.base)  # the deployed adapter is still whole for the newer version
    fault_counts["store left by a newer version"] = (
        "refused in one line by the API, 3 commands and the app; file byte-identical, integrity ok, "
        f"{world.feedback} feedback rows present, deployed adapter whole"
    )
