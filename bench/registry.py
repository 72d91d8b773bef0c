"""Registry benchmark: a million adapter versions, and how fast the questions about them are answered.

The registry is filled the way years of nightly learning would fill it, in bulk:
`base_models` base models x 4 expert slots = chains; each night adds one version per chain,
whose parent is the chain's head; 70% pass the gate (they extend the chain and are retired when
the next one deploys), 30% are rejected (a dead branch off the head). At the end each chain's
head is deployed. Metadata is synthetic but shaped like a real run's (feedback ids, a dozen
evaluation figures, tags); files are small random blobs, `files` distinct ones shared by all.

Figures (printed as JSON with --json), all measured in one run:
- `versions`: rows in the registry; `register_per_s`: bulk registration (`Store.register_adapters`,
  batches of `batch` versions, each one transaction; hashing and copying the files included).
  Reference: `register_one_by_one_per_s`, `Store.register_adapter` per version.
- `resolve_p99_ms`: `Store.deployed_adapter(slot, base)` for random chains (target <= 1 ms).
- `lineage_p99_ms`: `Store.slot_lineage` (the deployed version and its ancestors, one page of
  `page_size`) for random chains; `lineage_full_p99_ms` walks every ancestor (`lineage_depth_mean`
  deep). Reference: `lineage_loop_p99_ms`, the same page walked one `adapter_version` call each.
- `find_by_tag_p99_ms` / `find_by_base_p99_ms`: one page (`page_size`, newest first) of the
  versions with a tag (one on every version, one on a third, rare ones) or for a base model.
- `reference_small`: resolve/lineage/find p99 on a registry of `small` versions built the same
  way: the figures above should not grow with the registry.
- `gc_s`: a garbage collection over the full registry with orphan and stale temporary files.

Usage: python bench/registry.py [--json] [--versions N] [--base-models N] [--batch N] [--files N]
"""

from __future__ import annotations

import argparse
import os
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from common import emit, pct

from macaron_local.store import Store, open_store
from macaron_local.store.ids import new_id
from macaron_local.store.registry import PAGE, NewVersion

SLOTS = ("L0", "L1", "L2", "L3")
TARGET_RESOLVE_P99_MS = 1.0
TARGET_REGISTER_PER_S = 10_000
QUERIES = 3000


def make_files(folder: Path, n: int, rng: random.Random) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n):
        path = folder / f"export-{i}.gguf"
        path.write_bytes(b"GGUF" + rng.randbytes(rng.randint(2048, 8192)))
        files.append(path)
    return files


def synthetic(
    n_versions: int, base_models: int, files: list[Path], rng: random.Random
) -> Iterator[tuple[NewVersion, tuple[str, str], bool]]:
    """Versions night by night, one per chain per night: (version, chain, passed the gate)."""
    chains = [(slot, f"base-{b:04d}") for b in range(base_models) for slot in SLOTS]
    heads: dict[tuple[str, str], str | None] = dict.fromkeys(chains)
    feedback = 0
    made = 0
    while made < n_versions:
        for chain in chains:
            if made == n_versions:
                return
            passed = rng.random() < 0.7
            feedback += 8
            version = NewVersion(
                id=new_id(),
                slot=chain[0],
                base_model=chain[1],
                rank=8,
                file=rng.choice(files),
                parent_id=heads[chain],
                learning_run_id=new_id(),
                feedback_ids=list(range(feedback - 8, feedback)),
                evaluations={
                    "heldout_reward_before": round(rng.uniform(-1, 1), 4),
                    "heldout_reward_after": round(rng.uniform(-1, 1), 4),
                    "regression_nll_delta": round(rng.uniform(-0.05, 0.05), 4),
                    "regression_qa_before": 8,
                    "regression_qa_after": rng.randint(6, 10),
                    "parity_max_abs_diff": round(rng.uniform(0, 0.5), 5),
                    "steps": 24,
                    "wall_s": round(rng.uniform(100, 400), 1),
                },
                status="retired" if passed else "rejected",
                tags=[
                    "nightly",
                    *(["eval:pass"] if passed and rng.random() < 0.5 else []),
                    *([f"release:{made}"] if rng.random() < 1e-4 else []),
                ],
            )
            if passed:
                heads[chain] = version.id
            made += 1
            yield version, chain, passed


def fill(store: Store, n_versions: int, base_models: int, files: list[Path], batch: int, seed: int) -> dict:
    """Bulk-register the synthetic registry, then deploy every chain's head; returns timings."""
    rng = random.Random(seed)
    heads: dict[tuple[str, str], str] = {}
    register_s = 0.0
    pending: list[NewVersion] = []

    def flush() -> None:
        nonlocal register_s
        started = time.perf_counter()
        store.register_adapters(pending)
        register_s += time.perf_counter() - started
        pending.clear()

    for version, chain, passed in synthetic(n_versions, base_models, files, rng):
        pending.append(version)
        if passed:
            heads[chain] = version.id  # type: ignore[assignment]
        if len(pending) == batch:
            flush()
    if pending:
        flush()
    started = time.perf_counter()
    for version_id in heads.values():
        store.deploy_adapter(version_id)
    return {"register_s": register_s, "deploy_s": time.perf_counter() - started, "chains": sorted(heads)}


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1000)
    return out


def measure(store: Store, chains: list[tuple[str, str]], seed: int, n: int = QUERIES) -> dict:
    """p50/p99 of resolve, lineage and find on `store` (random chains, tags and base models)."""
    rng = random.Random(seed)
    pick = lambda: rng.choice(chains)  # noqa: E731
    releases = [r[0] for r in store.db.execute("SELECT tag FROM adapter_tags WHERE tag LIKE 'release:%'")]
    tags = ["nightly", "eval:pass", *(releases or ["nightly"])]
    resolve = timed(lambda: store.deployed_adapter(*pick()), n)
    lineage = timed(lambda: store.slot_lineage(*pick()), n)
    by_tag = timed(lambda: store.find_adapters(tag=rng.choice(tags)), n)
    by_base = timed(lambda: store.find_adapters(base_model=pick()[1]), n)
    depths = [len(store.slot_lineage(*pick(), limit=None)) for _ in range(50)]
    lineage_full = timed(lambda: store.slot_lineage(*pick(), limit=None), n // 10)

    def loop() -> None:
        current = store.deployed_adapter(*pick())
        walked = 0
        while current is not None and walked < PAGE:
            walked += 1
            current = store.adapter_version(current.parent_id) if current.parent_id else None

    lineage_loop = timed(loop, n // 10)
    return {
        "resolve_p50_ms": pct(resolve, 0.5, 4),
        "resolve_p99_ms": pct(resolve, 0.99, 4),
        "lineage_p50_ms": pct(lineage, 0.5, 4),
        "lineage_p99_ms": pct(lineage, 0.99, 4),
        "lineage_full_p99_ms": pct(lineage_full, 0.99, 4),
        "lineage_depth_mean": round(statistics.fmean(depths), 1),
        "lineage_loop_p99_ms": pct(lineage_loop, 0.99, 4),
        "find_by_tag_p50_ms": pct(by_tag, 0.5, 4),
        "find_by_tag_p99_ms": pct(by_tag, 0.99, 4),
        "find_by_base_p50_ms": pct(by_base, 0.5, 4),
        "find_by_base_p99_ms": pct(by_base, 0.99, 4),
    }


def one_by_one(store: Store, files: list[Path], n: int, rng: random.Random) -> float:
    """Versions per second through `Store.register_adapter` (one transaction per version)."""
    parent = None
    started = time.perf_counter()
    for _ in range(n):
        parent = store.register_adapter(
            rng.choice(files), slot="L0", base_model="one-by-one", rank=8, parent_id=parent, tags=["nightly"]
        ).id
    return n / (time.perf_counter() - started)


def gc_pass(store: Store, rng: random.Random) -> dict:
    """Orphan files and stale temporary files among the referenced ones; one collection."""
    folder = store.adapters_dir
    for _ in range(50):
        (folder / f"{rng.randbytes(32).hex()}.gguf").write_bytes(rng.randbytes(4096))
    for _ in range(5):
        stale = folder / f".{rng.randbytes(32).hex()}.gguf.999999999.tmp"
        stale.write_bytes(b"half")
        os.utime(stale, (0, 0))
    started = time.perf_counter()
    report = store.collect_garbage()
    return {
        "gc_s": round(time.perf_counter() - started, 3),
        "gc_removed": len(report.removed),
        "gc_stale_temps": len(report.stale_temps),
        "gc_kept": report.kept,
    }


def bench(n_versions: int, base_models: int, batch: int, n_files: int, small: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="macaron-bench-registry-") as tmp:
        root = Path(tmp)
        files = make_files(root / "exports", n_files, rng)

        with open_store(root / "small" / "macaron.db") as store:
            filled = fill(store, small, max(1, small // 4000), files, batch, seed)
            reference = measure(store, filled["chains"], seed)
            reference["versions"] = small

        path = root / "full" / "macaron.db"
        with open_store(path) as store:
            filled = fill(store, n_versions, base_models, files, batch, seed)
            versions = store.db.execute("SELECT count(*) FROM adapter_versions").fetchone()[0]
            store.db.execute("PRAGMA optimize")
            figures = measure(store, filled["chains"], seed + 1)
            register_one = one_by_one(store, files, 2000, rng)
            gc = gc_pass(store, rng)
            tag_rows = store.db.execute("SELECT count(*) FROM adapter_tags").fetchone()[0]
        size_mb = path.stat().st_size / 1e6

    register_per_s = round(n_versions / filled["register_s"])
    return {
        "versions": versions,
        "chains": len(filled["chains"]),
        "tag_rows": tag_rows,
        "distinct_files": n_files,
        "db_size_mb": round(size_mb, 1),
        "register_per_s": register_per_s,
        "register_s": round(filled["register_s"], 2),
        "register_batch": batch,
        "page_size": PAGE,
        "register_one_by_one_per_s": round(register_one),
        "deploy_s": round(filled["deploy_s"], 2),
        **figures,
        "reference_small": reference,
        **gc,
        "target_resolve_p99_ms": TARGET_RESOLVE_P99_MS,
        "target_register_per_s": TARGET_REGISTER_PER_S,
        "targets_met": figures["resolve_p99_ms"] <= TARGET_RESOLVE_P99_MS
        and figures["lineage_p99_ms"] <= TARGET_RESOLVE_P99_MS
        and figures["find_by_tag_p99_ms"] <= TARGET_RESOLVE_P99_MS
        and figures["find_by_base_p99_ms"] <= TARGET_RESOLVE_P99_MS
        and register_per_s >= TARGET_REGISTER_PER_S,
        "sqlite_version": sqlite3.sqlite_version,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--versions", type=int, default=1_000_000, help="versions to register (default 1000000)")
    parser.add_argument("--base-models", type=int, default=250, help="base models (x 4 slots = chains)")
    parser.add_argument("--batch", type=int, default=10_000, help="versions per bulk registration")
    parser.add_argument("--files", type=int, default=1000, help="distinct small adapter files")
    parser.add_argument("--small", type=int, default=10_000, help="versions in the reference registry")
    args = parser.parse_args(argv)
    result = bench(args.versions, args.base_models, args.batch, args.files, args.small)
    return emit(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
