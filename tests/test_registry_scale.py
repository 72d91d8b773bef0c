"""The registry at scale: bulk registration, bounded lineage, paged finds by tag and base model,
query plans that stay indexed whatever the size, m003 on an older store, and garbage collection
that is safe against a concurrent registration."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from macaron_local.errors import InvalidInputError
from macaron_local.hashing import sha256_file
from macaron_local.store import open_store
from macaron_local.store.connection import connect
from macaron_local.store.migrations import MIGRATIONS
from macaron_local.store.registry import COLUMNS, NewVersion


@pytest.fixture
def store(tmp_path):
    with open_store(tmp_path / "data" / "macaron.db") as opened:
        yield opened


def blob(folder: Path, i: int, size: int = 512) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"export-{i}.gguf"
    path.write_bytes(b"GGUF" + i.to_bytes(4, "little") * (size // 4))
    return path


def chain(files: list[Path], n: int, slot: str = "L0", base: str = "tiny", **kw) -> list[NewVersion]:
    """`n` versions, each the parent of the next, cycling through `files`."""
    from macaron_local.store.ids import new_id

    out: list[NewVersion] = []
    for i in range(n):
        out.append(
            NewVersion(
                id=new_id(),
                slot=slot,
                base_model=base,
                rank=4,
                file=files[i % len(files)],
                parent_id=out[-1].id if out else None,
                status="retired",
                feedback_ids=[i],
                evaluations={"n": i},
                tags=["nightly", f"n:{i}"],
                **kw,
            )
        )
    return out


def test_migration_is_appended():
    assert [m.__name__ for m in MIGRATIONS][:3] == ["m001_initial", "m002_adapter_registry", "m003_registry_at_scale"]


def test_bulk_registration_is_one_fast_transaction(store, tmp_path):
    files = [blob(tmp_path / "exports", i) for i in range(20)]
    batch = chain(files, 20_000)
    started = time.perf_counter()
    ids = store.register_adapters(batch)
    elapsed = time.perf_counter() - started
    assert ids == [v.id for v in batch]
    assert store.db.execute("SELECT count(*) FROM adapter_versions").fetchone()[0] == 20_000
    assert store.db.execute("SELECT count(*) FROM adapter_tags").fetchone()[0] == 40_000
    assert len(list(store.adapters_dir.glob("*.gguf"))) == 20  # each distinct file stored once
    last = store.adapter_version(ids[-1])
    assert last.parent_id == ids[-2] and last.feedback_ids == [19_999] and last.evaluations == {"n": 19_999}
    assert Path(last.path).read_bytes() == files[19_999 % 20].read_bytes()
    # A version per transaction manages a few thousand a second here; one transaction, far more.
    assert elapsed < 10, f"20,000 versions took {elapsed:.1f} s"


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"parent_id": "01NOTAVERSION0000000000000"}, "neither registered nor earlier"),
        ({"status": "deployed"}, "cannot deploy"),
        ({"status": "sideways"}, "status must be one of"),
        ({"rank": 0}, "rank"),
        ({"tags": ["two words"]}, "tag"),
    ],
)
def test_a_bad_version_registers_nothing_of_its_batch(store, tmp_path, bad, message):
    files = [blob(tmp_path / "exports", i) for i in range(3)]
    batch = chain(files, 10)
    fields = {**vars(batch[6]), **bad}
    batch[6] = NewVersion(**fields)
    with pytest.raises(InvalidInputError, match=message):
        store.register_adapters(batch)
    assert store.db.execute("SELECT count(*) FROM adapter_versions").fetchone()[0] == 0
    assert store.db.execute("SELECT count(*) FROM adapter_tags").fetchone()[0] == 0
    # The files copied in before the transaction are unreferenced: a collection takes them.
    assert len(store.collect_garbage().removed) == 3


def test_lineage_walks_parents_newest_first_and_stops_at_the_limit(store, tmp_path):
    from macaron_local.store.ids import new_id

    files = [blob(tmp_path / "exports", 0)]
    main = chain(files, 120)
    branch = NewVersion(
        id=new_id(), slot="L0", base_model="tiny", rank=4, file=files[0], parent_id=main[59].id, status="rejected"
    )
    store.register_adapters([*main, branch, *chain(files, 5, slot="L1")])
    assert store.slot_lineage("L0", "tiny") == []  # nothing deployed: the bare expert
    store.deploy_adapter(main[-1].id)

    page = store.slot_lineage("L0", "tiny")
    newest_first = [v.id for v in reversed(main)]
    assert [v.id for v in page] == newest_first[:50]
    rest = store.adapter_lineage(page[-1].parent_id, limit=None)
    assert [v.id for v in page + rest] == newest_first
    assert [v.id for v in store.adapter_lineage(main[10].id, limit=3)] == [main[10].id, main[9].id, main[8].id]
    assert [v.id for v in store.adapter_lineage(branch.id, limit=2)] == [branch.id, main[59].id]
    assert page[0].status == "deployed" and page[0].evaluations == {"n": 119}
    with pytest.raises(InvalidInputError, match="no adapter version"):
        store.adapter_lineage("nope")
    with pytest.raises(InvalidInputError, match="limit"):
        store.adapter_lineage(main[0].id, limit=0)


def test_find_by_tag_and_base_model_page_newest_first(store, tmp_path):
    files = [blob(tmp_path / "exports", 0)]
    a = chain(files, 130, base="base-a")
    b = chain(files, 20, base="base-b")
    store.register_adapters(a + b)
    store.tag_adapter(a[3].id, "release:1")

    seen, before = [], None
    while page := store.find_adapters(base_model="base-a", limit=50, before=before):
        seen += page
        before = page[-1].id
    assert [v.id for v in seen] == [v.id for v in reversed(a)]
    assert [v.id for v in store.find_adapters(tag="release:1")] == [a[3].id]
    assert store.adapter_tags(a[3].id) == ["n:3", "nightly", "release:1"]
    assert len(store.find_adapters(tag="nightly")) == 50
    assert store.find_adapters(tag="unknown") == []
    with pytest.raises(InvalidInputError, match="a tag or by a base model"):
        store.find_adapters()
    with pytest.raises(InvalidInputError, match="limit"):
        store.find_adapters(tag="nightly", limit=0)


def plan(store, sql: str, params: list) -> str:
    return " | ".join(row[3] for row in store.db.execute(f"EXPLAIN QUERY PLAN {sql}", params).fetchall())


def test_every_lookup_is_indexed_so_it_does_not_grow_with_the_registry(store, tmp_path):
    """The property the 1M-version benchmark measures, checked structurally: no query scans."""
    store.register_adapters(chain([blob(tmp_path / "exports", 0)], 200))
    store.db.execute("ANALYZE")
    v = ", ".join(f"v.{c.strip()}" for c in COLUMNS.split(","))
    plans = {
        "resolve": plan(
            store,
            f"SELECT {v} FROM deployments d JOIN adapter_versions v ON v.id = d.version_id"
            " WHERE d.slot = ? AND d.base_model = ?",
            ["L0", "tiny"],
        ),
        "by tag": plan(
            store,
            f"SELECT {v} FROM adapter_tags t JOIN adapter_versions v ON v.id = t.version_id"
            " WHERE t.tag = ? AND t.version_id < ? ORDER BY t.version_id DESC LIMIT 50",
            ["nightly", "~"],
        ),
        "by base": plan(
            store,
            f"SELECT {COLUMNS} FROM adapter_versions WHERE base_model = ? AND id < ? ORDER BY id DESC LIMIT 50",
            ["tiny", "~"],
        ),
        "file in use": plan(store, "SELECT 1 FROM adapter_versions WHERE sha256 = ? LIMIT 1", ["0" * 64]),
    }
    for name, text in plans.items():
        assert "SCAN" not in text.replace("SCAN CONSTANT ROW", ""), f"{name}: {text}"
        assert "TEMP B-TREE" not in text, f"{name} sorts: {text}"
    assert "idx_adapter_versions_base" in plans["by base"]
    assert "idx_adapter_versions_sha256" in plans["file in use"]


def test_m003_upgrades_a_store_with_versions_in_it(tmp_path):
    path = tmp_path / "old" / "macaron.db"
    newer = MIGRATIONS[2:]
    del MIGRATIONS[2:]
    try:
        with open_store(path) as old:
            first = old.register_adapter(blob(tmp_path / "exports", 1), slot="L0", base_model="tiny", rank=2)
            old.deploy_adapter(first.id)
    finally:
        MIGRATIONS.extend(newer)
    db = connect(path)
    names = [r[0] for r in db.execute("SELECT name FROM _migrations ORDER BY applied_at, name").fetchall()]
    db.close()
    assert names[:3] == ["m001_initial", "m002_adapter_registry", "m003_registry_at_scale"]
    assert set(names) == {m.__name__ for m in MIGRATIONS}  # m003 and every later one, applied on open
    with open_store(path) as store:
        assert store.deployed_adapter("L0", "tiny").id == first.id
        assert [v.id for v in store.find_adapters(base_model="tiny")] == [first.id]
        assert store.adapter_tags(first.id) == []


def test_garbage_collection_keeps_what_is_referenced_or_being_written(store, tmp_path):
    kept = store.register_adapter(blob(tmp_path / "exports", 1), slot="L0", base_model="tiny", rank=2)
    folder = store.adapters_dir
    orphan = folder / f"{'a' * 64}.gguf"
    orphan.write_bytes(b"GGUF orphan")
    live_temp = folder / f".{'b' * 64}.gguf.{os.getpid()}.tmp"  # this process is writing it
    live_temp.write_bytes(b"half")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_temp = folder / f".{'c' * 64}.gguf.{int(dead.stdout)}.tmp"
    dead_temp.write_bytes(b"half")
    young_dead_temp = folder / f".{'d' * 64}.gguf.{int(dead.stdout)}.tmp"
    young_dead_temp.write_bytes(b"half")
    os.utime(dead_temp, (0, 0))
    stranger = folder / "notes.txt"
    stranger.write_text("not ours")

    dry = store.collect_garbage(dry_run=True)
    assert dry.removed == [orphan.name] and dry.stale_temps == [dead_temp.name] and orphan.exists()
    report = store.collect_garbage()
    assert report.removed == [orphan.name] and report.stale_temps == [dead_temp.name] and report.kept == 1
    assert not orphan.exists() and not dead_temp.exists()
    assert Path(kept.path).exists() and live_temp.exists() and young_dead_temp.exists() and stranger.exists()
    assert "removed 1 unreferenced adapter file(s)" in report.summary()


def test_a_collection_between_copy_and_insert_cannot_orphan_the_new_version(store, tmp_path, monkeypatch):
    """The file is copied before the write lock is taken; another process collecting garbage in
    that gap deletes it (nothing references it yet). Registration checks again under the lock
    and copies it back, so the row never points at a missing file."""
    from macaron_local.store import registry

    source = blob(tmp_path / "exports", 7)
    collected = []
    with open_store(store.db_path) as other:
        copy = registry.store_file

        def copy_then_collect(path, folder):
            stored = copy(path, folder)
            collected.extend(other.collect_garbage().removed)  # the other process, in the gap
            return stored

        monkeypatch.setattr(registry, "store_file", copy_then_collect)
        version = store.register_adapter(source, slot="L0", base_model="tiny", rank=2)
    assert collected == [f"{version.sha256}.gguf"]
    assert Path(version.path).is_file() and sha256_file(Path(version.path)) == version.sha256


def test_a_damaged_copy_is_repaired_by_registering_the_good_bytes(store, tmp_path):
    source = blob(tmp_path / "exports", 3)
    first = store.register_adapter(source, slot="L0", base_model="tiny", rank=2)
    Path(first.path).write_bytes(b"garbage")
    assert store.damaged_adapter_files() == []  # present and non-empty: only hashing tells
    assert [d for d, _ in store.damaged_adapter_files(deep=True)] == [first.sha256]
    store.register_adapter(source, slot="L0", base_model="tiny", rank=2)
    assert Path(first.path).read_bytes() == source.read_bytes()
    assert store.damaged_adapter_files(deep=True) == []


REGISTERING = textwrap.dedent(
    """
    import os, sys
    from pathlib import Path
    from macaron_local.store import open_store
    store = open_store(Path(sys.argv[1]))
    folder = Path(sys.argv[2])
    for i in range(int(sys.argv[3])):
        source = folder / f"{os.getpid()}-{i}.gguf"
        source.write_bytes(os.urandom(256))
        store.register_adapter(source, slot="L0", base_model="race", rank=1)
    print("done", flush=True)
    """
)


def test_registrations_racing_collections_never_lose_a_file(store, tmp_path):
    """A process registering fresh files while this one collects garbage in a loop."""
    (tmp_path / "src").mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", REGISTERING, str(store.db_path), str(tmp_path / "src"), "300"],
        stdout=subprocess.PIPE,
        text=True,
    )
    collections = 0
    while child.poll() is None:
        store.collect_garbage(stale_temp_s=0)
        collections += 1
        time.sleep(0.005)  # let the other writer in: SQLite's busy wait is not a fair queue
    assert child.wait() == 0 and collections > 0
    versions = store.adapter_versions(base_model="race")
    assert len(versions) == 300
    for version in versions:
        assert sha256_file(Path(version.path)) == version.sha256
