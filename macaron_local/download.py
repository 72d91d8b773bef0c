"""Fetch a model's files (base GGUF and expert adapters) so it runs offline afterwards.

Files come from the Hugging Face Hub through huggingface_hub's own pieces: `hf_hub_url` builds the
`/resolve/` URL, `get_hf_file_metadata` asks for size, ETag and commit (following the hub's
redirect to its CDN), `build_hf_headers` adds the token, and `http_get` streams the bytes with its
progress bar and its in-transfer retries. We do *not* call `hf_hub_download`: since
huggingface_hub 2.x it writes to a process-unique temp file and deletes it on any failure, so a
20 GB download cut off at 19 GB (Ctrl-C, laptop asleep, a network outage longer than its few
retries) would start again from zero. Here each file downloads into a partial file named after
its ETag under `<model dir>/.pull/`, and the next pull hands that file's size to `http_get` as
`resume_size` (an HTTP `Range` request), so only the missing bytes travel.

A file is trusted only once its size matches the hub, its sha256 matches (the manifest's pin, or
the hub's LFS ETag, which is the sha256) and it parses (a GGUF base) or validates against the
base (an adapter). Only then is it moved into place and a small record written next to the
partials, so later pulls skip it without touching the network. A file the hub keeps in git rather
than LFS (an expert's adapter_config.json) is checked against its git blob id, the hub's ETag.

Measured reason for not handing whole files to `hf_hub_download`/`snapshot_download`:
`bench/hf_resume.py` cuts a transfer halfway against the local fake hub and runs it again:
`hf_hub_download` (huggingface_hub 2.4.0) fetches the whole file again, this module only the
missing half. Nor does `hf_hub_download` hash what it downloaded. huggingface_hub still does the
rest: URLs, metadata (`get_hf_file_metadata`, `get_paths_info` for the dry-run plan),
headers and token, redirects, the streaming `http_get`, and its errors.

An expert published as a PEFT folder is fetched file by file (`files` in the manifest), its
adapter_config.json first: `expert_checks` refuses a wrong rank or base before the weights are
fetched or the base downloaded. Profile files come from GitHub, pinned (`profile_fetch`). Every
failure a user can meet
(no network, 404, gated repo, full disk, corrupt transfer) becomes one `DownloadError` or
`ModelError` line; the token never appears in any message.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit

from macaron_local import secrets
from macaron_local.adapters.peft import CONFIG_FILE, WEIGHTS_FILE, convert_peft_dir
from macaron_local.adapters.validate import BaseModelInfo, validate_adapter
from macaron_local.catalog import Catalog, Manifest, Source
from macaron_local.errors import DownloadError, MacaronError, ModelError
from macaron_local.expert_checks import check_peft_config
from macaron_local.hashing import sha256_file
from macaron_local.profile_fetch import fetch_profile

#: Inside a model's folder: partial downloads, locks and records of verified files.
PULL_DIR = ".pull"
DEFAULT_ENDPOINT = "https://huggingface.co"
LOGIN_HINT = "log in with `macaron auth login`"
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_GIT_OID = re.compile(r"^[0-9a-f]{40}$")
#: The storage type a PEFT expert is converted to when its manifest names none.
DEFAULT_EXPERT_TYPE = "F16"
#: A transfer that keeps failing is retried (with a fresh CDN link) only while it makes progress,
#: and never more often than this.
_MAX_TRANSFER_ATTEMPTS = 20


class DownloadCancelled(DownloadError):
    """The user stopped the download; what arrived is kept and the next pull resumes it."""


#: (file name, bytes done, total bytes or None), called as bytes arrive.
ProgressCallback = Callable[[str, int, "int | None"], None]


@dataclass
class PullResult:
    """What a pull left on disk: the model's usable files, and what was already there."""

    model: str
    files: list[Path] = field(default_factory=list)
    downloaded_bytes: int = 0
    skipped: list[str] = field(default_factory=list)  # labels of items that were already present
    profiles: list[Path] = field(default_factory=list)  # the routing profile's files


# ---------------------------------------------------------------------------------------------
# Small public helpers (also used by `macaron models verify` / doctor)


def verify_sha256(path: str | os.PathLike[str], expected: str) -> None:
    """Raise ModelError unless `path` hashes to `expected` (hex, optionally "sha256:"-prefixed)."""
    want = _normalize_sha256(expected)
    got = sha256_file(path)
    if got != want:
        raise ModelError(f"{path} is corrupt or not the expected file: its sha256 is {got}, expected {want}")


def check_free_disk(target_dir: str | os.PathLike[str], needed_bytes: int) -> None:
    """Raise DownloadError before a download starts that the disk could not hold.

    `target_dir` may not exist yet (a first pull): the nearest existing parent is measured.
    """
    target_dir = Path(target_dir)
    probe = target_dir
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed_bytes > free:
        raise DownloadError(f"needs {_human(needed_bytes)} free in {target_dir}, only {_human(free)} available")


# ---------------------------------------------------------------------------------------------
# pull


@dataclass
class _HubFile:
    """One file to bring from the hub into the model's folder, and what is known about it."""

    label: str
    source: Source
    repo_path: str  # path inside the repo, subfolder included
    dest: Path
    model_dir: Path
    pinned_sha256: str | None = None  # from the manifest: authoritative
    lfs: bool = True  # False: the hub's ETag is the git blob id (sha1) of the bytes
    declared_size: int | None = None  # from the manifest: an upper bound for the disk check
    check: Callable[[Path], None] | None = None  # parses / validates a finished download
    # Filled in by _probe (a HEAD request); left empty when the file is already here.
    present: bool = False
    url: str = ""
    download_url: str = ""
    send_auth: bool = True
    etag: str = ""
    commit: str = ""
    size: int | None = None
    resume: int = 0

    @property
    def expected_sha256(self) -> str | None:
        """The manifest's pin, else the hub's LFS ETag (which is the file's sha256)."""
        if self.pinned_sha256:
            return self.pinned_sha256
        return self.etag if _SHA256.fullmatch(self.etag) else None

    @property
    def pull_dir(self) -> Path:
        return self.model_dir / PULL_DIR / self.dest.parent.relative_to(self.model_dir)

    @property
    def record_path(self) -> Path:
        return self.pull_dir / f"{self.dest.name}.json"

    @property
    def lock_path(self) -> Path:
        return self.pull_dir / f"{self.dest.name}.lock"

    @property
    def partial(self) -> Path:
        tag = re.sub(r"[^0-9A-Za-z]", "", self.etag)[:16] or "noetag"
        return self.pull_dir / f"{self.dest.name}.{tag}.part"

    def identity(self) -> dict[str, Any]:
        return {"repo": self.source.repo, "revision": self.source.revision, "path": self.repo_path}


@dataclass
class _Hub:
    """Where and how to talk to the hub during one pull."""

    endpoint: str
    model: str
    progress: bool | ProgressCallback
    explicit_token: str | None = None
    _token: list[str | None] = field(default_factory=list)

    @property
    def token(self) -> str | None:
        """The token, looked up only when the hub is actually asked: a pull with nothing to
        download must not open the keyring (which may prompt to unlock it)."""
        if not self._token:
            self._token.append(self.explicit_token or secrets.get_hf_token())
        return self._token[0]

    @property
    def token_arg(self) -> str | bool:
        # False, not None: never let huggingface_hub fall back to tokens macaron does not manage
        # (its own token file, OIDC exchange, OAuth refresh calls).
        return self.token or False


def pull(
    catalog: Catalog,
    manifest: Manifest,
    *,
    progress: bool | ProgressCallback = True,
    token: str | None = None,
) -> PullResult:
    """Make `manifest`'s base model and expert adapters present and valid on this machine.

    Everything that needs downloading is probed first (one HEAD per file) and the free disk
    checked for the total, so a pull that cannot fit fails before its first byte. Files whose
    record says they are complete are skipped without any network access.
    """
    result = PullResult(model=manifest.name)
    model_dir = catalog.model_dir(manifest)
    hub = _Hub(endpoint=_endpoint(), model=manifest.name, progress=progress, explicit_token=token)
    base_info: list[BaseModelInfo] = []  # filled once the base is in place

    def base() -> BaseModelInfo:
        if not base_info:
            base_info.append(BaseModelInfo.from_gguf(catalog.base_path(manifest)))
        return base_info[0]

    # 1. Work out what is missing. Local sources are only checked; hub files are probed.
    base_path = catalog.base_path(manifest)
    base_label = f"base {base_path.name}"
    hub_files: list[_HubFile] = []
    base_file: _HubFile | None = None
    if manifest.base.kind == "huggingface":
        base_file = _hub_file(catalog, manifest, manifest.base, base_label, base_path, _check_base)
        hub_files.append(base_file)
    else:
        _require_local(base_path, f"base model of {manifest.name!r}")

    experts: list[_ExpertJob] = []
    for slot, expert in manifest.experts.items():
        if expert.source is None:
            continue
        out = catalog.expert_path(manifest, slot)
        assert out is not None
        job = _ExpertJob(slot, f"expert {slot} {expert.name}", expert.source, out)
        src = expert.source
        if src.kind == "huggingface" and src.format == "peft":
            peft_dir = model_dir / src.subfolder
            job.peft_dir = peft_dir
            job.inputs = [
                _hub_file(catalog, manifest, src, f"{job.label} {name}", peft_dir / name, None, name)
                for name in _peft_files(src, manifest, job.label)
            ]
            hub_files.extend(job.inputs)
        elif src.kind == "huggingface":
            # A GGUF adapter downloads straight to where the engine loads it from.
            job.download = _hub_file(catalog, manifest, src, job.label, out, lambda p: _check_adapter(p, base()))
            hub_files.append(job.download)
        elif src.format == "peft":
            job.peft_dir = catalog.source_path(manifest, src)
            _require_local(job.peft_dir, job.label)
        else:
            local = catalog.source_path(manifest, src)
            _require_local(local, job.label)
            if local.resolve() != out.resolve():
                job.copy_from = local
        experts.append(job)

    for item in hub_files:
        _probe(item, hub)

    # 2. One free-disk check for everything still to fetch or build, before any byte moves.
    needed = sum(_remaining(item) for item in hub_files if not item.present)
    for job in experts:
        if job.peft_dir is not None and job.needs_build(base_path):
            weights = job.peft_dir / WEIGHTS_FILE
            remote = [max(f.size or 0, f.declared_size or 0) for f in job.inputs if f.dest.name == WEIGHTS_FILE]
            needed += converted_size_bound(_size_of(weights) or sum(remote), job.dtype)
        elif job.copy_from is not None and job.needs_copy():
            needed += _size_of(job.copy_from)
    if needed:
        check_free_disk(model_dir, needed)

    # 3. Fetch, verify and place. First what is small and can refuse the model early: the
    # profile files, and each PEFT expert's config (its rank and base are checked before the
    # large weights, or the base, are fetched).
    result.profiles, skipped_profiles, profile_bytes = fetch_profile(catalog, manifest)
    result.downloaded_bytes += profile_bytes
    changed_configs: set[str] = set()
    for job in experts:
        for item in job.inputs:
            if item.dest.name == CONFIG_FILE:
                if _fetch_or_skip(item, hub, result, report_skip=False):
                    changed_configs.add(job.slot)
                _check_expectations(job, item)

    # Then the base, since adapters are validated against it.
    if base_file is not None:
        _fetch_or_skip(base_file, hub, result)
    else:
        result.skipped.append(base_label)
    result.files.append(base_path)

    for job in experts:
        changed = job.slot in changed_configs
        for item in job.inputs:
            changed |= _fetch_or_skip(item, hub, result, report_skip=False)
        if job.download is not None:
            changed |= _fetch_or_skip(job.download, hub, result, report_skip=False)
        elif job.peft_dir is not None and (changed or job.needs_build(base_path)):
            _convert(job, base(), base_path)
            changed = True
        elif job.copy_from is not None and job.needs_copy():
            _copy_adapter(job.copy_from, job.out, base())
            changed = True
        elif job.copy_from is None and job.peft_dir is None:
            _check_adapter(job.out, base())
        if job.peft_dir is not None:
            _link_peft(job.out, job.peft_dir)
        if not changed:
            result.skipped.append(job.label)
        result.files.append(job.out)
    result.skipped.extend(skipped_profiles)
    return result


def _peft_files(source: Source, manifest: Manifest, label: str) -> list[str]:
    """The files of a PEFT folder to fetch, adapter_config.json first (it is checked first)."""
    names = list(source.files) or [CONFIG_FILE, WEIGHTS_FILE]
    missing = [n for n in (CONFIG_FILE, WEIGHTS_FILE) if n not in names]
    if missing:
        raise ModelError(f"model {manifest.name!r}: {label} files must include {', '.join(missing)}")
    return sorted(dict.fromkeys(names), key=lambda n: n != CONFIG_FILE)


def _check_expectations(job: _ExpertJob, config: _HubFile) -> None:
    """Refuse an expert whose config contradicts the manifest; its config is discarded so the
    next pull asks the hub again instead of trusting the refused file."""
    try:
        check_peft_config(config.dest, job.source, job.label)
    except MacaronError:
        config.dest.unlink(missing_ok=True)
        config.record_path.unlink(missing_ok=True)
        raise


def converted_size_bound(peft_weight_bytes: int, dtype: str) -> int:
    """An upper bound on the GGUF adapter converted from PEFT weights of this size: PEFT stores
    at least 2 bytes per value (F16/BF16; F32 is 4), the GGUF type its own bytes per value."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, dtype, None)
    block, type_size = gguf.GGML_QUANT_SIZES.get(qtype, (1, 2)) if qtype is not None else (1, 2)
    return int(peft_weight_bytes * type_size / block / 2) + (1 << 20)


@dataclass
class _ExpertJob:
    """How one expert slot's GGUF adapter comes to exist at `out`."""

    slot: str
    label: str
    source: Source
    out: Path
    download: _HubFile | None = None  # a GGUF adapter on the hub
    inputs: list[_HubFile] = field(default_factory=list)  # a PEFT directory on the hub
    peft_dir: Path | None = None  # PEFT files to convert (downloaded or local)
    copy_from: Path | None = None  # a local GGUF adapter to copy into place

    @property
    def dtype(self) -> str:
        """The GGUF storage type a PEFT source is converted to."""
        return self.source.type or DEFAULT_EXPERT_TYPE

    def build_inputs(self, base_path: Path) -> list[str]:
        """What the converted adapter was made from: if any of it changes, convert again."""
        assert self.peft_dir is not None
        files = [self.peft_dir / CONFIG_FILE, self.peft_dir / WEIGHTS_FILE, base_path]
        return [f"{p}:{_stamp(p)}" for p in files] + [f"type:{self.dtype}"]

    def needs_build(self, base_path: Path) -> bool:
        if not self.out.is_file():
            return True
        record = _read_json(_build_record(self.out))
        fresh = record.get("inputs") == self.build_inputs(base_path)
        return not fresh or record.get("stamp") != _stamp(self.out)

    def needs_copy(self) -> bool:
        assert self.copy_from is not None
        return not self.out.is_file() or _size_of(self.out) != _size_of(self.copy_from)


def _hub_file(
    catalog: Catalog,
    manifest: Manifest,
    source: Source,
    label: str,
    dest: Path,
    check: Callable[[Path], None] | None,
    name: str | None = None,
) -> _HubFile:
    model_dir = catalog.model_dir(manifest)
    if not source.repo:
        raise ModelError(f"model {manifest.name!r}: {label} names no Hugging Face repo")
    filename = name or source.file
    if not filename:
        raise ModelError(f"model {manifest.name!r}: {label} names no file in {source.repo}")
    repo_path = "/".join(p for p in (source.subfolder.strip("/"), filename) if p)
    if not dest.resolve().is_relative_to(model_dir.resolve()):
        raise ModelError(f"model {manifest.name!r}: {label} would be written outside {model_dir}")
    return _HubFile(
        label=label,
        source=source,
        repo_path=repo_path,
        dest=dest,
        model_dir=model_dir,
        # A PEFT source's sha256 cannot describe two files: single-file sources only. Its size
        # bounds the whole folder, which is in practice its weights file.
        pinned_sha256=_normalize_sha256(source.sha256) if source.sha256 and not name else None,
        declared_size=source.size if not name or name == WEIGHTS_FILE else None,
        check=check,
    )


def _probe(item: _HubFile, hub: _Hub) -> None:
    """Decide whether `item` is already here; if not, learn its size, ETag and download URL."""
    if _recorded_complete(item):
        item.present = True
        return
    if item.dest.is_file() and item.pinned_sha256 and sha256_file(item.dest) == item.pinned_sha256:
        _write_record(item)  # put in place by hand, or by an earlier version: adopt it
        item.present = True
        return

    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    item.url = hf_hub_url(
        item.source.repo,
        item.repo_path,
        revision=item.source.revision or "main",
        endpoint=hub.endpoint,
    )
    with _hub_errors(item, hub):
        meta = get_hf_file_metadata(item.url, token=hub.token_arg, endpoint=hub.endpoint)
    if not meta.commit_hash or not meta.etag:
        raise DownloadError(
            f"{hub.endpoint} does not answer like a Hugging Face hub for {item.source.repo} "
            f"{item.repo_path} (no commit or ETag header); check HF_ENDPOINT and any proxy"
        )
    item.etag, item.commit, item.size = meta.etag, meta.commit_hash, meta.size
    # An LFS file's metadata comes from the hub's redirect (X-Linked-Etag is its sha256);
    # a file kept in git is answered in place and its ETag is the git blob id.
    item.lfs = bool(_SHA256.fullmatch(item.etag)) or not _GIT_OID.fullmatch(item.etag)
    item.download_url = meta.location or item.url
    # The hub redirects large files to a signed CDN URL: the token must not follow it there.
    item.send_auth = _origin(item.download_url) == _origin(item.url)

    if item.pinned_sha256 and _SHA256.fullmatch(item.etag) and item.etag != item.pinned_sha256:
        raise ModelError(
            f"{item.source.repo} {item.repo_path} on the hub has sha256 {item.etag}, but the "
            f"manifest pins {item.pinned_sha256}: the file changed upstream or the manifest is wrong"
        )
    expected = item.expected_sha256
    if item.dest.is_file() and expected and _size_of(item.dest) == item.size and sha256_file(item.dest) == expected:
        _write_record(item)
        item.present = True
        return
    if item.partial.is_file():
        item.resume = _size_of(item.partial)
        if item.size is not None and item.resume > item.size:
            item.partial.unlink()  # longer than the file itself: not a prefix of it
            item.resume = 0


def _remaining(item: _HubFile) -> int:
    """Bytes `item` still needs on disk. The manifest's size is an upper bound where given; the
    larger of it and the hub's size is used, so a stale manifest cannot under-count."""
    total = max(item.size or 0, item.declared_size or 0)
    return max(total - item.resume, 0)


def _fetch_or_skip(item: _HubFile, hub: _Hub, result: PullResult, report_skip: bool = True) -> bool:
    """Download `item` unless present; True when something new was put in place."""
    if item.present:
        if report_skip:
            result.skipped.append(item.label)
        return False
    result.downloaded_bytes += _fetch(item, hub)
    item.present = True
    return True


def _fetch(item: _HubFile, hub: _Hub) -> int:
    """Resume-or-start the download, verify it, and move it into place. Returns bytes fetched."""
    import filelock

    item.pull_dir.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(item.lock_path), timeout=0)
    try:
        lock.acquire()
    except filelock.Timeout:
        raise DownloadError(
            f"another pull is already downloading {item.repo_path} into {item.dest.parent}; wait for it to finish"
        ) from None
    try:
        if _recorded_complete(item):  # another pull finished it since we probed
            return 0
        mine = re.compile(rf"^{re.escape(item.dest.name)}\.[0-9A-Za-z]+\.part$")
        for stale in item.pull_dir.iterdir():
            if mine.match(stale.name) and stale != item.partial:
                stale.unlink(missing_ok=True)  # an older upstream version: never splice it in
        fetched = _transfer(item, hub)
        _verify_and_place(item)
        return fetched
    finally:
        lock.release()


def _transfer(item: _HubFile, hub: _Hub) -> int:
    """Append the missing bytes to the partial file with huggingface_hub's `http_get`.

    `http_get` itself retries a dropped stream a few times; when it gives up but bytes did
    arrive, we ask the hub again (a fresh CDN link: signed ones expire) and go on. A transfer
    that makes no progress at all fails at once, with the partial file kept for the next pull.
    """
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    fetched = 0
    for attempt in range(_MAX_TRANSFER_ATTEMPTS):
        resume = _size_of(item.partial) if item.partial.is_file() else 0
        headers = build_hf_headers(token=hub.token_arg if item.send_auth else False)
        if not item.send_auth:
            headers.pop("authorization", None)
            headers.pop("Authorization", None)
        with item.partial.open("r+b" if resume else "w+b") as raw:
            raw.seek(0, os.SEEK_END)
            sink = _CountingFile(raw)
            try:
                with _hub_errors(item, hub, during_transfer=True):
                    http_get(
                        item.download_url,
                        sink,  # type: ignore[arg-type]
                        resume_size=resume,
                        headers=headers,
                        expected_size=item.size,
                        displayed_filename=item.dest.name,
                        tqdm_class=_progress_class(hub.progress),
                    )
                return fetched + sink.written
            except DownloadCancelled:
                raise
            except DownloadError as failure:
                fetched += sink.written
                if sink.written == 0 or attempt + 1 == _MAX_TRANSFER_ATTEMPTS:
                    raise
                error = failure
        try:
            _probe_location(item, hub)
        except DownloadError:
            raise error from None  # the transfer's own message says how to resume
    raise AssertionError("unreachable")


def _probe_location(item: _HubFile, hub: _Hub) -> None:
    """Ask the hub again where the bytes are (signed CDN links expire) and that they are the same."""
    from huggingface_hub import get_hf_file_metadata

    with _hub_errors(item, hub):
        meta = get_hf_file_metadata(item.url, token=hub.token_arg, endpoint=hub.endpoint)
    if meta.etag != item.etag:
        raise DownloadError(
            f"{item.source.repo} {item.repo_path} changed on the hub during the download; "
            f"run `macaron models pull {hub.model}` again"
        )
    item.download_url = meta.location or item.url
    item.send_auth = _origin(item.download_url) == _origin(item.url)


def _verify_and_place(item: _HubFile) -> None:
    """Only a complete, hash-verified, parseable file may take the name the engine loads."""
    partial = item.partial
    if item.size is not None and _size_of(partial) != item.size:
        raise DownloadError(
            f"download of {item.repo_path} stopped at {_size_of(partial)} of {item.size} bytes; "
            "run the pull again to resume"
        )
    expected = item.expected_sha256
    if expected:
        got = sha256_file(partial)
        if got != expected:
            partial.unlink(missing_ok=True)  # resuming a corrupt file would keep it corrupt
            raise ModelError(
                f"{item.source.repo} {item.repo_path}: downloaded sha256 {got} does not match "
                f"{expected}; the download was discarded, run the pull again"
            )
    elif not item.lfs:
        got = _git_blob_id(partial)
        if got != item.etag:
            partial.unlink(missing_ok=True)
            raise ModelError(
                f"{item.source.repo} {item.repo_path}: downloaded git blob id {got} does not match "
                f"the hub's {item.etag}; the download was discarded, run the pull again"
            )
    if item.check is not None:
        try:
            item.check(partial)
        except MacaronError as exc:
            partial.unlink(missing_ok=True)
            reason = str(exc)
            for shown in {str(partial.resolve()), str(partial)}:  # the temp name means nothing to users
                reason = reason.replace(f"{shown}: ", "").replace(shown, "the file")
            raise ModelError(f"{item.label} ({item.source.repo} {item.repo_path}) is not usable: {reason}") from None
    item.dest.parent.mkdir(parents=True, exist_ok=True)
    item.record_path.unlink(missing_ok=True)
    os.replace(partial, item.dest)
    _write_record(item)


def _git_blob_id(path: Path) -> str:
    """Git's object id of a file's bytes (what the hub sends as the ETag of a non-LFS file)."""
    import hashlib

    digest = hashlib.sha1(b"blob %d\0" % _size_of(path), usedforsecurity=False)
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _check_base(path: Path) -> None:
    info = BaseModelInfo.from_gguf(path)
    if info.kind == "adapter":
        raise ModelError(f"{path} is an adapter, not a base model")


def _check_adapter(path: Path, base: BaseModelInfo) -> None:
    """An expert adapter must apply to this base (AdapterError otherwise)."""
    validate_adapter(path, base)


def _convert(job: _ExpertJob, base: BaseModelInfo, base_path: Path) -> None:
    assert job.peft_dir is not None
    check_peft_config(job.peft_dir / CONFIG_FILE, job.source, job.label)  # local folders too
    job.out.parent.mkdir(parents=True, exist_ok=True)
    task = f"{job.slot} {job.label.split(' ', 2)[-1]}"
    convert_peft_dir(job.peft_dir, base, job.out, dtype=job.dtype, task_name=task)
    record = {"inputs": job.build_inputs(base_path), "stamp": _stamp(job.out)}
    _write_json(_build_record(job.out), record)


def _link_peft(out: Path, peft_dir: Path) -> None:
    """`<slot>.peft` next to the converted expert, a link to the PEFT folder it came from: an
    engine that loads PEFT, not GGUF (vLLM), finds an expert's folder there to stack the
    personal adapter on it (`engine.remote.vllm.peft_folder`). Replaced atomically."""
    link, target = out.with_suffix(".peft"), peft_dir.resolve()
    if link.is_symlink() and Path(os.readlink(link)) == target:
        return
    tmp = link.with_name(f".{link.name}.link")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp, target_is_directory=True)
    os.replace(tmp, link)


def _copy_adapter(src: Path, out: Path, base: BaseModelInfo) -> None:
    """Validate a local adapter, then copy it to where the engine loads the slot from."""
    validate_adapter(src, base)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.copy")
    shutil.copyfile(src, tmp)
    os.replace(tmp, out)


def _require_local(path: Path, what: str) -> None:
    if not path.exists():
        raise ModelError(f"{what}: {path} does not exist")


# ---------------------------------------------------------------------------------------------
# Records: how a later pull knows a file is complete without hashing 20 GB or asking the hub


def _recorded_complete(item: _HubFile) -> bool:
    if not item.dest.is_file():
        return False
    record = _read_json(item.record_path)
    if record.get("file") != item.identity() or record.get("stamp") != _stamp(item.dest):
        return False
    return not item.pinned_sha256 or record.get("sha256") == item.pinned_sha256


def _write_record(item: _HubFile) -> None:
    record = {
        "file": item.identity(),
        "stamp": _stamp(item.dest),
        "etag": item.etag or None,
        "commit": item.commit or None,
        "sha256": item.expected_sha256,
    }
    _write_json(item.record_path, record)


def _build_record(out: Path) -> Path:
    return out.with_name(f".{out.name}.built.json")


def _stamp(path: Path) -> str:
    """Size and mtime: changes whenever the file is replaced or rewritten."""
    try:
        stat = path.stat()
    except OSError:
        return "missing"
    return f"{stat.st_size}:{stat.st_mtime_ns}"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Errors: huggingface_hub / httpx exceptions become one line that says what to do


@contextlib.contextmanager
def _hub_errors(item: _HubFile, hub: _Hub, during_transfer: bool = False) -> Iterator[None]:
    from huggingface_hub.errors import (
        FileMetadataError,
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, path, rev = item.source.repo, item.repo_path, item.source.revision or "main"
    again = f"run `macaron models pull {hub.model}` again to resume"
    try:
        yield
    except GatedRepoError:
        if hub.token:
            raise DownloadError(
                f"access denied: {repo} is gated and your account has not been granted access; "
                f"accept its terms at {hub.endpoint}/{repo}"
            ) from None
        raise DownloadError(
            f"access denied: {repo} is gated; accept its terms at {hub.endpoint}/{repo} and {LOGIN_HINT}"
        ) from None
    except RepositoryNotFoundError as exc:
        status = _status(exc)
        if status == 401 and not hub.token:
            raise DownloadError(
                f"access denied: repo {repo} is private, gated or does not exist; {LOGIN_HINT}"
            ) from None
        raise DownloadError(f"repo {repo} not found ({status or 404})") from None
    except RevisionNotFoundError:
        raise DownloadError(f"repo {repo} has no revision {rev!r} (404)") from None
    except RemoteEntryNotFoundError:
        raise DownloadError(f"repo {repo} file {path} not found (404)") from None
    except HfHubHTTPError as exc:
        status = _status(exc)
        if status == 401:
            raise DownloadError(f"access denied: the hub rejected your token; {LOGIN_HINT}") from None
        if during_transfer and status in (403, 410):  # a signed CDN link that expired
            raise DownloadError(f"the download link for {path} expired (HTTP {status}); {again}") from None
        if status == 403:
            raise DownloadError(f"access denied to {repo} file {path} (403); {LOGIN_HINT}") from None
        if status == 404:
            raise DownloadError(f"repo {repo} file {path} not found (404)") from None
        tail = f"; {again}" if during_transfer else "; try again later"
        raise DownloadError(f"the model hub answered HTTP {status} for {repo} file {path}{tail}") from None
    except OfflineModeIsEnabled:
        raise DownloadError(
            f"HF_HUB_OFFLINE is set, so {repo} {path} cannot be downloaded; unset it and retry"
        ) from None
    except FileMetadataError as exc:
        raise DownloadError(
            f"{hub.endpoint} does not answer like a Hugging Face hub ({_first_line(exc)}); "
            "check HF_ENDPOINT and any proxy"
        ) from None
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise DownloadError(
                f"the disk filled up while downloading {path} into {item.dest.parent}; free some space and {again}"
            ) from None
        if not _is_transport_error(exc):
            if during_transfer and isinstance(exc, OSError) and "Consistency check" in str(exc):
                raise DownloadError(f"download of {path} ended early; {again}") from None
            raise
        reason = _transport_reason(exc)
        if during_transfer:
            raise DownloadError(f"download of {path} was interrupted ({reason}); {again}") from None
        raise DownloadError(f"cannot reach the model hub at {hub.endpoint}: {reason}") from None


def _is_transport_error(exc: BaseException) -> bool:
    """httpx2 (huggingface_hub 2.x), httpx (1.x) or requests (0.x): matched by class name so
    this module works whichever of them the installed huggingface_hub uses."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    modules = {cls.__module__.split(".")[0] for cls in type(exc).__mro__}
    transport = {"TransportError", "RequestException", "ConnectionError", "TimeoutError"}
    return bool(names & transport) and bool(modules & {"httpx", "httpx2", "requests", "builtins"})


def _transport_reason(exc: BaseException) -> str:
    text = str(exc).lower()
    if "refused" in text:
        return "connection refused"
    if "timed out" in text or "timeout" in type(exc).__name__.lower():
        return "timed out"
    if "name or service" in text or "getaddrinfo" in text or "nodename" in text:
        return "host name not found"
    if "certificate" in text or "ssl" in text:
        return "TLS/certificate error"
    return _first_line(exc)


def _status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:200]


# ---------------------------------------------------------------------------------------------
# Misc


class _CountingFile:
    """A file wrapper that counts bytes written: `downloaded_bytes` must not count resumed data."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.written = 0

    def write(self, data: bytes) -> int:
        n = self._raw.write(data)
        self.written += len(data)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


def _progress_class(progress: bool | ProgressCallback) -> type | None:
    """None keeps huggingface_hub's bar (which honours HF_HUB_DISABLE_PROGRESS_BARS); otherwise a
    bar class that is always disabled, so quiet pulls do not flip process-wide state. A callable
    `progress` is told (file name, bytes done, total) as bytes arrive; it may raise
    DownloadCancelled to stop the transfer (the partial file is kept for resuming)."""
    if progress is True:
        return None
    from huggingface_hub.utils import tqdm as hf_tqdm

    report = progress if callable(progress) else None

    class _QuietBar(hf_tqdm):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)
            self._done = int(kwargs.get("initial") or 0)
            self._name = str(kwargs.get("desc") or "")

        def update(self, n: float | None = 1) -> bool | None:
            self._done += int(n or 0)
            if report is not None:
                report(self._name, self._done, self.total)
            return super().update(n)

    return _QuietBar


def _endpoint() -> str:
    """HF_ENDPOINT read now, not at import: huggingface_hub freezes it into `constants.ENDPOINT`
    when first imported, and a mirror set later (or by a test) must still win."""
    value = os.environ.get("HF_ENDPOINT")
    if not value:
        try:
            from huggingface_hub import constants

            value = constants.ENDPOINT
        except ImportError:
            value = DEFAULT_ENDPOINT
    return value.rstrip("/")


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme)
    return (parts.scheme, (parts.hostname or "").lower(), parts.port or default)


def _normalize_sha256(value: str) -> str:
    text = value.strip().lower().removeprefix("sha256:")
    if not _SHA256.fullmatch(text):
        raise ModelError(f"{value!r} is not a sha256 (64 hex digits)")
    return text


def _size_of(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _human(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
