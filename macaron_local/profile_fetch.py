"""Bring a model's routing-profile files (a few KB of text) onto this machine, pinned and checked.

A Tall profile is a handful of Markdown files in Mind Lab's MIT-licensed harness repository on
GitHub. They are fetched from GitHub's raw-content host at a full commit (never a branch), each
checked against the sha256 of its exact bytes in the manifest before it is written (atomically)
into the model's folder. This is part of `macaron models pull`, an explicit download; nothing
else fetches them. The files are small, so a plain `urllib` GET is enough: no resume, no cache.
Profiles shipped in a package or a local folder are only checked.
"""

from __future__ import annotations

import hashlib
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from macaron_local.catalog import Catalog, Manifest, ProfileFile
from macaron_local.errors import DownloadError, ModelError

GITHUB_RAW = "https://raw.githubusercontent.com"
#: Overrides the raw-content host (a mirror, or the tests' server on 127.0.0.1).
RAW_URL_ENV = "MACARON_GITHUB_RAW_URL"
#: A profile file is instructions for a model, not data: anything larger is not one.
MAX_PROFILE_BYTES = 1 << 20
TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ProfileItem:
    """One profile file: where it comes from (a URL for GitHub sources) and where it goes."""

    entry: ProfileFile
    repo_path: str
    url: str | None
    dest: Path

    @property
    def present(self) -> bool:
        """On disk with the pinned bytes (or, unpinned, simply on disk)."""
        try:
            data = self.dest.read_bytes()
        except OSError:
            return False
        return self.entry.sha256 is None or hashlib.sha256(data).hexdigest() == self.entry.sha256


def raw_host() -> str:
    return (os.environ.get(RAW_URL_ENV) or GITHUB_RAW).rstrip("/")


def profile_items(catalog: Catalog, manifest: Manifest) -> list[ProfileItem]:
    """Every profile file of `manifest` with its source URL (None unless fetched) and location."""
    profile = manifest.profile
    if profile is None:
        return []
    items = []
    for entry in profile.files:
        dest = catalog.profile_path(manifest, entry.role)
        assert dest is not None
        repo_path = "/".join(p for p in (profile.subfolder, entry.file) if p)
        url = None
        if profile.source == "github":
            url = f"{raw_host()}/{profile.repo}/{profile.revision}/{quote(repo_path)}"
        items.append(ProfileItem(entry, repo_path, url, dest))
    return items


def fetch_profile(catalog: Catalog, manifest: Manifest) -> tuple[list[Path], list[str], int]:
    """Make every profile file present and verified. Returns (paths, labels skipped, bytes fetched)."""
    paths: list[Path] = []
    skipped: list[str] = []
    fetched = 0
    for item in profile_items(catalog, manifest):
        label = f"profile {item.entry.file}"
        if item.present:
            skipped.append(label)
        elif item.url is None:
            what = "missing" if not item.dest.is_file() else "not the pinned file (sha256 differs)"
            raise ModelError(f"model {manifest.name!r}: {label} at {item.dest} is {what}")
        else:
            fetched += _download(item, manifest)
        paths.append(item.dest)
    return paths, skipped, fetched


def _download(item: ProfileItem, manifest: Manifest) -> int:
    assert item.url is not None and manifest.profile is not None
    repo, commit = manifest.profile.repo, manifest.profile.revision[:12]
    where = f"{repo} {item.repo_path} at {commit}"
    request = urllib.request.Request(item.url, headers={"User-Agent": "macaron-local"})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:  # noqa: S310 (https/http only)
            data = response.read(MAX_PROFILE_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise DownloadError(f"GitHub answered HTTP {exc.code} for {where}") from None
    except (TimeoutError, urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        text = "timed out" if isinstance(reason, TimeoutError) else (str(reason).splitlines() or ["?"])[0][:120]
        raise DownloadError(f"cannot reach {raw_host()} for {where}: {text}") from None
    if len(data) > MAX_PROFILE_BYTES:
        raise ModelError(f"{where} is larger than {MAX_PROFILE_BYTES} bytes: not a profile file; refused")
    got = hashlib.sha256(data).hexdigest()
    if item.entry.sha256 and got != item.entry.sha256:
        raise ModelError(
            f"{where}: downloaded sha256 {got} does not match the manifest's {item.entry.sha256}; nothing was written"
        )
    item.dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = item.dest.with_name(f".{item.dest.name}.part")
    tmp.write_bytes(data)
    os.replace(tmp, item.dest)
    return len(data)
