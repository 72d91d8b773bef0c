"""Plugins: LoRA modules made elsewhere, imported into the adapter registry.

A plugin is a GGUF LoRA file or a PEFT directory (`adapter_config.json` +
`adapter_model.safetensors`), with an optional small manifest (`plugin.toml` or `plugin.json`
inside the directory, or any file given with `--manifest`):

    name = "sql-helper"      # lowercase letters, digits, '.', '_' or '-'
    slot = "L2"              # an expert slot (L0..L3, or chat/agent/coding/ui) ...
    expert = "sql"           # ... or the name of a new expert it brings (one of the two)
    base_model = "embedded"  # a model of the catalog (default: the configured model)
    description = "..."      # optional

Command-line options win over the manifest. The adapter is checked before anything is stored:
against the base model's tensors when the base is on this machine (a PEFT directory is
converted against it, which needs the base); otherwise for structure only (GGUF, alpha, whole
pairs of consistent shapes, finite values), and the engine checks it against the base when it
loads. It is then registered as a candidate version tagged `plugin` and `plugin:<name>`: it is
never deployed by importing it, so an import cannot change what a chat serves.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf

from macaron_local.adapters.gguf_header import read_header
from macaron_local.adapters.gguf_lora import LORA_A, LORA_B, field_value
from macaron_local.adapters.validate import TOKEN_EMBD, AdapterReport, BaseModelInfo, validate_adapter
from macaron_local.catalog import NAME_PATTERN, SLOTS, Catalog
from macaron_local.errors import AdapterError, InvalidInputError
from macaron_local.router import normalize_slot
from macaron_local.store import Store
from macaron_local.store.registry import GcReport, Plugin, disk_errors
from macaron_local.untrusted import load_json, load_toml, open_regular, read_text

MANIFEST_NAMES = ("plugin.toml", "plugin.json")
MANIFEST_KEYS = ("name", "slot", "expert", "base_model", "description")
PEFT_CONFIG = "adapter_config.json"
#: Storage type for a converted PEFT plugin: half the size of F32, what `adapters convert` uses.
PEFT_DTYPE = "F16"


@dataclass(frozen=True)
class Imported:
    """The result of an import: the plugin as registered and the check its file passed."""

    plugin: Plugin
    report: AdapterReport


def read_manifest(path: Path) -> dict[str, str]:
    """A plugin manifest (TOML, or JSON for a `.json` file) as a dict of known string keys."""
    text = read_text(path, "plugin manifest")
    if path.suffix.lower() == ".json":
        data: Any = load_json(text, f"plugin manifest {path}")
    else:
        data = load_toml(text, f"plugin manifest {path}")
    if not isinstance(data, dict):
        raise InvalidInputError(f"plugin manifest {path} must be a table of keys")
    unknown = sorted(set(data) - set(MANIFEST_KEYS))
    if unknown:
        raise InvalidInputError(
            f"plugin manifest {path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(MANIFEST_KEYS)}"
        )
    for key, value in data.items():
        if not isinstance(value, str) or not value.strip():
            raise InvalidInputError(f"plugin manifest {path}: {key} must be a non-empty string")
    return {key: value.strip() for key, value in data.items()}


def locate(source: Path) -> tuple[str, Path]:
    """What `source` is: ("gguf", the file) or ("peft", the directory)."""
    if not source.is_dir():
        os.close(open_regular(source, "plugin"))  # a FIFO, socket or dangling link is refused here
        return "gguf", source
    if (source / PEFT_CONFIG).is_file():
        return "peft", source
    ggufs = sorted(source.glob("*.gguf"))
    if len(ggufs) == 1:
        os.close(open_regular(ggufs[0], "plugin"))  # e.g. a directory or FIFO named x.gguf
        return "gguf", ggufs[0]
    if ggufs:
        raise InvalidInputError(f"{source} holds {len(ggufs)} .gguf files; name the one to import")
    raise InvalidInputError(f"{source} is neither a GGUF LoRA file nor a PEFT directory ({PEFT_CONFIG} is missing)")


def _manifest_for(source: Path, manifest: Path | None) -> tuple[dict[str, str], Path | None]:
    if manifest is not None:
        return read_manifest(manifest), manifest
    folder = source if source.is_dir() else None
    for candidate in (folder / name for name in MANIFEST_NAMES) if folder else ():
        if candidate.is_file():
            return read_manifest(candidate), candidate
    return {}, None


def resolve_slot(value: str | None, *, new_expert_ok: bool = True) -> tuple[str, bool]:
    """(registry slot, is it a new expert): an expert slot by code or name, else a new expert."""
    if not value:
        raise InvalidInputError(
            f"say which expert the plugin is for: a slot ({', '.join(SLOTS)}) or a new expert's name (--slot)"
        )
    try:
        return normalize_slot(value), False
    except InvalidInputError:
        if not new_expert_ok or re.fullmatch(r"[Ll]\d+", value):
            raise  # "L7" is a mistyped slot, not a new expert
    if not NAME_PATTERN.fullmatch(value):
        raise InvalidInputError(
            f"a new expert's name must be lowercase letters, digits, '.', '_' or '-' (got {value!r})"
        )
    return value, True


def _plugin_name(name: str | None, source: Path) -> str:
    if name is None:
        stem = source.name.removesuffix(".gguf").lower().replace(" ", "-")
        if not NAME_PATTERN.fullmatch(stem):
            raise InvalidInputError(f"cannot make a plugin name from {source.name!r}; give one with --name")
        return stem
    if not NAME_PATTERN.fullmatch(name):
        raise InvalidInputError(f"plugin name {name!r} must be lowercase letters, digits, '.', '_' or '-'")
    return name


def own_shapes(path: Path) -> BaseModelInfo:
    """A stand-in base built from the adapter's own pair shapes, for when the real base is not
    on this machine: `validate_adapter` against it checks everything but the fit to the base."""
    read_header(path)  # every count, length and offset checked before gguf-py reads the file
    try:
        reader = gguf.GGUFReader(str(path))
        arch = field_value(reader, "general.architecture")
        halves: dict[str, dict[str, tuple[int, ...]]] = {}
        for tensor in reader.tensors:
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            for suffix, half in ((LORA_A, "a"), (LORA_B, "b")):
                if tensor.name.endswith(suffix):
                    halves.setdefault(tensor.name[: -len(suffix)], {})[half] = shape
    except Exception as exc:  # untrusted bytes: gguf-py raises many kinds
        why = " ".join(str(exc).split())[:160]
        raise AdapterError(f"{path}: not a valid GGUF file, truncated or corrupt ({why})") from None
    tensors = {}
    for name, pair in halves.items():
        a, b = pair.get("a"), pair.get("b")
        if a and b:
            # The base tensor each pair implies: (out, in) from B's rows and A's columns.
            tensors[name] = (a[0], b[0]) if name == TOKEN_EMBD else (*b[:-1], a[-1])
    if not isinstance(arch, str):
        raise AdapterError(f"{path}: general.architecture is missing")
    return BaseModelInfo(path=path, architecture=arch, tensors=tensors, name="(base not on this machine)")


def import_plugin(
    store: Store,
    catalog: Catalog,
    source: Path,
    *,
    name: str | None = None,
    slot: str | None = None,
    base_model: str | None = None,
    manifest: Path | None = None,
) -> Imported:
    """Check a plugin and register it (a candidate version and its plugin row, in one transaction)."""
    source = Path(source).expanduser()
    kind, adapter_path = locate(source)
    fields, manifest_path = _manifest_for(source, Path(manifest).expanduser() if manifest else None)
    plugin_name = _plugin_name(name or fields.get("name"), source)
    if "slot" in fields and "expert" in fields:
        raise InvalidInputError(f"plugin manifest {manifest_path}: give a slot or a new expert, not both")
    if slot:
        registry_slot, new_expert = resolve_slot(slot)
    elif "slot" in fields:
        registry_slot, new_expert = resolve_slot(fields["slot"], new_expert_ok=False)
    else:
        registry_slot, new_expert = resolve_slot(fields.get("expert"))
    model_name = base_model or fields.get("base_model")
    model = catalog.get(model_name) if model_name else catalog.default()
    if any(p.name == plugin_name for p in store.plugins()):
        raise InvalidInputError(f"a plugin named {plugin_name!r} is already imported; remove it first")

    base_path = catalog.base_path(model)
    base = BaseModelInfo.from_gguf(base_path) if base_path.is_file() else None
    with tempfile.TemporaryDirectory(prefix="macaron-plugin-") as tmp:
        if kind == "peft":
            if base is None:
                raise InvalidInputError(
                    f"converting the PEFT plugin needs the base model {model.name!r}, which is not on this machine; "
                    f"run `macaron models pull {model.name}` first, or import a GGUF adapter"
                )
            from macaron_local.adapters.peft import convert_peft_dir

            with disk_errors(Path(tmp)):
                adapter_path = convert_peft_dir(
                    source, base, Path(tmp) / f"{plugin_name}.gguf", dtype=PEFT_DTYPE, task_name=plugin_name
                )
        stand_in = own_shapes(adapter_path) if base is None else None
        if stand_in is not None and model.architecture and stand_in.architecture != model.architecture:
            raise AdapterError(
                f"{adapter_path}: adapter is for architecture {stand_in.architecture!r} "
                f"but {model.name} is {model.architecture!r}"
            )
        report = validate_adapter(adapter_path, base or stand_in)
        recorded = {
            **fields,
            "name": plugin_name,
            **({"manifest_file": str(manifest_path)} if manifest_path else {}),
        }
        plugin = store.add_plugin(
            adapter_path,
            name=plugin_name,
            slot=registry_slot,
            base_model=model.name,
            rank=max(report.ranks),
            new_expert=new_expert,
            format=kind,
            validated=base is not None,
            source=str(source.resolve()),
            manifest=recorded,
        )
    return Imported(plugin, report)


def remove_plugin(store: Store, name: str) -> tuple[Plugin, GcReport]:
    """Forget a plugin: its row, its version and tags, and its file unless another version uses it."""
    return store.remove_plugin(name)
