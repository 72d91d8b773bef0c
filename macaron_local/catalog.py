"""Model manifests: which base GGUF a model is, where it comes from, and its four expert slots.

Built-in manifests ship in the top-level `models/` folder (packaged into the wheel as
`macaron_local/manifests`); models the user adds with `macaron models add` are written as TOML
manifests into the config directory. A slot with no adapter is served by the base model.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import re
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
#: Where a model's routing-profile files come from: pinned GitHub raw files fetched by `pull`,
#: files shipped in a Python package, or a local folder.
PROFILE_SOURCES = ("github", "package", "path")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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
    #: An upper bound in bytes (for the free-disk check); for a folder source, of all its files.
    size: int | None = None
    #: A folder source (`subfolder` in `repo`): the files to fetch from it; empty means the
    #: format's own files (for PEFT: adapter_config.json and adapter_model.safetensors).
    files: tuple[str, ...] = ()
    #: PEFT experts: the GGUF storage type the converted adapter is written in (F16, Q8_0, ...).
    type: str = ""
    #: PEFT experts: what the adapter_config.json must declare before it is converted (the
    #: checks Mind Lab's launcher makes): this LoRA rank, and a base whose name contains this.
    expect_rank: int | None = None
    expect_base: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> Source:
        kind = data.get("source")
        if kind not in SOURCE_KINDS:
            raise InvalidInputError(f"{where}: source must be one of {', '.join(SOURCE_KINDS)}")
        known = {f for f in cls.__dataclass_fields__ if f != "kind"}
        values = {k: v for k, v in data.items() if k in known}
        files = values.get("files", ())
        if not isinstance(files, list | tuple) or not all(isinstance(f, str) and f for f in files):
            raise InvalidInputError(f"{where}: files must be a list of file names")
        values["files"] = tuple(files)
        for key in ("size", "expect_rank"):
            if values.get(key) is not None and (not isinstance(values[key], int) or values[key] <= 0):
                raise InvalidInputError(f"{where}: {key} must be a positive integer")
        return cls(kind=kind, **values)

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
        for key in (*defaults, "sha256", "size", "type", "expect_rank", "expect_base"):
            value = getattr(self, key)
            if value is not None and value != defaults.get(key, ""):
                out[key] = value
        if self.files:
            out["files"] = list(self.files)
        return out


@dataclass(frozen=True)
class ProfileFile:
    """One file of a routing profile: its role (`route`, `lora`, `intro`, `summary`), its file
    name, and (for downloaded files, required) the sha256 and size of its exact bytes."""

    role: str
    file: str
    sha256: str | None = None
    size: int | None = None


@dataclass(frozen=True)
class Profile:
    """Where a model's routing-profile files live. Only their locations and pins are described
    here; what the texts mean is the routing protocol's business.

    `github`: fetched by `macaron models pull` from `repo` at `revision` (a full commit), each
    file checked by its sha256, into the model's folder. `package`: shipped in a Python package
    (`package`, then `subfolder`). `path`: a local folder (`subfolder`; relative to the manifest).
    """

    source: str
    repo: str = ""
    revision: str = ""
    subfolder: str = ""
    package: str = ""
    license: str = ""
    files: tuple[ProfileFile, ...] = ()

    def get(self, role: str) -> ProfileFile | None:
        return next((f for f in self.files if f.role == role), None)

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str) -> Profile:
        source = data.get("source")
        if source not in PROFILE_SOURCES:
            raise InvalidInputError(f"{where}: source must be one of {', '.join(PROFILE_SOURCES)}")
        entries = data.get("files", {})
        if not isinstance(entries, dict) or not entries:
            raise InvalidInputError(f"{where}: needs a [files] table (role = {{ file = ... }})")
        files = []
        for role, entry in entries.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or "/" in entry["file"]:
                raise InvalidInputError(f"{where}: files.{role} needs file = a file name")
            sha256 = entry.get("sha256")
            if sha256 is not None and not (isinstance(sha256, str) and _SHA256.fullmatch(sha256)):
                raise InvalidInputError(f"{where}: files.{role}.sha256 must be 64 lowercase hex digits")
            files.append(ProfileFile(role, entry["file"], sha256, entry.get("size")))
        profile = cls(
            source=source,
            repo=str(data.get("repo", "")),
            revision=str(data.get("revision", "")),
            # A local folder may be absolute; inside a repo or package, a path is relative.
            subfolder=str(data.get("subfolder", "")).rstrip("/").lstrip("/" if source != "path" else ""),
            package=str(data.get("package", "")),
            license=str(data.get("license", "")),
            files=tuple(files),
        )
        if source == "github" and (
            not profile.repo or not _COMMIT.fullmatch(profile.revision) or any(f.sha256 is None for f in files)
        ):
            raise InvalidInputError(
                f"{where}: files fetched from GitHub must be pinned: repo, revision = a full commit, "
                "and a sha256 for every file"
            )
        if source == "package" and not profile.package:
            raise InvalidInputError(f"{where}: a package profile needs package = the Python package")
        return profile

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source}
        for key in ("repo", "revision", "subfolder", "package", "license"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        out["files"] = {}
        for f in self.files:
            entry: dict[str, Any] = {"file": f.file}
            if f.sha256:
                entry["sha256"] = f.sha256
            if f.size is not None:
                entry["size"] = f.size
            out["files"][f.role] = entry
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
    #: The folder inside `trainer_checkpoint`'s repository that holds it (Mind Lab publishes
    #: Tall's BF16 base under `base/` next to the experts); None: the repository's root.
    trainer_subfolder: str | None = None
    #: The routing profile's files (None: the model has none; the router's fallback applies).
    profile: Profile | None = None

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
            trainer_subfolder=(data.get("training", {}).get("subfolder") or "").strip("/") or None,
            profile=Profile.from_dict(data["profile"], f"{where} [profile]") if "profile" in data else None,
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
        if self.trainer_checkpoint:
            training = {"checkpoint": self.trainer_checkpoint}
            data["training"] = training | ({"subfolder": self.trainer_subfolder} if self.trainer_subfolder else {})
        if self.profile is not None:
            data["profile"] = self.profile.to_dict()
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
            return _package_file(manifest, source.package, source.file)
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

    def trainer_checkpoint(self, manifest: Manifest) -> str | None:
        """What the trainer loads: the manifest's checkpoint (a repo id or a folder), or, when it
        names a subfolder, that folder inside the local copy (the hub cache, never downloaded
        here: learning makes no network access)."""
        repo, sub = manifest.trainer_checkpoint, manifest.trainer_subfolder
        if not repo or not sub:
            return repo
        local = Path(repo).expanduser()
        if local.is_dir():
            return str(local / sub)
        from huggingface_hub import snapshot_download

        fetch = f"download it once with `hf download {repo} --include '{sub}/*'`"
        try:
            root = Path(snapshot_download(repo, allow_patterns=[f"{sub}/*"], local_files_only=True))
        except Exception as exc:  # huggingface_hub's LocalEntryNotFoundError and kin
            if type(exc).__module__.split(".")[0] != "huggingface_hub":
                raise
            root = Path("/nonexistent")
        if not (root / sub / "config.json").is_file():
            raise ModelError(f"the trainer needs {repo} {sub}/ on this machine; {fetch}")
        return str(root / sub)

    def profile_path(self, manifest: Manifest, role: str) -> Path | None:
        """Where the profile file for `role` is (or will be, once pulled); None when the
        manifest's profile names no such file (or it has no profile)."""
        profile = manifest.profile
        entry = profile.get(role) if profile else None
        if profile is None or entry is None:
            return None
        if profile.source == "github":
            return self.model_dir(manifest) / "profile" / entry.file
        if profile.source == "package":
            return _package_file(manifest, profile.package, "/".join(p for p in (profile.subfolder, entry.file) if p))
        folder = Path(profile.subfolder).expanduser()
        if not folder.is_absolute() and manifest.origin is not None:
            folder = manifest.origin.parent / folder
        return folder / entry.file

    def profile_paths(self, manifest: Manifest) -> dict[str, Path]:
        """Every profile file of `manifest`, by role."""
        if manifest.profile is None:
            return {}
        paths = {f.role: self.profile_path(manifest, f.role) for f in manifest.profile.files}
        return {role: path for role, path in paths.items() if path is not None}

    def profile_text(self, manifest: Manifest, role: str) -> str | None:
        """The text of the profile file for `role`, checked against its pinned sha256; None when
        the manifest names no such file. A missing or altered file is a ModelError that says
        how to get it back."""
        path = self.profile_path(manifest, role)
        if path is None:
            return None
        entry = manifest.profile.get(role) if manifest.profile else None
        assert entry is not None
        try:
            data = path.read_bytes()
        except OSError:
            hint = f"; run `macaron models pull {manifest.name}`" if manifest.profile.source == "github" else ""
            missing = f"profile file {entry.file} of model {manifest.name!r} is missing ({path})"
            raise ModelError(missing + hint) from None
        if entry.sha256 and hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ModelError(
                f"profile file {path} of model {manifest.name!r} does not match its pinned sha256; "
                f"run `macaron models pull {manifest.name}` to fetch it again"
            )
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ModelError(f"profile file {path} of model {manifest.name!r} is not UTF-8 text") from None

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


def _package_file(manifest: Manifest, package: str, file: str) -> Path:
    """A file shipped inside an installed Python package (`file` may name a subfolder)."""
    try:
        root = importlib.resources.files(package)
    except ModuleNotFoundError:
        missing = f"model {manifest.name!r} needs the Python package {package!r}; reinstall macaron-local"
        raise ModelError(missing) from None
    return Path(str(root.joinpath(*file.split("/"))))
