"""Malformed adapters never reach llama.cpp: `macaron adapters validate` and the engine refuse
each with one line (exit code 2 from the CLI), and no process aborts or segfaults."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import run_cli
from malformed import build_corpus

TESTS_DIR = Path(__file__).parent


@pytest.fixture(scope="module")
def corpus(tiny_model, tmp_path_factory):
    model = tiny_model("llama", False)
    return model, build_corpus(model, tmp_path_factory.mktemp("malformed"))


@pytest.fixture(scope="module")
def tiny_home(corpus, tmp_path_factory):
    """A MACARON_HOME whose configured model is the tiny base (added with `macaron models add`)."""
    model, _ = corpus
    home = tmp_path_factory.mktemp("home")
    done = run_cli("models", "add", "tiny", str(model.path), home=home)
    assert done.returncode == 0, done.stderr
    (home / "config" / "settings.toml").write_text('model = "tiny"\n')
    return home


def test_corpus_is_large_and_varied(corpus):
    _, cases = corpus
    assert len(cases) >= 50
    for kind in (
        "truncated",
        "random_bytes",
        "zero_length",
        "wrong_architecture",
        "not_an_adapter",
        "missing_lora",
        "transposed",
        "rank_mismatch",
        "unknown",
        "nan",
        "inf",
        "alpha_float64",
        "no_tensors",
    ):
        assert any(kind in name for name in cases), kind


def validate_cli(home: Path, path: Path) -> subprocess.CompletedProcess[str]:
    return run_cli("adapters", "validate", str(path), home=home)


def test_cli_rejects_every_malformed_file_with_one_line_and_exit_2(corpus, tiny_home):
    _, cases = corpus
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(cases, pool.map(lambda p: validate_cli(tiny_home, p), cases.values()), strict=True))
    for name, done in results.items():
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, f"{name}: exit {done.returncode}: {done.stderr}"
        assert len(lines) == 1 and lines[0].startswith("error: "), f"{name}: {done.stderr!r}"
        assert "Traceback" not in done.stderr and done.stdout == ""


def test_cli_accepts_a_valid_adapter(corpus, tiny_home, tmp_path):
    from conftest import write_random_adapter

    model, _ = corpus
    good = write_random_adapter(tmp_path / "good.gguf", model, rank=4, seed=1)
    done = validate_cli(tiny_home, good)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok: ") and "rank 4" in done.stdout


ENGINE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from macaron_local.engine import Engine, EngineConfig, GenerationParams
    from macaron_local.errors import AdapterError
    base, files = sys.argv[1], json.loads(sys.argv[2])
    refused = {}
    with Engine(EngineConfig(model_path=Path(base), n_ctx=64, n_threads=1)) as engine:
        for name, path in files.items():
            try:
                engine.load_adapter(path)
                refused[name] = None
            except AdapterError as exc:
                refused[name] = str(exc)
        tokens = engine.generate([0, 5, 7], GenerationParams(max_tokens=3, min_p=0.0)).tokens
    print(json.dumps({"refused": refused, "still_generates": len(tokens)}))
    """
)


def test_engine_refuses_every_malformed_file_and_keeps_working(corpus):
    model, cases = corpus
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            ENGINE_SCRIPT,
            str(model.path),
            json.dumps({k: str(v) for k, v in cases.items()}),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"engine process died ({done.returncode}): {done.stderr[-2000:]}"
    report = json.loads(done.stdout)
    accepted = [name for name, why in report["refused"].items() if why is None]
    assert accepted == []
    assert all("\n" not in why for why in report["refused"].values())
    assert report["still_generates"] > 0


RAW_LLAMA_SCRIPT = textwrap.dedent(
    """
    import sys, llama_cpp
    llm = llama_cpp.Llama(sys.argv[1], n_ctx=32, verbose=False)
    ptr = llama_cpp.llama_adapter_lora_init(llm.model, sys.argv[2].encode())
    print("loaded" if ptr else "refused")
    """
)


def test_raw_llama_cpp_aborts_on_float64_alpha(corpus):
    """Why the validator exists: llama.cpp itself kills the process on this file."""
    model, cases = corpus
    done = subprocess.run(
        [sys.executable, "-c", RAW_LLAMA_SCRIPT, str(model.path), str(cases["alpha_float64"])],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode < 0, f"expected death by a signal (SIGABRT), got exit {done.returncode}"
    assert "loaded" not in done.stdout.splitlines()
