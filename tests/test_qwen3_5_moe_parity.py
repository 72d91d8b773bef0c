"""Tall's architecture end to end on a tiny random qwen3_5_moe: llama.cpp (through the engine)
against transformers (+ peft), for the base and for a converted PEFT LoRA on every Macaron target.

Bounds (max |logit difference| over 16 tokens x 64 vocab, F32 KV cache):
- base alone: 1e-4 (measured about 2e-5);
- F32 adapter, each target group alone and all together: 1e-3 (measured about 2e-5), while each
  group moves the logits by more than 0.1, so a group llama.cpp ignored would fail on its own;
- quantized adapters: median |error| over the median |change the adapter makes|, see QUANT_BOUNDS.
"""

from __future__ import annotations

import copy
import json
import subprocess
import tomllib

import numpy as np
import pytest
import tiny_qwen35moe as tq
import tomli_w
from conftest import run_cli
from safetensors.numpy import save_file

from macaron_local.adapters import BaseModelInfo, read_adapter, validate_adapter, write_adapter
from macaron_local.adapters.gguf_lora import LoraPair
from macaron_local.adapters.peft import SafetensorsFile, convert_peft_dir
from macaron_local.engine import Engine, EngineConfig
from macaron_local.errors import AdapterError
from macaron_local.fit import TALL_EXPERT_TYPE, TYPE_ERROR_BOUND

TOKENS = [0, 5, 17, 33, 9, 9, 41, 2, 12, 60, 7, 1, 25, 25, 50, 3]
RANK = 32  # a multiple of 32, so lora_b rows (rank long) are quantized too, as at Tall's rank 64
ALL_GROUPS = ("attention", "linear_attention", "shared_expert")
#: GGUF tensors each group must produce (layer 0 is linear attention, layer 1 full attention).
GROUP_TENSORS = {
    "attention": {"blk.1.attn_q.weight", "blk.1.attn_k.weight", "blk.1.attn_v.weight", "blk.1.attn_output.weight"},
    "linear_attention": {
        "blk.0.attn_qkv.weight",
        "blk.0.attn_gate.weight",
        "blk.0.ssm_beta.weight",
        "blk.0.ssm_alpha.weight",
        "blk.0.ssm_out.weight",
    },
    "routed_experts": {"blk.0.ffn_gate_exps.weight", "blk.0.ffn_up_exps.weight", "blk.0.ffn_down_exps.weight"},
    "shared_expert": {
        "blk.0.ffn_gate_shexp.weight",
        "blk.0.ffn_up_shexp.weight",
        "blk.0.ffn_down_shexp.weight",
        "blk.0.ffn_gate_inp_shexp.weight",
    },
}
#: Upper bounds on median |llama.cpp - transformers| / median |adapter's own change|, per type.
#: Measured on this model (seeded): F16 0.002, BF16 0.015, Q8_0 0.05, Q5_1 0.29, Q5_0 0.49,
#: Q4_1 0.52, Q4_0 0.66. llama.cpp also quantizes the activations it multiplies with a block
#: type, which is why Q8_0 is further from F32 than BF16 is.
QUANT_BOUNDS = {"F16": 0.01, "BF16": 0.05, "Q8_0": TYPE_ERROR_BOUND, "Q5_1": 1.0, "Q5_0": 1.0, "Q4_1": 1.0, "Q4_0": 1.0}


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> tq.TinyQwen35Moe:
    return tq.build(tmp_path_factory.mktemp("qwen35moe"), seed=0)


@pytest.fixture(scope="session")
def base_logits(tiny) -> np.ndarray:
    return tq.hf_logits(tiny.model, TOKENS)


@pytest.fixture(scope="session")
def engine(tiny):
    with Engine(EngineConfig(model_path=tiny.gguf_path, n_ctx=64, kv_f32=True, n_threads=2)) as engine:
        yield engine


def llama_logits(engine: Engine, adapter=None) -> np.ndarray:
    engine.set_adapters([engine.load_adapter(adapter)] if adapter else [])
    return engine.logits(TOKENS)


_PEFT: dict[tuple, tuple[object, np.ndarray]] = {}


def peft_adapter(tiny, tmp_path_factory, groups: tuple[str, ...], experts: bool, seed: int = 1):
    """(saved PEFT directory, transformers+peft logits), cached per session."""
    key = (groups, experts, seed)
    if key not in _PEFT:
        model = tq.add_random_lora(copy.deepcopy(tiny.model), RANK, seed, groups=groups, experts=experts)
        directory = tmp_path_factory.mktemp("peft")
        model.save_pretrained(directory)
        _PEFT[key] = (directory, tq.hf_logits(model, TOKENS))
    return _PEFT[key]


def test_qwen3_5_moe_base_logits_match_transformers(engine, base_logits):
    assert np.abs(llama_logits(engine) - base_logits).max() <= 1e-4
    assert base_logits.std() > 0.5  # logits spread: a wrong layer would show


@pytest.mark.parametrize("group", [*ALL_GROUPS, "routed_experts", "all"])
def test_qwen3_5_moe_f32_adapter_per_target_group_matches_peft(tiny, tmp_path_factory, engine, base_logits, group):
    groups = ALL_GROUPS if group == "all" else tuple(g for g in ALL_GROUPS if g == group)
    experts = group in ("routed_experts", "all")
    directory, want = peft_adapter(tiny, tmp_path_factory, groups, experts)
    out = convert_peft_dir(directory, BaseModelInfo.from_gguf(tiny.gguf_path), directory / "a.gguf", dtype="F32")
    names = set(read_adapter(out).pairs)
    expected = set().union(*GROUP_TENSORS.values()) if group == "all" else GROUP_TENSORS[group]
    assert expected <= names
    assert np.abs(want - base_logits).max() > 0.1  # the group alone changes the answer
    assert np.abs(llama_logits(engine, out) - want).max() <= 1e-3


def test_qwen3_5_moe_experts_stacked_in_the_wrong_order_fail(tiny, tmp_path_factory, engine):
    directory, want = peft_adapter(tiny, tmp_path_factory, (), True)
    out = convert_peft_dir(directory, BaseModelInfo.from_gguf(tiny.gguf_path), directory / "a.gguf", dtype="F32")
    adapter = read_adapter(out)
    assert np.abs(llama_logits(engine, out) - want).max() <= 1e-3
    for name, pair in adapter.pairs.items():  # expert e gets expert e+1's pair
        adapter.pairs[name] = LoraPair(np.roll(pair.a, 1, axis=0), np.roll(pair.b, 1, axis=0))
    wrong = write_adapter(directory / "wrong.gguf", adapter, dtype="F32")
    assert np.abs(llama_logits(engine, wrong) - want).max() > 0.05


def test_qwen3_5_moe_fused_gate_up_base_takes_one_expert_pair(tiny, tmp_path_factory, tmp_path):
    """A base converted with --fuse-gate-up-exps has one ffn_gate_up_exps: PEFT's packed gate_up
    LoRA is exactly that layout (gate rows, then up rows), so it becomes one pair."""
    directory, want = peft_adapter(tiny, tmp_path_factory, (), True)
    fused = tq.write_base_gguf(tiny.model, tmp_path / "fused.gguf", fuse_gate_up=True)
    out = convert_peft_dir(directory, BaseModelInfo.from_gguf(fused), tmp_path / "a.gguf", dtype="F32")
    names = set(read_adapter(out).pairs)
    assert "blk.0.ffn_gate_up_exps.weight" in names and "blk.0.ffn_gate_exps.weight" not in names
    with Engine(EngineConfig(model_path=fused, n_ctx=64, kv_f32=True, n_threads=2)) as engine:
        assert np.abs(llama_logits(engine, out) - want).max() <= 1e-3


def _unpack_experts(packed_dir, out_dir, n_expert: int) -> None:
    """Rewrite PEFT's packed expert LoRA as per-expert `experts.N.{gate,up,down}_proj` modules."""
    weights = SafetensorsFile(packed_dir / "adapter_model.safetensors")
    tensors = {}
    for key in weights.names():
        values = weights.read(key)
        if ".mlp.experts." not in key:
            tensors[key] = values
            continue
        module = key.split(".lora_")[0]
        a_key, b_key = module + ".lora_A.weight", module + ".lora_B.weight"
        if key != a_key:
            continue
        a = weights.read(a_key).reshape(n_expert, RANK, -1)
        b = weights.read(b_key).reshape(-1, RANK, n_expert).transpose(2, 0, 1)
        prefix = module.split(".mlp.experts")[0] + ".mlp.experts"
        projs = (
            {"gate_proj": slice(0, tq.MOE_FF), "up_proj": slice(tq.MOE_FF, None)} if a.shape[-1] == tq.HIDDEN else {}
        )
        for e in range(n_expert):
            for proj, rows in projs.items():
                tensors[f"{prefix}.{e}.{proj}.lora_A.weight"] = np.ascontiguousarray(a[e])
                tensors[f"{prefix}.{e}.{proj}.lora_B.weight"] = np.ascontiguousarray(b[e][rows])
            if not projs:
                tensors[f"{prefix}.{e}.down_proj.lora_A.weight"] = np.ascontiguousarray(a[e])
                tensors[f"{prefix}.{e}.down_proj.lora_B.weight"] = np.ascontiguousarray(b[e])
    out_dir.mkdir()
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text((packed_dir / "adapter_config.json").read_text())


def test_qwen3_5_moe_per_expert_modules_convert_like_the_packed_layout(tiny, tmp_path_factory, engine):
    directory, want = peft_adapter(tiny, tmp_path_factory, (), True)
    base = BaseModelInfo.from_gguf(tiny.gguf_path)
    packed = read_adapter(convert_peft_dir(directory, base, directory / "packed.gguf", dtype="F32"))
    _unpack_experts(directory, directory / "per-expert", tq.N_EXPERTS)
    out = convert_peft_dir(directory / "per-expert", base, directory / "per-expert.gguf", dtype="F32")
    per_expert = read_adapter(out)
    assert set(per_expert.pairs) == set(packed.pairs)
    for name, pair in packed.pairs.items():
        np.testing.assert_array_equal(per_expert.pairs[name].a, pair.a)
        np.testing.assert_allclose(per_expert.pairs[name].b, pair.b, rtol=1e-6)
    assert np.abs(llama_logits(engine, out) - want).max() <= 1e-3


@pytest.mark.parametrize("dtype", list(QUANT_BOUNDS))
def test_qwen3_5_moe_quantized_adapter_error_within_stated_bound(tiny, tmp_path_factory, engine, base_logits, dtype):
    directory, want = peft_adapter(tiny, tmp_path_factory, ALL_GROUPS, True)
    out = convert_peft_dir(directory, BaseModelInfo.from_gguf(tiny.gguf_path), directory / f"{dtype}.gguf", dtype=dtype)
    report = validate_adapter(out, BaseModelInfo.from_gguf(tiny.gguf_path))
    assert dtype in report.storage_types  # the 3-D expert tensors too: every row is 32-aligned
    relative = np.median(np.abs(llama_logits(engine, out) - want)) / np.median(np.abs(want - base_logits))
    assert relative <= QUANT_BOUNDS[dtype]
    smaller = ("Q5_1", "Q5_0", "Q4_1", "Q4_0")
    if dtype in smaller:  # Tall's expert type is the smallest inside the bound; these are smaller
        assert relative > TYPE_ERROR_BOUND and TALL_EXPERT_TYPE not in smaller


def test_qwen3_5_moe_unplaceable_tensors_are_one_line_errors(tiny, tmp_path):
    base = BaseModelInfo.from_gguf(tiny.gguf_path)
    directory = tmp_path / "peft"
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8}))
    cases = {
        "model.layers.0.input_layernorm": ((4, tq.HIDDEN), (tq.HIDDEN, 4), "ignores LoRA on norms"),
        "model.layers.0.linear_attn.in_proj_qkvz": ((4, tq.HIDDEN), (8, 4), "fused in_proj_qkvz"),
        "model.visual.blocks.0.attn.qkv": ((4, 8), (8, 4), "has no tensor"),
        "model.layers.0.mlp.experts": ((4 * tq.N_EXPERTS, 7), (5, 4 * tq.N_EXPERTS), "fit neither"),
        "model.layers.0.mlp.experts.9.down_proj": ((4, tq.MOE_FF), (tq.HIDDEN, 4), "does not exist"),
    }
    for module, (a, b, message) in cases.items():
        prefix = f"base_model.model.{module}"
        save_file(
            {f"{prefix}.lora_A.weight": np.zeros(a, np.float32), f"{prefix}.lora_B.weight": np.zeros(b, np.float32)},
            str(directory / "adapter_model.safetensors"),
        )
        with pytest.raises(AdapterError, match=message) as caught:
            convert_peft_dir(directory, base, tmp_path / "x.gguf")
        assert "\n" not in str(caught.value)
    assert not (tmp_path / "x.gguf").exists()


def test_qwen3_5_moe_validator_checks_3d_expert_shapes(tiny, tmp_path):
    base = BaseModelInfo.from_gguf(tiny.gguf_path)
    n, ff, hidden = tq.N_EXPERTS, tq.MOE_FF, tq.HIDDEN
    good = LoraPair(np.zeros((n, 4, hidden), np.float32), np.zeros((n, ff, 4), np.float32))
    bad = {
        "too few experts": LoraPair(good.a[:-1], good.b[:-1]),
        "2-D": LoraPair(good.a[0], good.b[0]),
        "rank mismatch": LoraPair(good.a, np.zeros((n, ff, 5), np.float32)),
    }
    from macaron_local.adapters import LoraAdapter

    ok = write_adapter(tmp_path / "ok.gguf", LoraAdapter("qwen35moe", 8.0, {"blk.0.ffn_gate_exps.weight": good}))
    assert validate_adapter(ok, base).n_pairs == 1
    for why, pair in bad.items():
        path = write_adapter(tmp_path / "bad.gguf", LoraAdapter("qwen35moe", 8.0, {"blk.0.ffn_gate_exps.weight": pair}))
        with pytest.raises(AdapterError, match="has shape"):
            validate_adapter(path, base)
        assert why


def test_qwen3_5_moe_cli_convert_q8_0_validates_loads_and_answers(tiny, tmp_path_factory, tmp_path):
    directory, _ = peft_adapter(tiny, tmp_path_factory, ALL_GROUPS, True)
    home = tmp_path / "home"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, home=home)

    assert run("models", "add", "tiny-moe", str(tiny.gguf_path)).returncode == 0
    out = tmp_path / "expert.gguf"
    converted = run("adapters", "convert", str(directory), str(out), "--type", "Q8_0", "--model", "tiny-moe")
    assert converted.returncode == 0, converted.stderr
    assert converted.stderr == "" and "(Q8_0)" in converted.stdout  # piped: no bar, one result line
    checked = run("adapters", "validate", str(out), "--model", "tiny-moe", "--json")
    assert checked.returncode == 0, checked.stderr
    assert "Q8_0" in json.loads(checked.stdout)["types"]
    (manifest,) = list(home.rglob("tiny-moe.toml"))
    data = tomllib.loads(manifest.read_text())
    data["experts"]["L0"] = {**data["experts"]["L0"], "source": "path", "file": str(out), "format": "gguf"}
    manifest.write_bytes(tomli_w.dumps(data).encode())
    answered = run("ask", "--model", "tiny-moe", "--expert", "L0", "--max-tokens", "4", "--json", "hello")
    assert answered.returncode == 0, answered.stderr
    reply = json.loads(answered.stdout)
    assert reply["adapters"] and reply["adapters"][0] == out.name


def test_qwen3_5_moe_vlm_named_adapter_converts_like_the_text_model(tiny, tmp_path_factory):
    """Qwen3.6-35B-A3B is a vision-language checkpoint: a LoRA trained on it names the text
    tower `model.language_model.layers...`; it must land on the same GGUF tensors."""
    directory, _ = peft_adapter(tiny, tmp_path_factory, ALL_GROUPS, True)
    base = BaseModelInfo.from_gguf(tiny.gguf_path)
    weights = SafetensorsFile(directory / "adapter_model.safetensors")
    renamed = directory.parent / "vlm"
    renamed.mkdir()
    save_file(
        {
            k.replace("model.model.layers.", "model.model.language_model.layers."): weights.read(k)
            for k in weights.names()
        },
        str(renamed / "adapter_model.safetensors"),
    )
    (renamed / "adapter_config.json").write_text((directory / "adapter_config.json").read_text())
    text = read_adapter(convert_peft_dir(directory, base, directory / "text.gguf", dtype="F32"))
    vlm = read_adapter(convert_peft_dir(renamed, base, renamed / "vlm.gguf", dtype="F32"))
    assert set(vlm.pairs) == set(text.pairs)
    for name, pair in text.pairs.items():
        np.testing.assert_array_equal(vlm.pairs[name].b, pair.b)


def test_qwen3_5_moe_converter_refuses_values_llama_cpp_would_serve_as_garbage(tiny, tmp_path):
    base = BaseModelInfo.from_gguf(tiny.gguf_path)
    directory = tmp_path / "peft"
    directory.mkdir()
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 4}))
    prefix = "base_model.model.model.layers.0.mlp.shared_expert_gate"
    for value, dtype, message in ((np.nan, "F32", "NaN"), (1e6, "F16", "beyond F16's range")):
        b = np.ones((1, 4), np.float32)
        b[0, 2] = value
        save_file(
            {f"{prefix}.lora_A.weight": np.ones((4, tq.HIDDEN), np.float32), f"{prefix}.lora_B.weight": b},
            str(directory / "adapter_model.safetensors"),
        )
        with pytest.raises(AdapterError, match=message):
            convert_peft_dir(directory, base, tmp_path / "x.gguf", dtype=dtype)
    assert not (tmp_path / "x.gguf").exists() and not list(tmp_path.glob(".x.gguf*"))
