"""Model manifests: which base GGUF a model is, where it comes from, and its four expert slots.

Built-in manifests ship in the top-level `models/` folder (packaged into the wheel as
`macaron_local/manifests`); models the user adds with `macaron models add` are written as TOML
manifests into the config directory. A slot with no adapter is served by the base model.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from macaron_local.errors import InvalidInputError, ModelError
from macaron_local.manifest_schema import NAME_PATTERN, check_manifest
from macaron_local.settings import Settings, write_private_atomic
from macaron_local.untrusted import load_toml, read_text

#: Macaron's hard-routed experts, in routing-label order.
SLOTS: dict[str, str] = {"L0": "Chat", "L1": "Agent", "L2": "Coding", "L3": "UI"}
SOURCE_KINDS = ("package", "huggingface", "path")


def builtin_manifest_dir() -> Path:
    """`macaron_local/manifests` in a wheel; the repository's `models/` in a source checkout."""
    packaged = Path(__file__).parent / "manifests"
    return packaged if packaged.is_dir() else Path(__file__).parents[1] / "models"


@dataclass(frozen=True)
class Source:
    """Where a file comes from: a Python package, a Hugging Face repo, or a local path."""

    kind: str
    file: str = ""
    package: str = ""
    repo: str = ""
    revision: str = "main"
    subfolder: str = ""
    format: str = "gguf"  # adapters only: "gguf" or "peft"
    sha256: str | None = None
    size: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> Source:
        kind = data.get("source")
        if kind not in SOURCE_KINDS:
            raise InvalidInputError(f"{where}: source must be one of {', '.join(SOURCE_KINDS)}")
        known = {f for f in cls.__dataclass_fields__ if f != "kind"}
        return cls(kind=kind, **{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.kind}
        defaults = {
            "file": "",
            "package": "",
            "repo": "",
            "revision": "main",
            "subfolder": "",
            "format": "gguf",
        }
        for key in (*defaults, "sha256", "size"):
            value = getattr(self, key)
            if value is not None and value != defaults.get(key):
                out[key] = value
        return out


@dataclass(frozen=True)
class Expert:
    slot: str
    name: str
    source: Source | None = None  # None: the slot is served by the base model


@dataclass(frozen=True)
class Manifest:
    name: str
    description: str
    architecture: str
    base: Source
    experts: dict[str, Expert] = field(default_factory=dict)
    origin: Path | None = None
    builtin: bool = False
    #: A Hugging Face checkpoint of the same base for the trainer, when transformers or mlx-lm
    #: cannot rebuild the model from its GGUF (a new MoE architecture); None: train from the GGUF.
    trainer_checkpoint: str | None = None

    @classmethod
    def from_toml(cls, path: Path, builtin: bool = False) -> Manifest:
        where = str(path)
        data = load_toml(read_text(path, "model manifest"), f"model manifest {where}")
        check_manifest(data, where, tuple(SLOTS))
        experts = {}
        for slot, default_name in SLOTS.items():
            entry = data.get("experts", {}).get(slot, {})
            source = Source.from_dict(entry, f"{where} [experts.{slot}]") if "source" in entry else None
            experts[slot] = Expert(slot, entry.get("name", default_name), source)
        return cls(
            name=data["name"],
            description=data.get("description", ""),
            architecture=data.get("architecture", ""),
            base=Source.from_dict(data["base"], f"{where} [base]"),
            experts=experts,
            origin=path,
            builtin=builtin,
            trainer_checkpoint=data.get("training", {}).get("checkpoint"),
        )

    def to_toml(self) -> str:
        data: dict[str, Any] = {
            "name": self.name,
            "description": self.description,
            "architecture": self.architecture,
            "base": self.base.to_dict(),
            "experts": {},
        }
        for slot, expert in self.experts.items():
            entry: dict[str, Any] = {"name": expert.name}
            if expert.source:
                entry.update(expert.source.to_dict())
            data["experts"][slot] = entry
        return tomli_w.dumps(data)


class Catalog:
    """All known models (built-in and user-added) and where their files live on this machine."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings

    def manifests(self) -> list[Manifest]:
        found: dict[str, Manifest] = {}
        for path in sorted(builtin_manifest_dir().glob("*.toml")):
            manifest = Manifest.from_toml(path, builtin=True)
            found[manifest.name] = manifest
        user_dir = self.settings.user_manifests_dir
        if user_dir.is_dir():
            for path in sorted(user_dir.glob("*.toml")):
                manifest = Manifest.from_toml(path)
                found.setdefault(manifest.name, manifest)  # built-ins cannot be shadowed
        return list(found.values())

    def get(self, name: str) -> Manifest:
        for manifest in self.manifests():
            if manifest.name == name:
                return manifest
        known = ", ".join(m.name for m in self.manifests())
        raise ModelError(f"unknown model {name!r} (known: {known})")

    def default(self) -> Manifest:
        return self.get(str(self.settings.get("model")))

    def model_dir(self, manifest: Manifest) -> Path:
        return self.settings.models_dir / manifest.name

    def base_path(self, manifest: Manifest) -> Path:
        """Where the base GGUF is (or will be, once pulled)."""
        return self.source_path(manifest, manifest.base)

    def source_path(self, manifest: Manifest, source: Source) -> Path:
        if source.kind == "package":
            try:
                root = importlib.resources.files(source.package)
            except ModuleNotFoundError:
                raise ModelError(
                    f"model {manifest.name!r} needs the Python package {source.package!r}; reinstall macaron-local"
                ) from None
            return Path(str(root / source.file))
        if source.kind == "path":
            return Path(source.file).expanduser()
        return self.model_dir(manifest) / source.subfolder / source.file

    def expert_path(self, manifest: Manifest, slot: str) -> Path | None:
        """The GGUF adapter serving `slot`, or None when the base model serves it."""
        expert = manifest.experts.get(slot)
        if expert is None or expert.source is None:
            return None
        if expert.source.kind == "path" and expert.source.format == "gguf":
            return Path(expert.source.file).expanduser()
        return self.model_dir(manifest) / "experts" / f"{slot}.gguf"

    def add_local(self, name: str, path: str | Path) -> Manifest:
        """Register a local GGUF base model under `name` (its header is checked first)."""
        from macaron_local.adapters.validate import BaseModelInfo

        if not NAME_PATTERN.fullmatch(name):
            raise InvalidInputError(f"model name {name!r} must be lowercase letters, digits, '.', '_' or '-'")
        if any(m.name == name for m in self.manifests()):
            raise InvalidInputError(f"a model named {name!r} already exists")
        gguf_path = Path(path).expanduser().resolve()
        info = BaseModelInfo.from_gguf(gguf_path)
        if info.kind == "adapter":
            raise InvalidInputError(f"{gguf_path} is an adapter, not a base model")
        manifest = Manifest(
            name=name,
            description=f"{info.name} (local file)",
            architecture=info.architecture,
            base=Source(kind="path", file=str(gguf_path), size=gguf_path.stat().st_size),
            experts={slot: Expert(slot, label) for slot, label in SLOTS.items()},
        )
        target = self.settings.user_manifests_dir / f"{name}.toml"
        self.settings.ensure_dirs()
        target.parent.mkdir(parents=True, exist_ok=True)
        write_private_atomic(target, manifest.to_toml().encode())
        return Manifest.from_toml(target)
