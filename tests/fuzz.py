"""The fuzz suite's harness: run cases through the real command, judge each result, keep counts.

A case is a `macaron` command line with its own MACARON_HOME. Batches run in child processes
(tests/fuzz_driver.py: `main()` per case, in parallel on every core); a smaller set runs as
real `python -m macaron_local` subprocesses. Every result is judged the same way:
- no traceback and no hang (a deadline per case);
- the exit code is one the README documents for it (0, or 2 for bad input, 1 for the environment);
- a refusal is exactly one line, `error: ...`, with no warning and no raw control character;
- a refused input left the store exactly as it was (every row of every table);
- an input known to be bad was not accepted.

`MACARON_FUZZ_SCALE` (default 1) multiplies the number of generated cases: CI runs the default
in a few tens of seconds; `MACARON_FUZZ_SCALE=20 pytest tests/test_fuzz_inputs.py` runs longer.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

SCALE = max(0.1, float(os.environ.get("MACARON_FUZZ_SCALE", "1")))
DRIVER = Path(__file__).with_name("fuzz_driver.py")
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
WORKERS = max(1, min(4, os.cpu_count() or 1))


def template_store(home: Path, base: Path):
    """The store of a new home whose configured model is the GGUF base `base` (named "tiny")."""
    from macaron_local.catalog import Catalog
    from macaron_local.settings import Settings
    from macaron_local.store import default_store_path, open_store

    settings = Settings.load(home)
    settings.ensure_dirs()
    Catalog(settings).add_local("tiny", base)
    settings.save(model="tiny")
    return open_store(default_store_path(settings))


def scaled(n: int) -> int:
    return max(1, int(n * SCALE))


@dataclass
class Case:
    name: str
    argv: list[str]
    home: Path
    #: Exit codes the README documents for this command and input.
    codes: tuple[int, ...] = (0, 2)
    #: True: the input is bad and must be refused; None: either answer may be right.
    bad: bool | None = None
    timeout: float = 10.0
    #: A refusal may not change the store (False for commands that never touch it).
    digest: bool = True

    def payload(self) -> dict:
        return {
            "name": self.name,
            "argv": self.argv,
            "home": str(self.home),
            "timeout": self.timeout,
            "digest": self.digest,
        }


@dataclass
class Tally:
    """Counts for one surface, printed at the end of the run (tests/conftest.py)."""

    cases: int = 0
    subprocesses: int = 0
    accepted: int = 0
    failures: list[str] = field(default_factory=list)
    slowest: tuple[float, str] = (0.0, "")

    def line(self) -> str:
        seconds, name = self.slowest
        return (
            f"{self.cases} cases ({self.subprocesses} as separate processes), {self.accepted} accepted, "
            f"{len(self.failures)} failures, slowest {seconds:.2f}s ({name})"
        )


def judge(case: Case, result: dict) -> list[str]:
    """What is wrong with one result (empty: nothing)."""
    problems = []
    stderr, stdout = result.get("stderr", ""), result.get("stdout", "")
    if result.get("hang"):
        problems.append(f"hang (no answer in {case.timeout:g}s)")
    if result.get("traceback") or "Traceback (most recent call last)" in stderr:
        problems.append("traceback: " + (result.get("traceback") or stderr).strip().splitlines()[-1][:200])
    rc = result.get("rc")
    if rc is not None and rc not in case.codes:
        problems.append(f"exit code {rc}, documented {case.codes}: {stderr.strip()[:200]}")
    if "Warning" in stderr:
        problems.append(f"a warning on stderr: {stderr.strip()[:200]}")
    if RAW_CONTROL.search(stderr) or RAW_CONTROL.search(stdout.replace("\n", "").replace("\t", "")):
        problems.append("a raw control character reached the terminal")
    if rc not in (0, None):
        lines = [line for line in stderr.splitlines() if line.strip()]
        if rc == 1 and case.argv[:1] == ["doctor"]:
            pass  # doctor reports its failed checks on stdout and exits 1
        elif len(lines) != 1 or not lines[0].startswith("error: "):
            problems.append(f"not one 'error:' line: {stderr.strip()[:300]!r}")
        if case.digest and result.get("changed"):
            problems.append(f"the store changed although the command failed ({result.get('changed')})")
    if rc == 0 and case.bad:
        problems.append(f"bad input accepted: {stdout.strip()[:200]}")
    return problems


def run_batch(cases: list[Case], *, warmup: Case | None = None, total_timeout: float = 600) -> list[dict]:
    """Run `cases` through fuzz_driver.py in WORKERS child processes; results in case order.
    `warmup` runs first in each process, untimed and unreported (e.g. the base model's first read)."""
    if not cases:
        return []
    chunks = [([warmup] if warmup else []) + cases[i::WORKERS] for i in range(WORKERS)]

    def run(chunk: list[Case]) -> list[dict]:
        if len(chunk) <= int(warmup is not None):
            return []
        done = subprocess.run(
            [sys.executable, str(DRIVER)],
            input=json.dumps([c.payload() for c in chunk]),
            capture_output=True,
            text=True,
            timeout=total_timeout,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        if done.returncode != 0:
            raise AssertionError(f"the fuzz driver died (exit {done.returncode}): {done.stderr[-3000:]}")
        results = json.loads(done.stdout)
        return results[1:] if warmup else results

    with ThreadPoolExecutor(WORKERS) as pool:
        parts = list(pool.map(run, chunks))
    by_name = {r["name"]: r for part in parts for r in part}
    return [by_name[c.name] for c in cases]


def run_real(cases: list[Case]) -> list[dict]:
    """Run each case as its own `python -m macaron_local` process (the command a user runs)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from fuzz_driver import store_digest

    def run(case: Case) -> dict:
        before = store_digest(str(case.home)) if case.digest else ""
        start = time.perf_counter()
        env = {**os.environ, "MACARON_HOME": str(case.home), "HF_HUB_OFFLINE": "1"}
        try:
            done = subprocess.run(
                [sys.executable, "-m", "macaron_local", *case.argv],
                capture_output=True,
                timeout=case.timeout + 20,  # the interpreter's own start on a loaded machine
                env=env,
            )
        except subprocess.TimeoutExpired:
            return {"name": case.name, "hang": True, "rc": None, "seconds": time.perf_counter() - start}
        result = {
            "name": case.name,
            "rc": done.returncode,
            "stdout": done.stdout.decode("utf-8", "backslashreplace"),
            "stderr": done.stderr.decode("utf-8", "backslashreplace"),
            "seconds": time.perf_counter() - start,
            "hang": False,
        }
        if done.returncode < 0:
            result["traceback"] = f"killed by signal {-done.returncode} (a crash)"
        if case.digest:
            result["changed"] = store_digest(str(case.home)) != before
        return result

    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(run, cases))


def record(tally: Tally, cases: list[Case], results: list[dict], *, real: bool = False) -> None:
    for case, result in zip(cases, results, strict=True):
        tally.cases += 1
        tally.subprocesses += int(real)
        tally.accepted += int(result.get("rc") == 0)
        for problem in judge(case, result):
            tally.failures.append(f"{case.name}: {problem}")
        seconds = float(result.get("seconds") or 0.0)
        if seconds > tally.slowest[0]:
            tally.slowest = (seconds, case.name)
