"""Convert a PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`) to GGUF.

This is how Macaron's published experts and third-party plugins arrive. The converter maps HF
module names to GGUF tensor names with gguf-py's own tensor map (the same table llama.cpp's
converters use), folds PEFT's per-module scaling into `B` so one FLOAT32 alpha serves every pair,
and for architecture `llama` permutes the q/k rows of `B` exactly as the model converter permuted
the base weights. The result is validated against the base before it is written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from macaron_local.adapters import qwen35moe
from macaron_local.adapters.gguf_lora import PlannedPair, Progress, permute_llama_qk_rows, write_planned
from macaron_local.adapters.peft_config import check_config, check_output, check_tensors, read_config
from macaron_local.adapters.validate import BaseModelInfo, validate_adapter
from macaron_local.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: PEFT prefixes saved module names with these; they are not part of the HF module path.
PEFT_PREFIXES = ("base_model.model.",)
#: Architectures whose HF->GGUF conversion permutes q/k rows for rotary embedding.
PERMUTED_QK = {"llama": {"attn_q": "n_head", "attn_k": "n_head_kv"}}


class SafetensorsFile:
    """Reads one tensor at a time from a `.safetensors` file (no mmap: resident memory stays one
    tensor, however big the file). numpy has no bfloat16, so BF16 is widened by hand."""

    WIDTHS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as handle:
            head = handle.read(8)
            if len(head) < 8:
                raise ValueError("file shorter than a safetensors header")
            header_len = int.from_bytes(head, "little")
            if header_len > 100 * 1024 * 1024:
                raise ValueError(f"implausible header length {header_len}")
            header = json.loads(handle.read(header_len))
        self._base = 8 + header_len
        self._info = {k: v for k, v in header.items() if k != "__metadata__"}
        size = path.stat().st_size
        for key, info in self._info.items():
            start, end = (int(x) for x in info["data_offsets"])
            if info["dtype"] not in self.WIDTHS:
                raise AdapterError(f"{path}: tensor {key} has unsupported dtype {info['dtype']}")
            count = int(np.prod(info["shape"], dtype=np.int64))
            if end - start != count * np.dtype(self.WIDTHS[info["dtype"]]).itemsize or self._base + end > size:
                raise AdapterError(f"{path}: tensor {key} does not fit its declared shape or the file (truncated?)")

    def names(self) -> list[str]:
        return list(self._info)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(int(d) for d in self._info[key]["shape"])

    def read(self, key: str) -> np.ndarray:
        """The tensor as float32."""
        info = self._info[key]
        start, end = (int(x) for x in info["data_offsets"])
        with self.path.open("rb") as handle:
            handle.seek(self._base + start)
            raw = np.frombuffer(handle.read(end - start), dtype=self.WIDTHS[info["dtype"]])
        widened = (raw.astype(np.uint32) << 16).view(np.float32) if info["dtype"] == "BF16" else raw
        return widened.astype(np.float32, copy=False).reshape(self.shape(key))


def _module_scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scaling for one module: alpha/r, or alpha/sqrt(r) with rsLoRA; patterns override."""
    alpha = float(config.get("lora_alpha", rank))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if module.endswith(pattern):
            alpha = float(value)
    denom = math.sqrt(rank) if config.get("use_rslora") else rank
    return alpha / denom


def tensor_name_map(base: BaseModelInfo) -> gguf.TensorNameMap | None:
    """gguf-py's HF <-> GGUF tensor name map for the base's architecture (None: unknown to gguf-py)."""
    arch = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == base.architecture), None)
    return None if arch is None else gguf.get_tensor_name_map(arch, max(base.n_layer, 1))


def gguf_name(name_map: gguf.TensorNameMap, hf_parameter: str) -> str | None:
    """`model.layers.0.self_attn.q_proj.weight` -> `blk.0.attn_q.weight` (None: no such tensor)."""
    return name_map.get_name(hf_parameter, try_suffixes=(".weight", ".bias"))


def qk_permuted_heads(base: BaseModelInfo, tensor: str) -> int | None:
    """The head count whose q/k row permutation the HF->GGUF conversion applied to `tensor`
    (None: its rows are in HF order)."""
    role = tensor.split(".")[-2] if tensor.startswith("blk.") else ""
    key = PERMUTED_QK.get(base.architecture, {}).get(role)
    return getattr(base, key) if key else None


@np.errstate(all="ignore")  # overflow in untrusted values is checked and reported, never warned
@contextlib.contextmanager
def _shapes_must_fit(peft_dir: Path) -> Iterator[None]:
    """A tensor whose shape the base's layout cannot take (numpy's reshape or index errors) is
    one AdapterError line, wherever in the conversion it is met."""
    try:
        yield
    except (ValueError, IndexError, ZeroDivisionError) as exc:
        why = " ".join(str(exc).split())[:160]
        raise AdapterError(f"{peft_dir}: tensor shapes do not fit the base model ({why})") from None


def convert_peft_dir(
    peft_dir: str | os.PathLike[str],
    base: BaseModelInfo,
    out_path: str | os.PathLike[str],
    dtype: str = "F16",
    task_name: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Convert a PEFT LoRA directory for `base` into a validated GGUF adapter at `out_path`.

    Streams: tensors are read, placed and written one pair at a time, so a 14 GiB adapter
    converts in a little more memory than its largest pair. `dtype` is the GGUF storage type
    (one of STORAGE_TYPES); `progress(done_bytes, total_bytes, tensor)` follows the writing.
    """
    peft_dir = Path(peft_dir)
    config_path, weights_path = peft_dir / CONFIG_FILE, peft_dir / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterError(f"{peft_dir}: a PEFT adapter needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    check_output(out_path)
    config = read_config(config_path)  # an object of standard JSON, or one line
    check_config(config, peft_dir)
    try:
        weights = SafetensorsFile(weights_path)
    except AdapterError:
        raise
    except Exception as exc:
        raise AdapterError(f"{peft_dir}: unreadable PEFT adapter ({' '.join(str(exc).split())[:160]})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{peft_dir}: {CONFIG_FILE} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"{peft_dir}: peft_type {config.get('peft_type')!r} is not LORA")

    # Structure from the header alone (pairs, ranks, targets); values are checked as each tensor
    # is encoded, so the file is never held in memory whole.
    check_tensors(config, {name: weights.shape(name) for name in weights.names()}, peft_dir)
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    with _shapes_must_fit(peft_dir):  # planning reshapes what it can see from the header
        planned = plan_conversion(config, weights, base, peft_dir)
    out_path = Path(out_path)
    tmp = out_path.with_name(f".{out_path.name}.unvalidated")
    try:
        with _shapes_must_fit(peft_dir):  # and the rest as each tensor is computed
            write_planned(tmp, base.architecture, alpha, planned, dtype=dtype, task_name=task_name, progress=progress)
        validate_adapter(tmp, base)  # values and update range, read from block scales: about 1 ms per MB
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def _hf_module(key: str) -> str:
    """PEFT's saved name without its wrapper prefixes; a VLM's text tower named as the text model."""
    for prefix in PEFT_PREFIXES:
        key = key.removeprefix(prefix)
    for vlm in ("model.language_model.", "language_model.model."):
        if key.startswith(vlm):
            key = "model." + key.removeprefix(vlm)
    return key


def _group_modules(weights: SafetensorsFile, where: Path) -> dict[str, dict[str, str]]:
    """{module path: {"A" | "B" | "EA" | "EB": safetensors key}}; anything else is an error."""
    modules: dict[str, dict[str, str]] = {}
    for key in weights.names():
        name = _hf_module(key)
        for marker, half in (
            (".lora_A.", "A"),
            (".lora_B.", "B"),
            (".lora_embedding_A", "EA"),
            (".lora_embedding_B", "EB"),
        ):
            if marker in name:
                modules.setdefault(name.split(marker)[0], {})[half] = key
                break
        else:
            raise AdapterError(f"{where}: tensor {key} is not a LoRA A/B weight")
    for module, halves in modules.items():
        if not ({"A", "B"} <= halves.keys() or {"EA", "EB"} <= halves.keys()):
            raise AdapterError(f"{where}: module {module} lacks lora_A or lora_B")
    return modules


def plan_conversion(config: dict, weights: SafetensorsFile, base: BaseModelInfo, where: Path) -> list[PlannedPair]:
    """Decide, from the safetensors header alone, every GGUF pair the adapter becomes (their
    values are read when written). Every PEFT tensor lands in exactly one pair or is an error."""
    name_map = tensor_name_map(base)
    if name_map is None:
        raise AdapterError(f"{where}: architecture {base.architecture!r} is unknown to gguf-py")
    modules = _group_modules(weights, where)
    if not modules:
        raise AdapterError(f"{where}: the PEFT adapter holds no LoRA weights")
    alpha = float(config.get("lora_alpha", config.get("r", 8)))
    context = _Context(config, weights, base, name_map, alpha, where)
    planned: list[PlannedPair] = []
    if base.architecture == qwen35moe.ARCH:
        planned += _plan_qwen35moe(modules, context)  # takes the modules it places out of `modules`
    planned += [_plan_module(module, halves, context) for module, halves in sorted(modules.items())]
    names = [p.name for p in planned]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise AdapterError(f"{where}: several PEFT modules adapt the same tensor {dup[0]}")
    return sorted(planned, key=lambda p: p.name)


@dataclass(frozen=True)
class _Context:
    config: dict
    weights: SafetensorsFile
    base: BaseModelInfo
    name_map: gguf.TensorNameMap
    alpha: float
    where: Path

    def target(self, module: str) -> str:
        target = gguf_name(self.name_map, module + ".weight")
        if target is None or target not in self.base.tensors:
            arch = self.base.architecture
            raise AdapterError(f"{self.where}: module {module} has no tensor in the {arch} base model")
        if target.endswith("_norm.weight"):  # llama.cpp's loader skips these without a word
            raise AdapterError(f"{self.where}: module {module} is a norm ({target}); llama.cpp ignores LoRA on norms")
        return target

    def b_factor(self, module: str, rank: int) -> float:
        """What B is multiplied by so llama.cpp's alpha/rank gives PEFT's scale for `module`."""
        return _module_scale(self.config, module, rank) * rank / self.alpha


def _plan_module(module: str, halves: dict[str, str], ctx: _Context) -> PlannedPair:
    """A module whose GGUF tensor is the HF weight itself (up to llama's q/k row permutation)."""
    target = ctx.target(module)
    st = ctx.weights
    if "EA" in halves:
        # Embedding LoRA: A is (r, vocab), B is (embd, r); llama.cpp wants (vocab, r) and (embd, r).
        a_shape, b_shape = st.shape(halves["EA"])[::-1], st.shape(halves["EB"])
        rank = a_shape[-1]

        def make() -> tuple[np.ndarray, np.ndarray]:
            return st.read(halves["EA"]).T, st.read(halves["EB"]) * ctx.b_factor(module, rank)

        return PlannedPair(target, a_shape, b_shape, make)

    a_shape, b_shape = st.shape(halves["A"]), st.shape(halves["B"])
    if len(a_shape) != 2 or len(b_shape) != 2:
        raise AdapterError(f"{ctx.where}: module {module} has lora_A {a_shape} / lora_B {b_shape}; expected matrices")
    rank = a_shape[0]
    heads = qk_permuted_heads(ctx.base, target)

    def make() -> tuple[np.ndarray, np.ndarray]:
        b = st.read(halves["B"]) * ctx.b_factor(module, rank)
        if heads is not None:
            b = permute_llama_qk_rows(b, heads)
        return st.read(halves["A"]), b

    return PlannedPair(target, a_shape, b_shape, make)


_QWEN_LAYER = r"model\.layers\.(\d+)\."
_PACKED_EXPERTS = re.compile(_QWEN_LAYER + r"mlp\.experts(?:\.base_layer)*$")
_ONE_EXPERT = re.compile(_QWEN_LAYER + r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")
_LINEAR_IN = re.compile(_QWEN_LAYER + r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a)$")
_LINEAR_OUT = re.compile(_QWEN_LAYER + r"linear_attn\.out_proj$")
_FUSED_LINEAR = re.compile(_QWEN_LAYER + r"linear_attn\.(in_proj_qkvz|in_proj_ba)$")


def _plan_qwen35moe(modules: dict[str, dict[str, str]], ctx: _Context) -> list[PlannedPair]:
    """The qwen35moe modules whose GGUF tensors are split, stacked or reordered from HF's."""
    dims = qwen35moe.LinearAttentionDims.from_hparams(ctx.base.hparams)
    planned: list[PlannedPair] = []
    per_expert: dict[tuple[int, str], dict[int, dict[str, str]]] = {}
    for module in sorted(modules):
        halves = modules[module]
        if m := _FUSED_LINEAR.match(module):
            raise AdapterError(
                f"{ctx.where}: module {module} is Qwen3-Next's fused {m.group(2)}; Qwen3.5 splits it "
                "(in_proj_qkv/in_proj_z/in_proj_b/in_proj_a)"
            )
        if m := _LINEAR_IN.match(module):
            planned.append(_plan_linear_in(module, halves, m.group(2), dims, ctx))
        elif _LINEAR_OUT.match(module):
            planned.append(_plan_linear_out(module, halves, dims, ctx))
        elif m := _PACKED_EXPERTS.match(module):
            planned += _plan_packed_experts(module, halves, int(m.group(1)), ctx)
        elif m := _ONE_EXPERT.match(module):
            per_expert.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = halves
        else:
            continue
        del modules[module]
    for (layer, proj), experts in sorted(per_expert.items()):
        planned.append(_plan_expert_modules(layer, proj, experts, ctx))
    return planned


def _plan_linear_in(module: str, halves: dict[str, str], proj: str, dims, ctx: _Context) -> PlannedPair:
    target = ctx.target(module)
    st = ctx.weights
    a_shape, b_shape = st.shape(halves["A"]), st.shape(halves["B"])
    rank = a_shape[0]
    rows = qwen35moe.linear_attn_rows(proj, dims)
    if rows is not None and len(rows) != b_shape[0]:
        raise AdapterError(
            f"{ctx.where}: {module}.lora_B has {b_shape[0]} rows; the base's head layout needs {len(rows)}"
        )

    def make() -> tuple[np.ndarray, np.ndarray]:
        b = st.read(halves["B"]) * ctx.b_factor(module, rank)
        return st.read(halves["A"]), b if rows is None else b[rows]

    return PlannedPair(target, a_shape, b_shape, make)


def _plan_linear_out(module: str, halves: dict[str, str], dims, ctx: _Context) -> PlannedPair:
    target = ctx.target(module)
    st = ctx.weights
    a_shape, b_shape = st.shape(halves["A"]), st.shape(halves["B"])
    rank = a_shape[0]
    cols = qwen35moe.out_proj_columns(dims)
    if cols is not None and len(cols) != a_shape[1]:
        raise AdapterError(
            f"{ctx.where}: {module}.lora_A has {a_shape[1]} columns; the base's head layout needs {len(cols)}"
        )

    def make() -> tuple[np.ndarray, np.ndarray]:
        a = st.read(halves["A"])
        return a if cols is None else a[:, cols], st.read(halves["B"]) * ctx.b_factor(module, rank)

    return PlannedPair(target, a_shape, b_shape, make)


def _expert_shapes(layer: int, ctx: _Context) -> tuple[int, int, int, bool]:
    """(n_expert, hidden, ff, fused gate_up) from the base's expert tensors of `layer`."""
    base = ctx.base.tensors
    down = base.get(f"blk.{layer}.ffn_down_exps.weight")
    if down is None or len(down) != 3:
        raise AdapterError(f"{ctx.where}: layer {layer} has no routed experts (ffn_down_exps) in the base model")
    n_expert, hidden, ff = down
    fused = f"blk.{layer}.ffn_gate_up_exps.weight" in base
    return n_expert, hidden, ff, fused


def _plan_packed_experts(module: str, halves: dict[str, str], layer: int, ctx: _Context) -> list[PlannedPair]:
    """PEFT's `target_parameters` LoRA on a 3-D expert parameter: lora_A (r * E, in) is
    expert-major (row e * r + k), lora_B (out, r * E) is rank-major (column k * E + e)."""
    st = ctx.weights
    n_expert, hidden, ff, fused = _expert_shapes(layer, ctx)
    a_shape, b_shape = st.shape(halves["A"]), st.shape(halves["B"])
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1] or a_shape[0] % n_expert:
        raise AdapterError(
            f"{ctx.where}: {module} lora_A {a_shape} / lora_B {b_shape} are not a packed LoRA over {n_expert} experts"
        )
    rank = a_shape[0] // n_expert
    if (a_shape[1], b_shape[0]) == (hidden, 2 * ff):
        kind = "gate_up"
    elif (a_shape[1], b_shape[0]) == (ff, hidden):
        kind = "down"
    else:
        raise AdapterError(
            f"{ctx.where}: {module} lora_A {a_shape} / lora_B {b_shape} fit neither gate_up_proj nor down_proj "
            f"of the base (hidden {hidden}, expert ff {ff})"
        )
    scale = ctx.b_factor(module, rank)

    def stacked() -> tuple[np.ndarray, np.ndarray]:
        a = st.read(halves["A"]).reshape(n_expert, rank, a_shape[1])
        b = st.read(halves["B"]).reshape(b_shape[0], rank, n_expert).transpose(2, 0, 1) * scale
        return a, np.ascontiguousarray(b)

    a3 = (n_expert, rank, a_shape[1])
    if kind == "down":
        return [PlannedPair(f"blk.{layer}.ffn_down_exps.weight", a3, (n_expert, hidden, rank), stacked)]
    if fused:
        return [PlannedPair(f"blk.{layer}.ffn_gate_up_exps.weight", a3, (n_expert, 2 * ff, rank), stacked)]

    def half(which: int):
        def make() -> tuple[np.ndarray, np.ndarray]:
            a, b = stacked()
            return a, np.ascontiguousarray(qwen35moe.split_gate_up(b)[which])

        return make

    return [
        PlannedPair(f"blk.{layer}.ffn_gate_exps.weight", a3, (n_expert, ff, rank), half(0)),
        PlannedPair(f"blk.{layer}.ffn_up_exps.weight", a3, (n_expert, ff, rank), half(1)),
    ]


def _plan_expert_modules(layer: int, proj: str, experts: dict[int, dict[str, str]], ctx: _Context) -> PlannedPair:
    """Per-expert modules `mlp.experts.N.<proj>` stacked into one 3-D pair; an expert without a
    LoRA gets zeros (its update is exactly nothing)."""
    st = ctx.weights
    n_expert, hidden, ff, fused = _expert_shapes(layer, ctx)
    role = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}[proj]
    where = f"{ctx.where}: model.layers.{layer}.mlp.experts.*.{proj}"
    if fused and proj != "down_proj":
        raise AdapterError(
            f"{where}: the base fuses gate and up (ffn_gate_up_exps); per-expert gate/up LoRA cannot go there"
        )
    if bad := sorted(e for e in experts if not 0 <= e < n_expert):
        raise AdapterError(f"{where}: expert {bad[0]} does not exist (the base has {n_expert})")
    shapes = {(st.shape(h["A"]), st.shape(h["B"])) for h in experts.values()}
    if len(shapes) != 1:
        raise AdapterError(f"{where}: the experts' LoRA shapes differ ({len(shapes)} kinds)")
    ((a_shape, b_shape),) = shapes
    rank = a_shape[0]
    sample = f"model.layers.{layer}.mlp.experts.{min(experts)}.{proj}"

    def make() -> tuple[np.ndarray, np.ndarray]:
        a = np.zeros((n_expert, *a_shape), np.float32)
        b = np.zeros((n_expert, *b_shape), np.float32)
        for e, h in experts.items():
            a[e] = st.read(h["A"])
            b[e] = st.read(h["B"]) * ctx.b_factor(sample, rank)
        return a, b

    return PlannedPair(f"blk.{layer}.{role}.weight", (n_expert, *a_shape), (n_expert, *b_shape), make)
