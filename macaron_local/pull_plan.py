"""What `macaron models pull NAME` would fetch, without fetching it (`--dry-run`, first-run screen).

The plan lists every file: the base GGUF, each expert's files (a PEFT folder's config and
weights), and the routing profile's files, with the repository, revision, path, size and sha256
where known, and what each converted expert becomes. Sizes and sha256 come from the hub's file
metadata (huggingface_hub's `get_paths_info`, one request per repository); the profile's come
from the manifest's pins. Without a reachable hub the plan is still printed, with unknown sizes
as None and the manifest's upper bounds alongside, so the command works offline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from macaron_local import secrets
from macaron_local.catalog import Catalog, Manifest, Source
from macaron_local.errors import MacaronError


@dataclass
class PlannedFile:
    role: str  # "base", "expert" or "profile"
    slot: str | None
    source: str  # "huggingface", "github", "package" or "path"
    repo: str
    revision: str
    path: str  # inside the repo (or the local path)
    dest: str  # where it lands on this machine
    present: bool  # already here and verified by an earlier pull (or, local, simply exists)
    size: int | None = None  # exact bytes, from the hub (or a profile's pin)
    sha256: str | None = None  # from the hub's LFS metadata, the manifest's pin, or None
    size_bound: int | None = None  # the manifest's upper bound, when it states one
    on_hub: bool | None = None  # None: not asked (offline, or not a hub file)
    url: str | None = None  # profile files: the pinned raw URL they are fetched from


@dataclass
class PullPlan:
    model: str
    files: list[PlannedFile] = field(default_factory=list)
    convert: list[dict[str, Any]] = field(default_factory=list)
    hub: dict[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int | None:
        """Exact bytes of all listed files, or None while any size is unknown."""
        sizes = [f.size for f in self.files]
        return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)

    @property
    def bound_bytes(self) -> int:
        """Bytes to download, each file at its exact size where known, else its stated bound."""
        return sum(f.size if f.size is not None else (f.size_bound or 0) for f in self.files)

    @property
    def disk_bytes(self) -> int:
        """Free disk a pull from nothing needs: the files plus the converted experts (bounded)."""
        return self.bound_bytes + sum(c["size_bound"] for c in self.convert)

    @property
    def missing_on_hub(self) -> list[PlannedFile]:
        return [f for f in self.files if f.on_hub is False]

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "files": [asdict(f) for f in self.files],
            "convert": self.convert,
            "total_bytes": self.total_bytes,
            "bound_bytes": self.bound_bytes,
            "disk_bytes": self.disk_bytes,
            "hub": self.hub,
        }


def plan_pull(catalog: Catalog, manifest: Manifest, *, online: bool = True, token: str | None = None) -> PullPlan:
    """The files a pull of `manifest` fetches; with `online`, sizes and sha256 asked of the hub."""
    from macaron_local.download import (
        _endpoint,
        _hub_file,
        _peft_files,
        _recorded_complete,
        converted_size_bound,
    )
    from macaron_local.profile_fetch import profile_items

    plan = PullPlan(model=manifest.name)
    hub_items = []  # (PlannedFile, _HubFile)

    def add_hub(role: str, slot: str | None, source: Source, label: str, dest: Path, name: str | None) -> None:
        item = _hub_file(catalog, manifest, source, label, dest, None, name)
        planned = PlannedFile(
            role=role,
            slot=slot,
            source="huggingface",
            repo=source.repo,
            revision=source.revision or "main",
            path=item.repo_path,
            dest=str(dest),
            present=_recorded_complete(item),
            sha256=item.pinned_sha256,
            size_bound=item.declared_size,
        )
        plan.files.append(planned)
        hub_items.append(planned)

    def add_local(role: str, slot: str | None, source: Source, path: Path) -> None:
        plan.files.append(
            PlannedFile(role, slot, source.kind, "", "", str(path), str(path), path.exists(), size_bound=source.size)
        )

    base_path = catalog.base_path(manifest)
    if manifest.base.kind == "huggingface":
        add_hub("base", None, manifest.base, f"base {base_path.name}", base_path, None)
    else:
        add_local("base", None, manifest.base, base_path)

    for slot, expert in manifest.experts.items():
        src = expert.source
        if src is None:
            continue
        out = catalog.expert_path(manifest, slot)
        assert out is not None
        label = f"expert {slot} {expert.name}"
        if src.kind == "huggingface" and src.format == "peft":
            folder = catalog.model_dir(manifest) / src.subfolder
            for name in _peft_files(src, manifest, label):
                add_hub("expert", slot, src, f"{label} {name}", folder / name, name)
            bound = src.size or 0
            plan.convert.append(
                {
                    "slot": slot,
                    "from": str(folder),
                    "type": src.type or "F16",
                    "expect_rank": src.expect_rank,
                    "expect_base": src.expect_base or None,
                    "out": str(out),
                    "size_bound": converted_size_bound(bound, src.type or "F16") if bound else 0,
                }
            )
        elif src.kind == "huggingface":
            add_hub("expert", slot, src, label, out, None)
        else:
            add_local("expert", slot, src, catalog.source_path(manifest, src))

    profile = manifest.profile
    for entry in profile_items(catalog, manifest):
        assert profile is not None
        plan.files.append(
            PlannedFile(
                role="profile",
                slot=entry.entry.role,
                source=profile.source,
                repo=profile.repo,
                revision=profile.revision,
                path=entry.repo_path if entry.url else str(entry.dest),
                dest=str(entry.dest),
                present=entry.present,
                size=entry.entry.size,
                sha256=entry.entry.sha256,
                size_bound=entry.entry.size,
                url=entry.url,
            )
        )

    endpoint = _endpoint()
    plan.hub = {"endpoint": endpoint, "asked": False, "reachable": None, "error": None}
    if online and hub_items:
        _fill_from_hub(plan, hub_items, endpoint, token)
    return plan


def _fill_from_hub(plan: PullPlan, items: list[PlannedFile], endpoint: str, token: str | None) -> None:
    """One `get_paths_info` per (repo, revision): exact sizes, LFS sha256, and whether each exists."""
    from huggingface_hub import HfApi

    plan.hub["asked"] = True
    token_arg: str | bool = token or secrets.get_hf_token() or False
    api = HfApi(endpoint=endpoint, token=token_arg)
    groups: dict[tuple[str, str], list[PlannedFile]] = {}
    for item in items:
        groups.setdefault((item.repo, item.revision), []).append(item)
    for (repo, revision), members in groups.items():
        try:
            infos = api.get_paths_info(repo, [m.path for m in members], revision=revision, token=token_arg)
        except Exception as exc:
            reachable, reason = _describe(exc, endpoint, repo, revision)
            plan.hub["reachable"] = reachable if plan.hub["reachable"] is not False else False
            plan.hub["error"] = plan.hub["error"] or reason
            if reachable:  # the hub answered: the repo or revision is not there
                for member in members:
                    member.on_hub = False
            continue
        plan.hub["reachable"] = True if plan.hub["reachable"] is None else plan.hub["reachable"]
        found = {info.path: info for info in infos if getattr(info, "size", None) is not None}
        for member in members:
            info = found.get(member.path)
            member.on_hub = info is not None
            if info is None:
                continue
            member.size = info.size
            lfs_sha = getattr(getattr(info, "lfs", None), "sha256", None)
            if member.sha256 is None and lfs_sha:
                member.sha256 = lfs_sha


def _describe(exc: Exception, endpoint: str, repo: str, revision: str) -> tuple[bool, str]:
    """(did the hub answer?, one line): transport failures mean offline, not a missing file."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    from macaron_local.download import _is_transport_error, _status, _transport_reason

    if isinstance(exc, OfflineModeIsEnabled):
        return False, "HF_HUB_OFFLINE is set: sizes are unknown"
    if isinstance(exc, GatedRepoError):
        return True, f"access denied: {repo} is gated; accept its terms at {endpoint}/{repo}"
    if isinstance(exc, RepositoryNotFoundError):
        return True, f"repo {repo} not found or private ({_status(exc) or 404})"
    if isinstance(exc, RevisionNotFoundError):
        return True, f"repo {repo} has no revision {revision!r} (404)"
    if isinstance(exc, HfHubHTTPError):
        return _status(exc) not in (None, 429, 500, 502, 503, 504), (
            f"the model hub answered HTTP {_status(exc)} for {repo}"
        )
    if _is_transport_error(exc) or isinstance(exc, OSError):
        return False, f"cannot reach the model hub at {endpoint}: {_transport_reason(exc)}"
    if isinstance(exc, MacaronError):
        return False, str(exc)
    raise exc
