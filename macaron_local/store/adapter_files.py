"""The registry's files: content-addressed adapter files, written so a crash never leaves half of one
under its real name, and collected when no version references them.

`adapters/<sha256>.gguf` never changes once written: a file is copied under a temporary name,
flushed, then renamed. What the rows say about these files lives in `registry.py`; the two meet
under the store's write lock (see `collect_garbage`).

A version may also have a companion, `adapters/<sha256>.peft/`: the same adapter as a PEFT
folder, for an engine that loads PEFT and not GGUF (vLLM). It is keyed by its GGUF's hash, so
it lives and dies with that file: collected with it, and deleted with it when a conversation it
learned is forgotten (it encodes the same data).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import shutil
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sqlite_utils import Database

from macaron_local.errors import InvalidInputError
from macaron_local.hashing import sha256_file
from macaron_local.store.errors import StoreError

#: A content-addressed adapter file, and the temporary name it is written under first.
CONTENT_NAME = re.compile(r"^[0-9a-f]{64}\.gguf$")
TEMP_NAME = re.compile(r"^\.(?P<target>[0-9a-f]{64}\.gguf)\.(?P<pid>\d+)\.tmp$")
#: A companion PEFT folder, and the temporary name it is copied under first.
COMPANION_NAME = re.compile(r"^[0-9a-f]{64}\.peft$")
TEMP_COMPANION = re.compile(r"^\.(?P<target>[0-9a-f]{64}\.peft)\.(?P<pid>\d+)\.tmp$")
PEFT_CONFIG = "adapter_config.json"
#: A stack vLLM serves (an expert plus the personal adapter as one PEFT folder), written next to
#: the companions by the process in its name: `.stack-<pid>-macaron-<key>x<scale>+....peft`.
STACK_PREFIX = ".stack-"
STACK_NAME = re.compile(r"^\.stack-(?P<pid>\d+)-[\w.+-]+\.peft$")
#: A temporary file this old, whose writer is gone, was left by a crash mid-copy.
STALE_TEMP_S = 3600.0
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


@dataclass(frozen=True)
class GcReport:
    """What a garbage collection removed (or, with dry_run, would remove) and what it kept."""

    removed: list[str] = field(default_factory=list)
    stale_temps: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    kept: int = 0
    dry_run: bool = False

    def summary(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        return (
            f"{verb} {len(self.removed)} unreferenced adapter file(s) and {len(self.stale_temps)} stale "
            f"temporary file(s), {self.freed_bytes / 1e6:.1f} MB; kept {self.kept} referenced file(s)"
        )


@contextmanager
def disk_errors(where: Path) -> Iterator[None]:
    """A full disk (or quota, or file-size limit) while writing becomes one clear StoreError."""
    try:
        yield
    except OSError as exc:
        if exc.errno in _DISK_FULL:
            raise StoreError(
                f"no space left to write the adapter into {where} ({exc.strerror}); free some space "
                "and try again (nothing was registered)"
            ) from None
        raise


def store_file(source: Path, adapters_dir: Path) -> tuple[str, Path]:
    """Copy an adapter into the content-addressed folder (temp file + rename); returns (hash, path)."""
    return store_files([source], adapters_dir)[source]


def store_files(sources: Iterable[Path], adapters_dir: Path) -> dict[Path, tuple[str, Path]]:
    """Hash and store each distinct file once; returns {source as given: (hash, registry path)}."""
    hashed: dict[Path, str] = {}
    for source in sources:
        if source not in hashed:
            if not Path(source).is_file():
                raise InvalidInputError(f"{source}: no such adapter file")
            hashed[source] = sha256_file(Path(source))
    paths = ensure_files([(Path(s), d) for s, d in hashed.items()], adapters_dir)
    return {source: (digest, path) for (source, digest), path in zip(hashed.items(), paths, strict=True)}


def ensure_file(source: Path, digest: str, adapters_dir: Path) -> Path:
    """Make `adapters_dir/<digest>.gguf` exist with `source`'s bytes; cheap when it already does."""
    return ensure_files([(Path(source), digest)], adapters_dir)[0]


def ensure_files(items: Sequence[tuple[Path, str]], adapters_dir: Path) -> list[Path]:
    """Make each `adapters_dir/<digest>.gguf` exist with its source's bytes; returns the paths.

    A stored file whose size differs from the source's was damaged (or replaced) and is written
    again, so registering good bytes repairs a broken copy instead of trusting it. Missing files
    are written as temporaries first, all flushed, then renamed into place and the folder
    flushed once: a crash leaves whole files or temporaries, and many small files cost about
    one flush instead of one each.
    """
    targets = [adapters_dir / f"{digest}.gguf" for _, digest in items]
    todo, planned = [], set()
    for (source, _), target in zip(items, targets, strict=True):
        try:
            if target.is_file() and target.stat().st_size == source.stat().st_size:
                continue
        except OSError:
            pass
        if target not in planned:
            planned.add(target)
            todo.append((source, target))
    if not todo:
        return targets
    temps: list[Path] = []
    with disk_errors(adapters_dir):
        adapters_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            for source, target in todo:
                tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
                temps.append(tmp)
                shutil.copyfile(source, tmp)
                os.chmod(tmp, 0o600)
            _flush(temps, adapters_dir)
            for tmp, (_, target) in zip(temps, todo, strict=True):
                os.replace(tmp, target)
            _fsync_dir(adapters_dir)
        except BaseException:
            for tmp in temps:
                tmp.unlink(missing_ok=True)
            raise
    return targets


def companion_path(adapters_dir: Path, digest: str) -> Path:
    """Where the PEFT companion of `adapters_dir/<digest>.gguf` lives (whether or not it exists)."""
    return adapters_dir / f"{digest}.peft"


def store_companion(folder: Path, digest: str, adapters_dir: Path) -> Path:
    """Copy the PEFT folder `folder` in as the companion of `<digest>.gguf`: copied whole under a
    temporary name, flushed, then renamed, so a crash never leaves half of one under its real
    name. A companion already there is kept (same hash, same adapter)."""
    target = companion_path(adapters_dir, digest)
    if (target / PEFT_CONFIG).is_file():
        return target
    if not (Path(folder) / PEFT_CONFIG).is_file():
        raise InvalidInputError(f"{folder}: not a PEFT folder (no {PEFT_CONFIG})")
    tmp = adapters_dir / f".{target.name}.{os.getpid()}.tmp"
    with disk_errors(adapters_dir):
        adapters_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            shutil.copytree(folder, tmp)
            os.chmod(tmp, 0o700)
            files = [path for path in tmp.rglob("*") if path.is_file()]
            for path in files:
                os.chmod(path, 0o600)
            _flush(files, adapters_dir)
            shutil.rmtree(target, ignore_errors=True)  # an incomplete one (no config) is replaced
            os.replace(tmp, target)
            _fsync_dir(adapters_dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def remove_companion(adapters_dir: Path, digest: str) -> None:
    """Delete `<digest>.gguf`'s companion and every stack built from it (an engine names a
    stacked adapter by the first 16 hex digits of each file's hash)."""
    shutil.rmtree(companion_path(adapters_dir, digest), ignore_errors=True)
    for stack in adapters_dir.glob(f"{STACK_PREFIX}*{digest[:16]}*.peft"):
        shutil.rmtree(stack, ignore_errors=True)


def _folder_bytes(folder: str) -> int:
    return sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())


def _flush(files: Sequence[Path], folder: Path) -> None:
    """Put the files' bytes on disk before they are renamed into place.

    One fsync per file costs a device flush each (milliseconds); for many files, Linux's
    syncfs flushes the whole filesystem once. Elsewhere, or if it fails, fsync each.
    """
    if len(files) > 1 and _syncfs(folder):
        return
    for path in files:
        with path.open("rb") as handle:
            os.fsync(handle.fileno())


def _syncfs(folder: Path) -> bool:
    syncfs = getattr(_libc(), "syncfs", None)
    if syncfs is None:
        return False
    fd = os.open(folder, os.O_RDONLY)
    try:
        return syncfs(fd) == 0
    finally:
        os.close(fd)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def _fsync_dir(folder: Path) -> None:
    """Make the renames durable (POSIX: a directory's entries are flushed through its own fd)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself is still atomic
    finally:
        os.close(fd)


def collect_garbage(
    db: Database,
    adapters_dir: Path,
    *,
    dry_run: bool = False,
    stale_temp_s: float = STALE_TEMP_S,
    only: set[str] | None = None,
) -> GcReport:
    """Delete adapter files no version references. Call inside a write transaction.

    Holding the write lock is what makes this safe against a concurrent registration: a
    registering process re-checks its file under the same lock before inserting its row, so
    either we see its row (and keep the file) or it sees the file gone (and copies it again).
    Only `<sha256>.gguf` names are ours to judge. A temporary file is somebody's copy in
    progress; it is removed only when its writer is dead and it is older than `stale_temp_s`.
    Anything else in the folder is left alone. `only` limits the collection to those hashes.
    """
    removed, stale, freed, kept = [], [], 0, 0
    if not adapters_dir.is_dir():
        return GcReport(dry_run=dry_run)
    now = time.time()
    for entry in sorted(os.scandir(adapters_dir), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False):
            name = _collect_folder(db, entry, only, now, stale_temp_s)
            if name is not None:
                (removed if COMPANION_NAME.match(name) else stale).append(name)
                freed += _folder_bytes(entry.path)
                if not dry_run:
                    shutil.rmtree(entry.path, ignore_errors=True)
            continue
        if not entry.is_file(follow_symlinks=False):
            continue
        if CONTENT_NAME.match(entry.name):
            digest = entry.name[:64]
            if only is not None and digest not in only:
                continue
            if _referenced(db, digest):
                kept += 1
                continue
            removed.append(entry.name)
        elif only is None and (temp := TEMP_NAME.match(entry.name)) is not None:
            if _alive(int(temp["pid"])) or now - entry.stat().st_mtime < stale_temp_s:
                continue
            stale.append(entry.name)
        else:
            continue
        freed += entry.stat().st_size
        if not dry_run:
            Path(entry.path).unlink(missing_ok=True)
    return GcReport(removed=removed, stale_temps=stale, freed_bytes=freed, kept=kept, dry_run=dry_run)


def _referenced(db: Database, digest: str) -> bool:
    """Does any version name the file with this hash (and so its companion)?"""
    return db.execute("SELECT 1 FROM adapter_versions WHERE sha256 = ? LIMIT 1", [digest]).fetchone() is not None


def _collect_folder(db: Database, entry: os.DirEntry, only: set[str] | None, now: float, stale_temp_s: float):
    """The name of a companion folder (or a dead writer's temporary one) to collect, else None."""
    if COMPANION_NAME.match(entry.name):
        digest = entry.name[:64]
        if only is not None and digest not in only:
            return None
        return None if _referenced(db, digest) else entry.name
    temp = TEMP_COMPANION.match(entry.name) or STACK_NAME.match(entry.name)
    if only is None and temp is not None and not _alive(int(temp["pid"])):
        return entry.name if now - entry.stat().st_mtime >= stale_temp_s else None
    return None


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    return True


def missing_files(db: Database, adapters_dir: Path, *, deep: bool = False) -> list[tuple[str, str]]:
    """(sha256, problem) for every distinct file the registry references that is not intact.

    Cheap checks by default (present, non-empty); `deep` also hashes each file against its name.
    """
    problems = []
    forgotten = "SELECT version_id FROM forgotten_versions"  # their files were deleted on purpose
    query = f"SELECT DISTINCT sha256 FROM adapter_versions WHERE id NOT IN ({forgotten})"
    for (digest,) in db.execute(query).fetchall():
        path = adapters_dir / f"{digest}.gguf"
        if not path.is_file():
            problems.append((digest, f"{path} is missing"))
        elif path.stat().st_size == 0:
            problems.append((digest, f"{path} is empty"))
        elif deep and sha256_file(path) != digest:
            problems.append((digest, f"{path} does not match its hash (damaged or replaced)"))
    return problems
