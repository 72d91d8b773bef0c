"""A tiny random qwen3_5_moe as a local model directory, and its registration in a catalog.

`python bench/tiny_tall.py OUT` writes OUT/model.gguf (the llama.cpp base, with a BPE
tokenizer and a ChatML template), OUT/checkpoint/ (the same weights as a transformers checkpoint:
the trainer's `[training] checkpoint`) and OUT/experts/L0..L3/ (random rank-8 PEFT experts on
every Macaron target, routed experts included). `register(settings, OUT)` adds it to a catalog
as a local model whose experts come from those PEFT directories (converted to GGUF for the
engine; the trainer stacks the PEFT files). Quality is meaningless: this proves Tall's code path.
"""

from __future__ import annotations

import copy
import sys
import tomllib
from pathlib import Path

import tomli_w

TESTS = Path(__file__).resolve().parent.parent / "tests"
SLOTS = ("L0", "L1", "L2", "L3")
GROUPS = ("attention", "linear_attention", "shared_expert")
CONTEXT = 4096  # the chat's system prompt and the regression passages need more than the test fixture's 256


def build(out: Path, seed: int = 0, *, text: bool = False) -> Path:
    """`text`: a byte-level vocabulary that spells any prompt and a Qwen3-style template (for
    the protocol's hops); otherwise the 64-token toy vocabulary and ChatML."""
    sys.path.insert(0, str(TESTS))
    import tiny_qwen35moe as tq

    n_vocab = tq.N_BYTE_VOCAB if text else tq.N_VOCAB
    model = tq.build_hf_model(seed, n_vocab=n_vocab, context=CONTEXT)
    template = tq.QWEN3_STYLE_TEMPLATE if text else tq.CHATML_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    tq.write_base_gguf(model, out / "model.gguf", chat_template=template)
    model.save_pretrained(out / "checkpoint")
    for i, slot in enumerate(SLOTS):
        expert = tq.add_random_lora(copy.deepcopy(model), 8, seed + 1 + i, groups=GROUPS, experts=True, alpha=2.0)
        expert.save_pretrained(out / "experts" / slot)
    return out


def register(settings, directory: Path, name: str = "tiny-qwen35moe") -> str:
    """Add the directory's model to the catalog with its trainer checkpoint and PEFT experts,
    convert each expert to the GGUF the engine serves, and make it the active model."""
    from macaron_local.adapters import BaseModelInfo
    from macaron_local.adapters.peft import convert_peft_dir
    from macaron_local.catalog import Catalog

    directory = Path(directory).resolve()
    catalog = Catalog(settings)
    manifest = catalog.add_local(name, directory / "model.gguf")
    (path,) = list(settings.user_manifests_dir.glob(f"{name}.toml"))
    data = tomllib.loads(path.read_text())
    data["training"] = {"checkpoint": str(directory / "checkpoint")}
    for slot in SLOTS:
        source = {"source": "path", "format": "peft", "file": str(directory / "experts" / slot)}
        data["experts"][slot] = {**data["experts"][slot], **source}
    path.write_bytes(tomli_w.dumps(data).encode())
    manifest = next(m for m in catalog.manifests() if m.name == name)
    base = BaseModelInfo.from_gguf(directory / "model.gguf")
    for slot in SLOTS:
        out = catalog.expert_path(manifest, slot)
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_peft_dir(directory / "experts" / slot, base, out, dtype="F32", task_name=slot)
    settings.save(model=name)
    return name


if __name__ == "__main__":
    print(build(Path(sys.argv[1])))
