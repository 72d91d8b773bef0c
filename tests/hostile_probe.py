"""A hostile user's probe of every input surface, one real `macaron` process per case.

    python tests/hostile_probe.py [--out results.json]

Not part of pytest (the fuzz suite is): this is the check issue 16 asks to be re-run by hand,
with the classes the issue lists (GGUF header bombs and region tricks, keys of the wrong type,
finite values that overflow, terminal escapes; PEFT configs and shapes, unwritable outputs;
plugin manifests, names, FIFOs and links, foreign architectures; JSONL nesting, surrogates,
64-bit ids, NaN/Infinity; MACARON_HOME and settings.toml problems, broken user manifests).
It prints JSON: the counts of tracebacks, hangs, crashes, bad inputs accepted and other
failures, and every failing case.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

from conftest import write_random_adapter  # noqa: E402
from fuzz import Case, judge, run_real, template_store  # noqa: E402
from gguf_bombs import ARR, STR, U8, adapter_kvs, gguf_bytes, gstr, kv_str, kv_u32, tensor_info  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402
from tinymodels import TinyConfig, build_tiny_model  # noqa: E402

from macaron_local.adapters import LoraAdapter, LoraPair, write_adapter  # noqa: E402


def build_world(root: Path) -> dict:
    model = build_tiny_model(root / "tiny.gguf", TinyConfig(arch="llama"), seed=1)
    foreign = build_tiny_model(root / "qwen3.gguf", TinyConfig(arch="qwen3"), seed=2)
    home = root / "template"
    with template_store(home, model.path) as store:
        cid = store.new_conversation("tiny", "Be brief.")
        q = store.add_message(cid, "user", "hello", None)
        a, _ = store.add_reply(cid, q, "hi", {"model": "tiny", "ttft_ms": 3.0, "total_ms": 9.0})
        store.add_feedback(a, "rating", 1)
        buffer = io.StringIO()
        store.export_jsonl(buffer)
    return {
        "root": root,
        "model": model,
        "home": home,
        "good": write_random_adapter(root / "good.gguf", model, rank=4, seed=3, dtype="F32"),
        "foreign": write_random_adapter(root / "foreign.gguf", foreign, rank=4, seed=4, dtype="F32"),
        "export": buffer.getvalue(),
    }


class Probe:
    def __init__(self, world: dict) -> None:
        self.world = world
        self.cases: list[Case] = []
        self.n = 0

    def home(self) -> Path:
        self.n += 1
        target = self.world["root"] / "homes" / f"h{self.n}"
        shutil.copytree(self.world["home"], target)
        return target

    def file(self, name: str, data: bytes | str) -> Path:
        path = self.world["root"] / "files" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
        return path

    def add(self, name: str, argv: list[str], *, home: Path | None = None, codes=(2,), bad=True, timeout=10.0) -> None:
        self.cases.append(Case(name, argv, home or self.home(), codes=codes, bad=bad, timeout=timeout))


def gguf_cases(p: Probe) -> None:
    kvs = adapter_kvs()
    model = p.world["model"]

    def array(key: str, item: int, count: int, payload: bytes = b"") -> bytes:
        return gstr(key) + struct.pack("<IIQ", ARR, item, count) + payload

    files = {
        "array-count-beyond-file": gguf_bytes([*kvs, array("a.b", U8, 10**12)], pad_to=500_000),
        "array-strings-beyond-file": gguf_bytes([*kvs, array("a.b", STR, 10**9)], pad_to=500_000),
        "legal-5mb-array": gguf_bytes([*kvs, array("a.b", U8, 5_000_000, b"\0" * 5_000_000)]),
        "legal-200k-string-array": gguf_bytes(
            [*kvs, array("a.b", STR, 200_000, b"".join(gstr("t") for _ in range(200_000)))]
        ),
        "alignment-string": gguf_bytes([*kvs, kv_str("general.alignment", "64")], pad_to=4096),
        "general-type-u32": gguf_bytes([kvs[0], kv_u32("general.type", 1), *kvs[2:]], pad_to=4096),
        "adapter-type-u32": gguf_bytes([*kvs[:2], kv_u32("adapter.type", 1), kvs[3]], pad_to=4096),
        "name-with-escapes": gguf_bytes(kvs, [tensor_info("\x1b[2J\x1b]0;x\x07.lora_a", (4,), 0)], data=b"\0" * 32),
    }
    a = "blk.0.attn_q.weight"
    out, inp = model.weights[a].shape

    def regions(offsets: tuple[int, int]) -> bytes:
        infos = [tensor_info(f"{a}.lora_a", (inp, 4), offsets[0]), tensor_info(f"{a}.lora_b", (4, out), offsets[1])]
        size_a = inp * 4 * 4
        return gguf_bytes(kvs, infos, data=b"\0" * (size_a + out * 16 + 4096))

    size_a = inp * 4 * 4
    files.update(
        {
            "regions-overlap": regions((0, size_a // 2)),
            "regions-gap": regions((0, size_a + 64)),
            "regions-out-of-order": regions((size_a, 0)),
            "regions-wrap": regions((0, 2**64 - size_a)),
        }
    )
    for name, data in files.items():
        p.add(f"gguf:{name}", ["adapters", "validate", str(p.file(f"{name}.gguf", data))])
    rng = np.random.default_rng(0)
    for name, scale in (("overflow-float32", 1e20), ("overflow-half", 300.0)):
        pair = LoraPair(np.full((4, inp), scale, np.float32), np.full((out, 4), scale, np.float32))
        adapter = LoraAdapter("llama", 8.0, {a: pair})
        path = write_adapter(p.world["root"] / "files" / f"{name}.gguf", adapter, dtype="F32")
        p.add(f"gguf:{name}", ["adapters", "validate", str(path)])
    fine = LoraAdapter(
        "llama",
        8.0,
        {a: LoraPair(rng.normal(0, 0.1, (4, inp)).astype(np.float32), rng.normal(0, 0.1, (out, 4)).astype(np.float32))},
    )
    path = write_adapter(p.world["root"] / "files" / "fine.gguf", fine, dtype="Q8_0")
    p.add("gguf:fine (must pass)", ["adapters", "validate", str(path)], codes=(0,), bad=False)


def peft_cases(p: Probe) -> None:
    model = p.world["model"]
    root = p.world["root"] / "peft"
    base_config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj"]}

    def make(name: str, config: object = None, tensors: dict | None = None, raw: str | None = None) -> Path:
        directory = root / name
        directory.mkdir(parents=True)
        if tensors is None:
            tensors = {}
            for module, role in (("q_proj", "attn_q"), ("k_proj", "attn_k")):
                o, i = model.weights[f"blk.0.{role}.weight"].shape
                prefix = f"base_model.model.model.layers.0.self_attn.{module}"
                tensors[f"{prefix}.lora_A.weight"] = np.full((4, i), 0.01, np.float32)
                tensors[f"{prefix}.lora_B.weight"] = np.full((o, 4), 0.01, np.float32)
        (directory / "adapter_config.json").write_text(raw if raw is not None else json.dumps(config or base_config))
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        return directory

    def convert(name: str, directory: Path, out: Path | None = None, *, bad=True) -> None:
        target = out or (root / f"{name}.gguf")
        p.add(
            f"peft:{name}", ["adapters", "convert", str(directory), str(target)], codes=(2,) if bad else (0,), bad=bad
        )

    for key, value in (
        ("lora_alpha", "16"),
        ("lora_alpha", 0),
        ("r", 0),
        ("r", "4"),
        ("alpha_pattern", [1]),
        ("alpha_pattern", {"q_proj": None}),
        ("rank_pattern", "x"),
        ("use_dora", True),
        ("modules_to_save", ["embed_tokens"]),
        ("target_modules", ["v_proj"]),
    ):
        convert(f"{key}={value!r}", make(f"{key}-{value!r}".replace("/", "_"), config={**base_config, key: value}))
    convert("config-is-a-list", make("config-list", raw="[]"))
    convert("config-deep", make("config-deep", raw="[" * 200_000 + "]" * 200_000))
    o, i = model.weights["blk.0.attn_q.weight"].shape
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    convert(
        "qk-rows-do-not-fit",
        make(
            "qk",
            tensors={
                f"{q}.lora_A.weight": np.zeros((4, i), np.float32),
                f"{q}.lora_B.weight": np.zeros((o - 3, 4), np.float32),
            },
        ),
    )
    convert(
        "one-dim",
        make(
            "one-dim",
            tensors={f"{q}.lora_A.weight": np.zeros(i, np.float32), f"{q}.lora_B.weight": np.zeros((o, 4), np.float32)},
        ),
    )
    convert(
        "lone-embedding-half",
        make(
            "lone-emb",
            config={**base_config, "target_modules": ["embed_tokens"]},
            tensors={"base_model.model.model.embed_tokens.lora_embedding_B": np.zeros((16, 4), np.float32)},
        ),
    )
    good = make("good")
    a_file = p.file("peft-a-file", "x")
    (root / "out-dir.gguf").mkdir()
    convert("out-under-a-file", good, a_file / "x.gguf")
    convert("out-missing-folder", good, root / "nope" / "x.gguf")
    convert("out-is-a-directory", good, root / "out-dir.gguf")
    convert("good (must pass)", good, bad=False)


def plugin_cases(p: Probe) -> None:
    root = p.world["root"] / "plugins"
    root.mkdir()

    def folder(name: str, manifest: str, suffix: str = "toml") -> Path:
        directory = root / name
        directory.mkdir()
        shutil.copy(p.world["good"], directory / "a.gguf")
        (directory / f"plugin.{suffix}").write_text(manifest)
        return directory

    p.add("plugin:deep-toml", ["plugins", "import", str(folder("deep", "x = " + "[" * 20_000 + "]" * 20_000))])
    p.add("plugin:deep-json", ["plugins", "import", str(folder("deepj", "[" * 200_000 + "]" * 200_000, "json"))])
    p.add("plugin:name-newline-flag", ["plugins", "import", str(p.world["good"]), "--name", "x\n", "--slot", "L0"])
    p.add(
        "plugin:name-newline-manifest-json",
        ["plugins", "import", str(folder("nl", '{"name": "nl\\n\\n", "slot": "L0\\n"}', "json"))],
        codes=(0, 2),
        bad=None,
    )
    fifo = root / "f.gguf"
    os.mkfifo(fifo)
    ghost = p.home()
    (ghost / "config" / "models" / "ghost.toml").write_text(
        'name = "ghost"\narchitecture = "llama"\n[base]\nsource = "path"\nfile = "/missing/ghost.gguf"\n'
    )
    for name, path in (("fifo", fifo), ("dangling", root / "dangling.gguf")):
        if name == "dangling":
            os.symlink(root / "nothing", path)
        p.add(
            f"plugin:{name}-base-absent",
            ["plugins", "import", str(path), "--slot", "L0", "--base-model", "ghost"],
            home=ghost,
            timeout=5,
        )
    (root / "d" / "x.gguf").mkdir(parents=True)
    p.add(
        "plugin:dir-named-gguf-base-absent",
        ["plugins", "import", str(root / "d"), "--slot", "L0", "--base-model", "ghost"],
        home=ghost,
    )
    p.add(
        "plugin:foreign-arch-base-absent",
        ["plugins", "import", str(p.world["foreign"]), "--slot", "L0", "--base-model", "ghost"],
        home=ghost,
    )


def jsonl_cases(p: Probe) -> None:
    record = json.loads(p.world["export"].splitlines()[0])

    def variant(name: str, change, raw: str | None = None) -> None:
        data = json.loads(json.dumps(record))
        change(data)
        text = raw if raw is not None else json.dumps(data)
        p.add(f"jsonl:{name}", ["logs", "import", str(p.file(f"{name}.jsonl", text))])

    def set_(path, value):
        def change(data):
            target = data
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = value

        return change

    variant("feedback-id-2^63-1", set_(("feedback", 0, "id"), 2**63 - 1))
    variant("feedback-id-2^64", set_(("feedback", 0, "id"), 2**64))
    variant("prompt-tokens-2^70", set_(("turns", 0, "prompt_tokens"), 2**70))
    variant("value-beyond-int64", set_(("feedback", 0, "value"), -(2**63) - 1))
    variant("lone-surrogate", lambda d: None, raw=json.dumps(record).replace('"hello"', '"\\udc00hello"'))
    variant("nan-timing", lambda d: None, raw=json.dumps(record).replace('"ttft_ms": 3.0', '"ttft_ms": NaN'))
    variant(
        "infinity-timing", lambda d: None, raw=json.dumps(record).replace('"total_ms": 9.0', '"total_ms": Infinity')
    )
    variant("deep", lambda d: None, raw='{"a": ' + "[" * 300_000 + "]" * 300_000 + "}")
    fifo = p.world["root"] / "files" / "fifo.jsonl"
    os.mkfifo(fifo)
    p.add("jsonl:fifo", ["logs", "import", str(fifo)], timeout=5)
    escaped = json.loads(json.dumps(record).replace(record["conversation"]["id"], "esc-conv"))
    for m in escaped["messages"]:
        m["id"] = "esc-" + m["id"]
    leaf = escaped["conversation"]["current_leaf_id"]
    escaped["conversation"]["current_leaf_id"] = "esc-" + leaf if leaf else None
    for m in escaped["messages"]:
        m["parent_id"] = "esc-" + m["parent_id"] if m["parent_id"] else None
    for t in escaped["turns"]:
        t["id"], t["message_id"] = "esc-" + t["id"], "esc-" + t["message_id"]
    for f in escaped["feedback"]:
        f["message_id"] = "esc-" + f["message_id"]
    escaped["conversation"]["title"] = "\x1b[2J\x1b[31mred\x9b1m"
    home = p.home()
    p.add(
        "jsonl:escapes-import",
        ["logs", "import", str(p.file("esc.jsonl", json.dumps(escaped)))],
        home=home,
        codes=(0,),
        bad=False,
    )
    p.add("jsonl:escapes-list (printed escaped)", ["logs", "list"], home=home, codes=(0,), bad=False)


def environment_cases(p: Probe) -> None:
    a_file = p.file("home-file", "x")
    commands = (
        ["doctor"],
        ["logs", "list"],
        ["adapters", "list"],
        ["models", "list"],
        ["adapters", "validate", str(p.world["good"])],
    )
    for argv in commands:
        p.add(f"env:home-is-a-file:{argv[0]} {argv[1] if len(argv) > 1 else ''}", argv, home=a_file)
        p.add(f"env:home-under-a-file:{argv[0]} {argv[1] if len(argv) > 1 else ''}", argv, home=a_file / "sub")
    for name, prepare in (
        ("settings-directory", lambda c: (c / "settings.toml").mkdir()),
        ("settings-fifo", lambda c: os.mkfifo(c / "settings.toml")),
        ("settings-deep", lambda c: (c / "settings.toml").write_text("a = " + "[" * 50_000 + "]" * 50_000)),
        ("settings-n_ctx-text", lambda c: (c / "settings.toml").write_text('model = "tiny"\nn_ctx = "4k"')),
        ("settings-temperature-negative", lambda c: (c / "settings.toml").write_text("temperature = -1.0")),
        ("settings-kv_switch", lambda c: (c / "settings.toml").write_text('kv_switch = "both"')),
        (
            "manifest-experts-not-a-table",
            lambda c: (c / "models" / "bad.toml").write_text(
                'name = "bad"\nexperts = 5\n[base]\nsource = "path"\nfile = "/x.gguf"'
            ),
        ),
        (
            "manifest-file-a-number",
            lambda c: (c / "models" / "bad.toml").write_text('name = "bad"\n[base]\nsource = "path"\nfile = 7'),
        ),
        (
            "manifest-escapes-folder",
            lambda c: (c / "models" / "bad.toml").write_text(
                'name = "bad"\n[base]\nsource = "huggingface"\nrepo = "a/b"\nfile = "../../../etc/x.gguf"'
            ),
        ),
    ):
        home = p.home()
        config = home / "config"
        (config / "settings.toml").unlink()
        prepare(config)
        commands = [["doctor"], ["adapters", "validate", str(p.world["good"])]]
        if name.startswith("settings"):
            commands.append(["logs", "list"])  # logs never read model manifests
        for argv in commands:
            p.add(f"env:{name}:{argv[0]}", argv, home=home, codes=(1, 2) if argv == ["doctor"] else (2,), timeout=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="macaron-probe-") as tmp:
        world = build_world(Path(tmp))
        probe = Probe(world)
        for build in (gguf_cases, peft_cases, plugin_cases, jsonl_cases, environment_cases):
            build(probe)
        start = time.perf_counter()
        results = run_real(probe.cases)
        counts = {
            "cases": len(results),
            "tracebacks": 0,
            "hangs": 0,
            "crashes": 0,
            "bad_inputs_accepted": 0,
            "other_failures": 0,
        }
        failing = []
        for case, result in zip(probe.cases, results, strict=True):
            problems = judge(case, result)
            counts["tracebacks"] += any(x.startswith("traceback") for x in problems) and "signal" not in str(
                result.get("traceback")
            )
            counts["hangs"] += bool(result.get("hang"))
            counts["crashes"] += "signal" in str(result.get("traceback", ""))
            counts["bad_inputs_accepted"] += any(x.startswith("bad input accepted") for x in problems)
            counts["other_failures"] += any(
                not x.startswith(("traceback", "hang", "bad input accepted")) for x in problems
            )
            if problems:
                failing.append({"case": case.name, "problems": problems})
        slowest = max(results, key=lambda r: r.get("seconds", 0))
        report = {
            **counts,
            "slowest": [slowest["name"], round(slowest["seconds"], 2)],
            "seconds": round(time.perf_counter() - start, 1),
            "failing": failing,
        }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
