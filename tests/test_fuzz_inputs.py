"""The fuzz suite: hostile inputs on every surface, through the real command.

Surfaces: `adapters validate` (header bombs and mutants of a valid GGUF), `adapters convert`
(mutants of a valid PEFT directory and unwritable outputs), `logs import` (mutants of a valid
export), `plugins import` (manifests, FIFOs, links, foreign architectures), and the environment
(`settings.toml` contents and kinds of file, `MACARON_HOME` a file, under a file, read-only).
Each case is judged by tests/fuzz.py: no traceback, no hang, a documented exit code, one
`error:` line, no warning, no raw control character, the store unchanged by a refusal, and no
known-bad input accepted. Accepted GGUF mutants are then loaded by llama.cpp itself.

The counts are printed at the end of the run (`fuzz: ...`). MACARON_FUZZ_SCALE=20 runs longer.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import random_adapter, write_random_adapter
from fuzz import SCALE, Case, Tally, record, run_batch, run_real, scaled, template_store
from gguf_bombs import write_bombs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from macaron_local.adapters import BaseModelInfo, read_adapter, validate_adapter, write_adapter
from macaron_local.adapters.gguf_header import read_header
from macaron_local.adapters.validate import MAX_UPDATE
from macaron_local.errors import MacaronError
from macaron_local.settings_schema import check_settings
from macaron_local.store import open_store
from macaron_local.terminal import printable
from macaron_local.untrusted import load_json

TESTS = Path(__file__).parent
TURN = {
    "model": "tiny",
    "expert": "L2",
    "route_method": "keywords",
    "route_reason": "matched 'python'",
    "adapters": ["L2-coding.gguf"],
    "sampling": {"temperature": 0.0, "top_p": 0.9},
    "prompt_tokens": 20,
    "completion_tokens": 5,
    "ttft_ms": 30.0,
    "total_ms": 90.0,
    "finish_reason": "stop",
}
HF_MODULES = {"self_attn.q_proj": "attn_q", "self_attn.v_proj": "attn_v", "mlp.down_proj": "ffn_down"}


def _tally(fuzz_counts: dict, surface: str, tally: Tally) -> None:
    fuzz_counts[surface] = tally.line()
    assert not tally.failures, f"{len(tally.failures)} of {tally.cases} {surface} cases failed:\n" + "\n".join(
        tally.failures[:25]
    )


# ----------------------------------------------------------------- the world every case starts from
@pytest.fixture(scope="module")
def world(tiny_model, tmp_path_factory):
    """A home whose configured model is a tiny llama base, with conversations and feedback,
    plus a valid adapter, PEFT directory and export to mutate."""
    root = tmp_path_factory.mktemp("fuzz")
    model = tiny_model("llama", False)
    foreign = tiny_model("qwen3", False)
    home = root / "template"
    with template_store(home, model.path) as store:
        for n in range(3):
            cid = store.new_conversation("tiny", "Be brief.")
            question = store.add_message(cid, "user", f"Question {n}: reverse a list in python", None)
            answer, _ = store.add_reply(cid, question, f"Use reversed(xs) ({n}).", TURN)
            store.add_feedback(answer, "rating", 1, "clear")
            store.add_feedback(answer, "correction", text="Use xs[::-1] for a copy.")
        buffer = io.StringIO()
        store.export_jsonl(buffer)
    adapter = write_random_adapter(root / "good.gguf", model, rank=4, seed=3, dtype="F32")
    foreign_adapter = write_random_adapter(root / "foreign.gguf", foreign, rank=4, seed=4, dtype="F32")
    return {
        "root": root,
        "model": model,
        "home": home,
        "adapter": adapter,
        "foreign_adapter": foreign_adapter,
        "export": buffer.getvalue(),
        "peft": _peft_dir(root / "peft", model),
        "base": BaseModelInfo.from_gguf(model.path),
    }


def copy_home(world: dict, name: str) -> Path:
    target = world["root"] / "homes" / name
    shutil.copytree(world["home"], target)
    return target


def _peft_dir(directory: Path, model, rank: int = 4) -> Path:
    rng = np.random.default_rng(5)
    tensors = {}
    for i in range(model.config.n_layer):
        for module, role in HF_MODULES.items():
            out, inp = model.weights[f"blk.{i}.{role}.weight"].shape
            prefix = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.1, (rank, inp)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.1, (out, rank)).astype(np.float32)
    directory.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


# ----------------------------------------------------------------- GGUF: bombs and mutants
EXTREMES_64 = (0, 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 32, 2**64 - 1)
EXTREMES_32 = (0, 1, 5, 9, 13, 99, 2**16, 2**31, 2**32 - 1)
VALUES_F32 = (math.nan, math.inf, -math.inf, 3.0e38, 1.0e30, 1.0e10, 0.25, -0.5, 0.0)


def mutate_gguf(data: bytes, header_end: int, rng: random.Random) -> tuple[str, bytes]:
    out = bytearray(data)
    kind = rng.choice(("flip", "flips", "u64", "u32", "truncate", "delete", "insert", "value", "value"))
    if kind == "flip":
        out[rng.randrange(header_end)] = rng.randrange(256)
    elif kind == "flips":
        for _ in range(rng.randint(2, 6)):
            out[rng.randrange(header_end)] = rng.randrange(256)
    elif kind == "u64":
        pos = rng.randrange(4, header_end - 8)
        out[pos : pos + 8] = struct.pack("<Q", rng.choice(EXTREMES_64))
    elif kind == "u32":
        pos = rng.randrange(4, header_end - 4)
        out[pos : pos + 4] = struct.pack("<I", rng.choice(EXTREMES_32))
    elif kind == "truncate":
        del out[rng.randrange(len(out)) :]
    elif kind == "delete":
        start = rng.randrange(header_end)
        del out[start : start + rng.randint(1, 16)]
    elif kind == "insert":
        start = rng.randrange(header_end)
        out[start:start] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    else:
        pos = header_end + 4 * rng.randrange((len(data) - header_end) // 4)
        out[pos : pos + 4] = struct.pack("<f", rng.choice(VALUES_F32))
    return kind, bytes(out)


def llama_loads(base: Path, adapters: list[Path]) -> dict[str, bool]:
    """Ask llama.cpp itself (tests/llama_oracle.py) whether it loads each adapter."""
    if not adapters:
        return {}
    done = subprocess.run(
        [sys.executable, str(TESTS / "llama_oracle.py"), str(base), *map(str, adapters)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"llama.cpp crashed loading accepted adapters (exit {done.returncode}): {done.stderr}"
    return json.loads(done.stdout)


def test_gguf_bombs_and_mutants_never_reach_llama_cpp(world, fuzz_counts):
    tally = Tally()
    home = copy_home(world, "gguf")
    folder = world["root"] / "gguf"
    bombs = write_bombs(folder / "bombs")
    cases = [
        Case(f"bomb:{name}", ["adapters", "validate", str(path)], home, bad=True, timeout=2.0)
        for name, path in bombs.items()
    ]
    data = world["adapter"].read_bytes()
    header_end = read_header(world["adapter"]).data_start
    rng = random.Random(1616)
    for n in range(scaled(160)):
        kind, mutant = mutate_gguf(data, header_end, rng)
        path = folder / f"mutant-{n}-{kind}.gguf"
        path.write_bytes(mutant)
        cases.append(Case(f"mutant:{path.name}", ["adapters", "validate", str(path)], home, timeout=5.0))
    cases.append(Case("good", ["adapters", "validate", str(world["adapter"])], home, bad=False))
    results = run_batch(cases, warmup=Case("warmup", ["adapters", "validate", str(world["adapter"])], home, timeout=60))
    record(tally, cases, results)

    accepted = [Path(c.argv[2]) for c, r in zip(cases, results, strict=True) if r["rc"] == 0]
    for path in accepted:  # what we accept must be finite in float32 and loadable by llama.cpp
        adapter = read_adapter(path)
        for name, pair in adapter.pairs.items():
            update = np.abs(pair.delta(adapter.alpha)).max()
            if not update <= MAX_UPDATE:
                tally.failures.append(f"{path.name}: accepted although {name}'s update reaches {update:.3g}")
    for path, ok in llama_loads(world["model"].path, accepted).items():
        if not ok:
            tally.failures.append(f"{Path(path).name}: accepted by us but refused by llama.cpp")
    assert world["adapter"] in accepted
    _tally(fuzz_counts, "gguf header (adapters validate)", tally)


def test_header_bombs_answer_within_two_seconds(world, fuzz_counts):
    """`adapters validate` on any file under 1 MB answers within 2 s, whatever its header claims:
    every bomb ran under a 2 s deadline above; here a spread of them runs as the real command,
    against the same command on a valid adapter measured in the same run (the interpreter's start)."""
    tally = Tally()
    home = copy_home(world, "bombs-real")
    bombs = write_bombs(world["root"] / "bombs-real")
    assert all(p.stat().st_size < 1 << 20 for p in bombs.values())
    chosen = sorted(bombs)[:: max(1, int(4 / SCALE))]
    baseline_case = Case("baseline", ["adapters", "validate", str(world["adapter"])], home, bad=False)
    cases = [Case(f"bomb:{n}", ["adapters", "validate", str(bombs[n])], home, bad=True, timeout=2.0) for n in chosen]
    results = run_real([baseline_case, *cases])
    record(tally, [baseline_case, *cases], results, real=True)
    baseline = results[0]["seconds"]
    for case, result in zip(cases, results[1:], strict=True):
        if result["seconds"] - baseline > 2.0:
            tally.failures.append(f"{case.name}: {result['seconds']:.2f}s against {baseline:.2f}s for a valid file")
    _tally(fuzz_counts, f"header bombs as real processes (valid file: {baseline:.2f}s)", tally)


# ----------------------------------------------------------------- PEFT conversion
def _peft_variant(world: dict, name: str, config: object = None, tensors=None, raw_config: str | None = None) -> Path:
    directory = world["root"] / "peft-cases" / name
    shutil.copytree(world["peft"], directory)
    if raw_config is not None:
        (directory / "adapter_config.json").write_text(raw_config)
    elif config is not None:
        (directory / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def _peft_tensors(world: dict) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(world["peft"] / "adapter_model.safetensors"))


def peft_cases(world: dict, home: Path) -> list[Case]:
    good = json.loads((world["peft"] / "adapter_config.json").read_text())
    tensors = _peft_tensors(world)
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    q_b = q_a.replace("lora_A", "lora_B")
    bad_configs = {
        "alpha_str": {**good, "lora_alpha": "8"},
        "alpha_zero": {**good, "lora_alpha": 0},
        "alpha_negative": {**good, "lora_alpha": -4},
        "alpha_null": {**good, "lora_alpha": None},
        "alpha_list": {**good, "lora_alpha": [8]},
        "alpha_bool": {**good, "lora_alpha": True},
        "r_zero": {**good, "r": 0},
        "r_float": {**good, "r": 4.5},
        "r_str": {**good, "r": "4"},
        "alpha_pattern_list": {**good, "alpha_pattern": ["q_proj"]},
        "alpha_pattern_str_value": {**good, "alpha_pattern": {"q_proj": "x"}},
        "alpha_pattern_zero": {**good, "alpha_pattern": {"q_proj": 0}},
        "rank_pattern_zero": {**good, "rank_pattern": {"q_proj": 0}},
        "rank_pattern_list": {**good, "rank_pattern": [1]},
        "use_dora": {**good, "use_dora": True},
        "modules_to_save": {**good, "modules_to_save": ["lm_head"]},
        "targets_disagree": {**good, "target_modules": ["k_proj"]},
        "targets_wrong_type": {**good, "target_modules": 5},
        "targets_bad_regex": {**good, "target_modules": "(("},
        "peft_type_int": {**good, "peft_type": 7},
        "peft_type_prefix": {**good, "peft_type": "PREFIX_TUNING"},
        "rslora_str": {**good, "use_rslora": "yes"},
        "alpha_huge": {**good, "lora_alpha": 1e30},
    }
    raw = {
        "config_list": "[1, 2]",
        "config_string": '"LORA"',
        "config_nan": '{"peft_type": "LORA", "r": 4, "lora_alpha": NaN}',
        "config_infinity": '{"peft_type": "LORA", "r": 4, "lora_alpha": Infinity}',
        "config_deep": '{"a": ' + "[" * 50_000 + "]" * 50_000 + "}",
        "config_huge_int": '{"peft_type": "LORA", "r": ' + "9" * 5000 + "}",
        "config_not_json": "{r: 4",
        "config_surrogate": '{"peft_type": "LORA\\ud800", "r": 4, "lora_alpha": 8}',
    }
    without_b = {k: v for k, v in tensors.items() if k != q_b}
    bad_tensors = {
        "lone_half": without_b,
        "one_dim": {**tensors, q_a: tensors[q_a][0]},
        "rank_mismatch": {**tensors, q_b: np.zeros((tensors[q_b].shape[0], 3), np.float32)},
        "transposed": {**tensors, q_a: np.ascontiguousarray(tensors[q_a].T)},
        "nan": {**tensors, q_b: np.full_like(tensors[q_b], np.nan)},
        "f16_overflow": {**tensors, q_b: np.full_like(tensors[q_b], 1e30)},
        "qk_rows_do_not_fit": {**tensors, q_b: np.zeros((tensors[q_b].shape[0] + 1, 4), np.float32)},
        "lone_embedding_half": {
            **tensors,
            "base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 16), np.float32),
        },
        "not_lora": {**tensors, "base_model.model.model.norm.weight": np.ones(8, np.float32)},
    }
    # Converted as their values, exactly: no hazard, so either answer is right.
    unknown_tensors = {"integer_dtype": {**tensors, q_a: (tensors[q_a] * 100).astype(np.int32)}}
    out_dir = world["root"] / "peft-out"
    out_dir.mkdir(exist_ok=True)
    cases = []

    def convert(name: str, directory: Path, out: Path, *, bad: bool | None) -> None:
        cases.append(Case(f"peft:{name}", ["adapters", "convert", str(directory), str(out)], home, bad=bad))

    for name, config in bad_configs.items():
        convert(name, _peft_variant(world, name, config=config), out_dir / f"{name}.gguf", bad=True)
    for name, text in raw.items():
        convert(name, _peft_variant(world, name, raw_config=text), out_dir / f"{name}.gguf", bad=True)
    for name, variant in bad_tensors.items():
        convert(name, _peft_variant(world, name, tensors=variant), out_dir / f"{name}.gguf", bad=True)
    for name, variant in unknown_tensors.items():
        convert(name, _peft_variant(world, name, tensors=variant), out_dir / f"{name}.gguf", bad=None)
    a_file = out_dir / "a-file"
    a_file.write_text("x")
    (out_dir / "existing-dir.gguf").mkdir(exist_ok=True)
    for name, out in {
        "out_missing_folder": out_dir / "missing" / "x.gguf",
        "out_under_a_file": a_file / "x.gguf",
        "out_is_a_directory": out_dir / "existing-dir.gguf",
    }.items():
        convert(name, world["peft"], out, bad=True)
    rng = random.Random(1617)
    hostile = [None, 0, -1, 1e308, "", "x", [], {}, True, 2**70, "\x1b[2J"]
    for n in range(scaled(12)):
        key = rng.choice(sorted(good) + ["alpha_pattern", "bias", "layers_to_transform"])
        convert(
            f"random-{n}-{key}",
            _peft_variant(world, f"random-{n}", config={**good, key: rng.choice(hostile)}),
            out_dir / f"random-{n}.gguf",
            bad=None,
        )
    convert("good", world["peft"], out_dir / "good.gguf", bad=False)
    return cases


def test_peft_mutants_convert_or_are_refused_in_one_line(world, fuzz_counts):
    tally = Tally()
    home = copy_home(world, "peft")
    cases = peft_cases(world, home)
    results = run_batch(cases)
    record(tally, cases, results)
    for case, result in zip(cases, results, strict=True):
        out = Path(case.argv[3])
        if result["rc"] == 0:
            try:
                validate_adapter(out, world["base"])
            except MacaronError as exc:
                tally.failures.append(f"{case.name}: converted to a file that does not validate ({exc})")
        elif out.is_file():
            tally.failures.append(f"{case.name}: refused but left {out}")
    assert results[-1]["rc"] == 0, results[-1]
    _tally(fuzz_counts, "peft (adapters convert)", tally)


# ----------------------------------------------------------------- JSONL import
HOSTILE_JSON = ("NaN", "Infinity", "-Infinity", str(2**63), str(-(2**63) - 1), str(2**64), '"\\ud800"', "9" * 5000)


def _leaves(value, path=()):
    if isinstance(value, dict):
        for key, child in value.items():
            yield from _leaves(child, (*path, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            yield from _leaves(child, (*path, i))
    else:
        yield path


def _set(value, path, new):
    for key in path[:-1]:
        value = value[key]
    value[path[-1]] = new


MARK = "__HOSTILE__"


def jsonl_cases(world: dict) -> list[Case]:
    lines = world["export"].splitlines()
    records = [json.loads(line) for line in lines]
    rng = random.Random(1618)
    folder = world["root"] / "jsonl"
    folder.mkdir(exist_ok=True)
    cases = []

    def add(name: str, text: str | bytes, *, bad: bool | None) -> None:
        path = folder / f"{name}.jsonl"
        path.write_bytes(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
        cases.append(Case(f"jsonl:{name}", ["logs", "import", str(path)], copy_home(world, f"jsonl-{name}"), bad=bad))

    # Hostile values at random leaves of a fresh conversation (new ids, so only the value decides).
    for n in range(scaled(40)):
        record_ = json.loads(json.dumps(records[n % len(records)]))
        _fresh_ids(record_, n)
        path = rng.choice(list(_leaves(record_)))
        _set(record_, path, MARK)
        hostile = rng.choice(HOSTILE_JSON)
        add(f"hostile-{n}", json.dumps(record_).replace(f'"{MARK}"', hostile), bad=True)
    deep = json.loads(json.dumps(records[0]))
    _fresh_ids(deep, 900)
    deep["turns"][0]["sampling"]["x"] = MARK
    add("deep-nesting", json.dumps(deep).replace(f'"{MARK}"', "[" * 100_000 + "]" * 100_000), bad=True)
    for n, fid in enumerate((2**63 - 1, 2**53, 2**62, 0, -1)):
        record_ = json.loads(json.dumps(records[0]))
        _fresh_ids(record_, 800 + n)
        record_["feedback"][0]["id"] = fid
        add(f"feedback-id-{fid}", json.dumps(record_), bad=True)
    escapes = json.loads(json.dumps(records[1]))
    _fresh_ids(escapes, 700)
    escapes["conversation"]["title"] = "\x1b[2J\x1b]0;owned\x07\x9b31m title"
    add("terminal-escapes-in-title", json.dumps(escapes), bad=None)
    for n in range(scaled(25)):  # byte-level damage
        text = bytearray(world["export"].encode())
        for _ in range(rng.randint(1, 4)):
            text[rng.randrange(len(text))] = rng.randrange(256)
        add(f"bytes-{n}", bytes(text), bad=None)
    for n in range(scaled(15)):  # type confusion at random leaves
        record_ = json.loads(json.dumps(records[n % len(records)]))
        _fresh_ids(record_, 500 + n)
        _set(record_, rng.choice(list(_leaves(record_))), rng.choice([None, 0, -5, 1.5, "", [], {}, True, "x" * 300]))
        add(f"types-{n}", json.dumps(record_), bad=None)
    fifo = folder / "fifo.jsonl"
    os.mkfifo(fifo)
    cases.append(Case("jsonl:fifo", ["logs", "import", str(fifo)], copy_home(world, "jsonl-fifo"), bad=True, timeout=5))
    os.symlink(folder / "missing.jsonl", folder / "dangling.jsonl")
    cases.append(
        Case(
            "jsonl:dangling-link",
            ["logs", "import", str(folder / "dangling.jsonl")],
            copy_home(world, "jsonl-dangling"),
            bad=True,
        )
    )
    cases.append(Case("jsonl:directory", ["logs", "import", str(folder)], copy_home(world, "jsonl-dir"), bad=True))
    return cases


def _fresh_ids(record_: dict, n: int) -> None:
    """Give a copied conversation new ids, so importing it is not skipped as already there."""
    text = json.dumps(record_)
    ids = {record_["conversation"]["id"], *(m["id"] for m in record_["messages"]), *(t["id"] for t in record_["turns"])}
    for old in ids:
        text = text.replace(f'"{old}"', f'"{old}-f{n}"')
    record_.clear()
    record_.update(json.loads(text))
    for i, f in enumerate(record_["feedback"]):
        f["id"] = 10_000 + 10 * n + i


def test_jsonl_import_mutants_are_all_or_nothing(world, fuzz_counts):
    tally = Tally()
    cases = jsonl_cases(world)
    results = run_batch(cases)
    record(tally, cases, results)
    listing = [
        Case(f"{c.name}:list", ["logs", "list"], c.home, bad=False)
        for c, r in zip(cases, results, strict=True)
        if r["rc"] == 0
    ]
    listing += [
        Case(f"{c.name}:show", ["logs", "show", "--json", _newest(c.home)], c.home, bad=False) for c in listing[:5]
    ]
    after = run_batch(listing)
    record(tally, listing, after)
    for case in listing:  # an accepted import leaves a store that still takes new feedback
        with open_store(case.home / "data" / "macaron.db") as store:
            summary = store.list_conversations(limit=1)[0]
            reply = [m for m in store.get_conversation(summary.id).messages if m.role == "assistant"]
            if reply:
                store.add_feedback(reply[0].id, "rating", 1)
            buffer = io.StringIO()
            store.export_jsonl(buffer)
        for line in buffer.getvalue().splitlines():
            load_json(line, "re-export")  # standard JSON: no NaN/Infinity tokens
    assert any(r["rc"] == 0 for r in results)
    _tally(fuzz_counts, "jsonl (logs import)", tally)


def _newest(home: Path) -> str:
    with open_store(home / "data" / "macaron.db", readonly=True) as store:
        return store.list_conversations(limit=1)[0].id


# ----------------------------------------------------------------- plugins
def plugin_cases(world: dict) -> list[Case]:
    folder = world["root"] / "plugins"
    folder.mkdir(exist_ok=True)
    cases = []

    def add(name: str, argv: list[str], *, bad: bool | None, home: Path | None = None) -> None:
        cases.append(
            Case(
                f"plugin:{name}",
                ["plugins", "import", *argv],
                home or copy_home(world, f"plugin-{name}"),
                bad=bad,
                timeout=5,
            )
        )

    def with_manifest(name: str, text: str, suffix: str = "toml") -> Path:
        directory = folder / name
        directory.mkdir()
        shutil.copy(world["adapter"], directory / "adapter.gguf")
        (directory / f"plugin.{suffix}").write_text(text, encoding="utf-8", errors="surrogatepass")
        return directory

    manifests = {
        "deep-toml": ("a = " + "[" * 5000 + "]" * 5000, "toml", True),
        "deep-tables": ("\n".join(f"[{'.'.join(['t'] * n)}]" for n in range(1, 60)), "toml", True),
        "deep-json": ('{"name": ' + "[" * 100_000 + "]" * 100_000 + "}", "json", True),
        "json-list": ("[1]", "json", True),
        "json-nan": ('{"name": "p", "slot": "L0", "description": NaN}', "json", True),
        "name-number": ('name = 5\nslot = "L0"', "toml", True),
        "name-upper": ('name = "Bad Name"\nslot = "L0"', "toml", True),
        "slot-unknown": ('name = "p"\nslot = "L9"', "toml", True),
        "slot-and-expert": ('name = "p"\nslot = "L0"\nexpert = "sql"', "toml", True),
        "unknown-key": ('name = "p"\nslot = "L0"\nweights = "x"', "toml", True),
        "expert-newline": ('name = "p"\nexpert = "sql\\nx"', "toml", True),
        "escapes-in-description": ('name = "esc"\nslot = "L0"\ndescription = "\\u001b[2J"', "toml", None),
        "good": ('name = "fine"\nslot = "L2"', "toml", False),
    }
    for name, (text, suffix, bad) in manifests.items():
        add(name, [str(with_manifest(name, text, suffix))], bad=bad)
    cases.append(
        Case(
            "plugin:base-unknown",
            ["plugins", "import", str(with_manifest("base-unknown", 'name = "p"\nslot = "L0"\nbase_model = "nope"'))],
            copy_home(world, "plugin-base-unknown"),
            codes=(1,),
            bad=True,
        )
    )  # an unknown model is a missing model: exit 1, as the README documents
    add("name-trailing-newline", [str(world["adapter"]), "--name", "p\n", "--slot", "L0"], bad=True)
    add("name-escape", [str(world["adapter"]), "--name", "p\x1b[2J", "--slot", "L0"], bad=True)
    fifo = folder / "fifo.gguf"
    os.mkfifo(fifo)
    add("fifo", [str(fifo), "--slot", "L0"], bad=True)
    fifo_dir = folder / "holds-a-fifo"
    fifo_dir.mkdir()
    os.mkfifo(fifo_dir / "a.gguf")
    add("dir-with-fifo", [str(fifo_dir), "--slot", "L0"], bad=True)
    os.symlink(folder / "missing.gguf", folder / "dangling.gguf")
    add("dangling-link", [str(folder / "dangling.gguf"), "--slot", "L0"], bad=True)
    dir_named = folder / "holds-a-dir"
    (dir_named / "x.gguf").mkdir(parents=True)
    add("dir-named-gguf", [str(dir_named), "--slot", "L0"], bad=True)
    # A model whose base is not on this machine: the adapter's architecture must still match it.
    ghost_home = copy_home(world, "plugin-ghost")
    (ghost_home / "config" / "models" / "ghost.toml").write_text(
        'name = "ghost"\narchitecture = "llama"\n[base]\nsource = "path"\nfile = "/nonexistent/ghost.gguf"\n'
    )
    add(
        "foreign-arch-base-absent",
        [str(world["foreign_adapter"]), "--slot", "L0", "--base-model", "ghost"],
        bad=True,
        home=ghost_home,
    )
    add(
        "same-arch-base-absent",
        [str(world["adapter"]), "--slot", "L1", "--base-model", "ghost", "--name", "g"],
        bad=False,
        home=_ghost_copy(ghost_home),
    )
    rng = random.Random(1619)
    data = world["adapter"].read_bytes()
    header_end = read_header(world["adapter"]).data_start
    for n in range(scaled(10)):
        kind, mutant = mutate_gguf(data, header_end, rng)
        path = folder / f"mutant-{n}-{kind}.gguf"
        path.write_bytes(mutant)
        add(f"mutant-{n}", [str(path), "--slot", "L0"], bad=None)
    return cases


def _ghost_copy(ghost_home: Path) -> Path:
    target = ghost_home.with_name(ghost_home.name + "-2")
    shutil.copytree(ghost_home, target)
    return target


def test_plugin_imports_are_checked_or_refused_in_one_line(world, fuzz_counts):
    tally = Tally()
    cases = plugin_cases(world)
    results = run_batch(cases)
    record(tally, cases, results)
    follow = [
        Case(f"{c.name}:list", ["plugins", "list"], c.home, bad=False)
        for c, r in zip(cases, results, strict=True)
        if r["rc"] == 0
    ]
    record(tally, follow, run_batch(follow))
    from macaron_local.manifest_schema import NAME_PATTERN

    for case in follow:  # every accepted plugin has a name that matches whole, so it can be removed
        with open_store(case.home / "data" / "macaron.db", readonly=True) as store:
            for plugin in store.plugins():
                if not NAME_PATTERN.fullmatch(plugin.name):
                    tally.failures.append(f"{case.name}: accepted the plugin name {plugin.name!r}")
    assert results[[c.name for c in cases].index("plugin:good")]["rc"] == 0
    _tally(fuzz_counts, "plugins (plugins import)", tally)


# ----------------------------------------------------------------- settings and MACARON_HOME
BAD_SETTINGS = {
    "n_ctx-text": 'n_ctx = "big"',
    "n_ctx-negative": "n_ctx = -1",
    "n_ctx-beyond-int64": "n_ctx = 99999999999999999999",
    "n_threads-float": "n_threads = 1.5",
    "temperature-nan": "temperature = nan",
    "temperature-inf": "temperature = inf",
    "temperature-negative": "temperature = -3.0",
    "max_tokens-zero": "max_tokens = 0",
    "kv_switch-unknown": 'kv_switch = "fast"',
    "model-number": "model = 5",
    "model-empty": 'model = ""',
    "learning_paused-text": 'learning_paused = "yes"',
    "learning_backend-unknown": 'learning_backend = "jax"',
    "daemon-not-a-table": "daemon = 5",
    "deep-arrays": "x = " + "[" * 5000 + "]" * 5000,
    "deep-tables": "[" + ".".join(["t"] * 100) + "]",
    "not-toml": "model = [unclosed",
    "not-utf8": b'model = "\xff\xfe"',
    "huge": "# " + "x" * (2 << 20),
}
COMMANDS = (["doctor"], ["logs", "list"], ["models", "list"], ["adapters", "list"])


def environment_cases(world: dict) -> list[Case]:
    cases = []
    for name, text in BAD_SETTINGS.items():
        home = copy_home(world, f"settings-{name}")
        target = home / "config" / "settings.toml"
        target.write_bytes(text if isinstance(text, bytes) else text.encode())
        for argv in COMMANDS:
            cases.append(Case(f"settings:{name}:{' '.join(argv)}", list(argv), home, bad=True, timeout=5))
    kinds = {}
    home = copy_home(world, "settings-dir")
    (home / "config" / "settings.toml").unlink()
    (home / "config" / "settings.toml").mkdir()
    kinds["directory"] = home
    home = copy_home(world, "settings-fifo")
    (home / "config" / "settings.toml").unlink()
    os.mkfifo(home / "config" / "settings.toml")
    kinds["fifo"] = home
    home = copy_home(world, "settings-dangling")
    (home / "config" / "settings.toml").unlink()
    os.symlink(home / "nowhere.toml", home / "config" / "settings.toml")
    kinds["dangling-link"] = home
    for name, home in kinds.items():
        for argv in COMMANDS:
            cases.append(Case(f"settings-{name}:{' '.join(argv)}", list(argv), home, bad=True, timeout=5))
    home = copy_home(world, "settings-unknown-key")
    (home / "config" / "settings.toml").write_text('model = "tiny"\nfavourite_colour = "teal"\n')
    cases.append(Case("settings:unknown-key:logs list", ["logs", "list"], home, bad=False))
    a_file = world["root"] / "home-is-a-file"
    a_file.write_text("not a folder")
    for argv in (*COMMANDS, ["adapters", "validate", str(world["adapter"])]):
        cases.append(Case(f"home-file:{' '.join(argv)}", list(argv), a_file, codes=(1, 2), bad=True, digest=False))
        cases.append(
            Case(f"home-under-file:{' '.join(argv)}", list(argv), a_file / "home", codes=(1, 2), bad=True, digest=False)
        )
    return cases


def test_settings_and_home_problems_are_one_line(world, fuzz_counts):
    tally = Tally()
    cases = environment_cases(world)
    results = run_batch(cases)
    record(tally, cases, results)
    _tally(fuzz_counts, "environment (settings.toml, MACARON_HOME)", tally)


@contextlib.contextmanager
def read_only_copy(world: dict):
    """A copy of the template home on a read-only mount (root), or with its write bits off."""
    target = world["root"] / "read-only"
    target.mkdir()
    if os.geteuid() != 0:
        shutil.copytree(world["home"], target / "home")
        paths = [p for p in (target / "home").rglob("*")] + [target / "home"]
        for path in paths:
            path.chmod(path.stat().st_mode & ~0o222)
        try:
            yield target / "home"
        finally:
            for path in paths:
                path.chmod(path.stat().st_mode | 0o200)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(target)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("running as root without the right to mount: a read-only folder cannot be made here")
    try:
        shutil.copytree(world["home"], target / "home")
        subprocess.run(["mount", "-o", "remount,ro", str(target)], check=True, capture_output=True)
        yield target / "home"
    finally:
        subprocess.run(["umount", str(target)], capture_output=True)


def test_read_only_commands_work_on_a_read_only_home(world, fuzz_counts):
    tally = Tally()
    with read_only_copy(world) as home:
        with open_store(home / "data" / "macaron.db", readonly=True) as store:
            cid = store.list_conversations(limit=1)[0].id
        reading = [
            ["logs", "list"],
            ["logs", "show", cid],
            ["logs", "search", "reverse"],
            ["logs", "export"],
            ["models", "list"],
            ["adapters", "list"],
            ["adapters", "validate", str(world["adapter"])],
            ["plugins", "list"],
        ]
        cases = [Case(f"read-only:{' '.join(a)}", a, home, codes=(0,), bad=False, digest=False) for a in reading]
        cases.append(Case("read-only:doctor", ["doctor"], home, codes=(0, 1), digest=False))
        cases.append(
            Case(
                "read-only:logs import",
                ["logs", "import", str(world["root"] / "jsonl" / "bytes-0.jsonl")],
                home,
                codes=(1, 2),
                bad=True,
                digest=False,
            )
        )
        results = run_real(cases)
        record(tally, cases, results, real=True)
        doctor = results[-2]
        if "not writable" not in doctor["stdout"] and "read-only" not in doctor["stdout"]:
            tally.failures.append(f"doctor did not say the data folder is not writable: {doctor['stdout'][-300:]}")
        importing = results[-1]
        if "full" in importing.get("stderr", ""):
            tally.failures.append(f"a read-only store claimed a full disk: {importing['stderr']}")
    _tally(fuzz_counts, "read-only home", tally)


def test_a_real_process_per_surface(world, fuzz_counts):
    """The same judgement on the command a user runs: one fresh `python -m macaron_local` each."""
    tally = Tally()
    folder = world["root"] / "real"
    folder.mkdir()
    fifo = folder / "fifo.gguf"
    os.mkfifo(fifo)
    settings_fifo = copy_home(world, "real-settings-fifo")
    (settings_fifo / "config" / "settings.toml").unlink()
    os.mkfifo(settings_fifo / "config" / "settings.toml")
    bombs = write_bombs(folder / "bombs", lambda n: n in ("array_count_2e40_u8", "regions_overlap"))
    bad_peft = _peft_variant(
        world, "real-dora", config={"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_dora": True}
    )
    record_ = json.loads(world["export"].splitlines()[0])
    record_["turns"][0]["ttft_ms"] = MARK
    nan_export = folder / "nan.jsonl"
    nan_export.write_text(json.dumps(record_).replace(f'"{MARK}"', "NaN"))
    a_file = folder / "home-file"
    a_file.write_text("x")
    cases = [
        *(
            Case(f"real:bomb:{n}", ["adapters", "validate", str(p)], copy_home(world, f"real-{n}"), bad=True)
            for n, p in bombs.items()
        ),
        Case(
            "real:peft-dora",
            ["adapters", "convert", str(bad_peft), str(folder / "o.gguf")],
            copy_home(world, "r1"),
            bad=True,
        ),
        Case("real:jsonl-nan", ["logs", "import", str(nan_export)], copy_home(world, "r2"), bad=True),
        Case("real:plugin-fifo", ["plugins", "import", str(fifo), "--slot", "L0"], copy_home(world, "r3"), bad=True),
        Case("real:settings-fifo", ["logs", "list"], settings_fifo, bad=True),
        Case("real:home-is-a-file", ["logs", "list"], a_file, codes=(1, 2), bad=True, digest=False),
    ]
    record(tally, cases, run_real(cases), real=True)
    _tally(fuzz_counts, "one real process per surface", tally)


# ----------------------------------------------------------------- in-process properties (Hypothesis)
IN_PROCESS = Tally()
EXAMPLES = scaled(150)


def _count(name: str, seconds: float) -> None:
    IN_PROCESS.cases += 1
    if seconds > IN_PROCESS.slowest[0]:
        IN_PROCESS.slowest = (seconds, name)


@pytest.fixture(scope="module")
def valid_adapter_bytes(world) -> bytes:
    return world["adapter"].read_bytes()


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    edits=st.lists(st.tuples(st.integers(0, 4095), st.integers(0, 255)), min_size=1, max_size=8),
    cut=st.integers(0, 1 << 16),
)
def test_property_mutated_headers_raise_one_error_or_validate(world, valid_adapter_bytes, tmp_path_factory, edits, cut):
    data = bytearray(valid_adapter_bytes)
    for pos, value in edits:
        data[pos % len(data)] = value
    path = tmp_path_factory.getbasetemp() / "hypothesis.gguf"
    path.write_bytes(bytes(data[: max(cut, 24)]) if cut < len(data) else bytes(data))
    start = time.perf_counter()
    try:
        validate_adapter(path, world["base"])
    except MacaronError as exc:
        assert "\n" not in str(exc)
    seconds = time.perf_counter() - start
    _count("mutated header", seconds)
    assert seconds < 2.0


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    text=st.text(max_size=200)
    | st.recursive(
        st.none() | st.booleans() | st.floats() | st.integers() | st.text(),
        lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
        max_leaves=30,
    ).map(lambda v: json.dumps(v, allow_nan=True))
)
def test_property_json_is_standard_bounded_and_storable(text):
    start = time.perf_counter()
    try:
        value = load_json(text, "property")
    except MacaronError:
        value = None
    else:
        json.dumps(value, allow_nan=False).encode("utf-8")  # what passed is standard, storable JSON
    _count("json", time.perf_counter() - start)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    values=st.dictionaries(
        st.sampled_from(
            [
                "model",
                "n_ctx",
                "n_threads",
                "max_tokens",
                "temperature",
                "kv_switch",
                "learning_paused",
                "daemon",
                "system_prompt",
                "other",
            ]
        ),
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=80) | st.lists(st.integers()),
    )
)
def test_property_settings_are_refused_by_key_or_usable(values):
    from macaron_local.settings import DEFAULTS

    start = time.perf_counter()
    try:
        check_settings(values, "property", DEFAULTS)
    except MacaronError as exc:
        assert any(key in str(exc) for key in values)
    else:
        for key in ("n_ctx", "max_tokens", "n_threads"):
            if key in values:
                assert isinstance(values[key], int) and values[key] >= 0
        if "temperature" in values:
            assert math.isfinite(values["temperature"]) and values["temperature"] >= 0
    _count("settings", time.perf_counter() - start)


@settings(max_examples=EXAMPLES, deadline=None)
@given(text=st.text())
def test_property_printable_leaves_no_control_character(text):
    shown = printable(text)
    assert not any(ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in shown)
    _count("printable", 0.0)


def test_zz_in_process_counts(fuzz_counts):
    fuzz_counts["in-process properties (hypothesis)"] = IN_PROCESS.line()
    assert IN_PROCESS.cases > 0 or SCALE < 1


def test_writer_rejects_nothing_the_validator_needs(world, tmp_path):
    """Guard for the range check: a trained-size adapter is far inside MAX_UPDATE."""
    adapter = random_adapter(world["model"], 8, seed=9, magnitude=2.0)
    path = write_adapter(tmp_path / "big.gguf", adapter)
    validate_adapter(path, world["base"])
