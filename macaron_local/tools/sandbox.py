"""Where a tool may read and write: inside the folders the user allows, and nowhere else.

A path is refused, in one line, when it names `..`, when it (or a symlink on the way) leads
outside every allowed folder, or when it is not where the call said (a file for a folder). The
check resolves symlinks first, so a link inside an allowed folder that points out is caught.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from macaron_local.tools.spec import ToolRefused


def confined(raw: object, folders: Sequence[Path], *, purpose: str) -> Path:
    """The resolved path for `raw`, which must lie inside one of `folders`. A relative path is
    taken inside the first folder (the working directory for reading, the first writable
    folder for writing)."""
    if not isinstance(raw, str) or not raw.strip():
        raise ToolRefused("the path must be non-empty text")
    if "\0" in raw:
        raise ToolRefused("the path contains a NUL byte")
    if not folders:
        raise ToolRefused(f"no folder is allowed for {purpose} (settings [tools] {purpose}_folders)")
    given = Path(raw).expanduser()
    if ".." in given.parts:
        raise ToolRefused(f"{raw}: paths with '..' are refused")
    target = (given if given.is_absolute() else folders[0] / given).resolve()
    for folder in folders:
        if target == folder or folder in target.parents:
            return target
    allowed = ", ".join(str(f) for f in folders)
    written = given if given.is_absolute() else folders[0] / given
    if target != written.absolute():  # a symlink on the way leads elsewhere
        raise ToolRefused(f"{raw} leads to {target}, outside the folders allowed for {purpose} ({allowed})")
    raise ToolRefused(f"{raw} is outside the folders allowed for {purpose} ({allowed})")
