"""The built-in tools, each with a narrow contract:

- `read_file(path)`: a text file's contents (cut at the output cap);
- `list_folder(path)`: a folder's entries, folders marked with a trailing `/`;
- `search_folder(path, text)`: the lines under a folder that contain `text` (file:line: text);
- `write_file(path, content)`: create or replace a text file (atomically), in a writable folder;
- `run_command(command)`: a shell command in the first writable folder, with a timeout, a cap
  on its output and, where the OS allows it (Linux user namespaces), no network.

Reading is allowed in the working directory and the folders the user lists; writing and
running only in the writable folders (none by default). Each refusal is one line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

from macaron_local.tools.config import ToolsConfig
from macaron_local.tools.sandbox import confined
from macaron_local.tools.spec import ToolRefused, ToolSpec

#: A file is written in the working folder (the first writable one), so its path is relative.
RELATIVE_PATH = "^[A-Za-z0-9_][A-Za-z0-9_ ./-]*$"
MAX_SEARCH_FILES = 2000
MAX_FILE_BYTES = 2_000_000  # larger files are not read or searched


def _string(arguments: Mapping[str, Any], key: str) -> str:
    value = arguments.get(key)
    if not isinstance(value, str):
        raise ToolRefused(f"argument {key!r} must be text")
    return value


def _cap(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n[... cut at {limit} characters]"


def _read_text(path: Path) -> str:
    if not path.is_file():
        raise ToolRefused(f"{path} is not a file")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ToolRefused(f"{path} is larger than {MAX_FILE_BYTES} bytes")
    return path.read_bytes().decode("utf-8", errors="replace")


def _umask() -> int:
    """The process umask, read without setting it (os.umask would change it for every thread
    for a moment, and the store's private files must never be created in that moment)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


@cache
def _no_network_prefix() -> tuple[str, ...]:
    """`unshare -rn` where it works (a new, empty network namespace): commands have no network."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        ok = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=5).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return (unshare, "-rn") if ok else ()


def command_has_network() -> bool:
    """Whether `run_command` can reach the network here (said in `macaron doctor`)."""
    return not _no_network_prefix()


def builtin_tools(config: ToolsConfig) -> list[ToolSpec]:
    read, write, limit = config.read_folders, config.write_folders, config.max_output_chars
    readable = read + tuple(f for f in write if f not in read)

    def read_file(arguments: Mapping[str, Any]) -> str:
        return _cap(_read_text(confined(arguments.get("path"), readable, purpose="read")), limit)

    def list_folder(arguments: Mapping[str, Any]) -> str:
        folder = confined(arguments.get("path", "."), readable, purpose="read")
        if not folder.is_dir():
            raise ToolRefused(f"{folder} is not a folder")
        names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
        return _cap("\n".join(names) or "(empty folder)", limit)

    def search_folder(arguments: Mapping[str, Any]) -> str:
        folder = confined(arguments.get("path", "."), readable, purpose="read")
        needle = _string(arguments, "text")
        if not needle:
            raise ToolRefused("argument 'text' must not be empty")
        hits, seen = [], 0
        for path in sorted(folder.rglob("*")):
            if seen >= MAX_SEARCH_FILES:
                break
            try:
                inside = confined(str(path), readable, purpose="read")  # a symlink out is skipped
            except ToolRefused:
                continue
            if not inside.is_file() or inside.stat().st_size > MAX_FILE_BYTES:
                continue
            seen += 1
            for number, line in enumerate(inside.read_bytes().decode("utf-8", "replace").splitlines(), 1):
                if needle in line:
                    hits.append(f"{path.relative_to(folder)}:{number}: {line.strip()}")
        return _cap("\n".join(hits) or f"no line contains {needle!r}", limit)

    def write_file(arguments: Mapping[str, Any]) -> str:
        target = confined(arguments.get("path"), write, purpose="write")
        content = _string(arguments, "content")
        if target.is_dir():
            raise ToolRefused(f"{target} is a folder")
        if not target.parent.is_dir():
            raise ToolRefused(f"the folder {target.parent} does not exist")
        fd, temp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(content)
            # The user's file, not ours: keep a replaced file's mode, else the umask's default.
            os.chmod(temp, target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask())
            os.replace(temp, target)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        return f"wrote {len(content)} characters to {target}"

    def check_write(arguments: Mapping[str, Any]) -> None:
        confined(arguments.get("path"), write, purpose="write")
        _string(arguments, "content")

    def check_command(arguments: Mapping[str, Any]) -> None:
        _string(arguments, "command")
        if not write:
            raise ToolRefused("no folder is allowed for commands (settings [tools] write_folders)")

    def run_command(arguments: Mapping[str, Any]) -> str:
        check_command(arguments)
        command = _string(arguments, "command")
        env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
        try:
            done = subprocess.run(
                [*_no_network_prefix(), "/bin/sh", "-c", command],
                cwd=write[0],
                env=env,
                capture_output=True,
                timeout=config.timeout_s,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the command ran past its {config.timeout_s:g} s timeout and was stopped") from None
        output = (done.stdout + done.stderr).decode("utf-8", errors="replace")
        return _cap(f"exit code {done.returncode}\n{output}", limit)

    def path_schema(description: str) -> dict[str, Any]:
        return {"type": "string", "description": f"{description}, relative to the working folder (e.g. notes.txt)"}

    return [
        ToolSpec(
            "read_file",
            "Read a text file.",
            {"type": "object", "properties": {"path": path_schema("the file")}, "required": ["path"]},
            "read",
            read_file,
        ),
        ToolSpec(
            "list_folder",
            "List the files and folders in a folder.",
            {"type": "object", "properties": {"path": path_schema("the folder")}, "required": ["path"]},
            "read",
            list_folder,
        ),
        ToolSpec(
            "search_folder",
            "Find the lines that contain some text in the files under a folder.",
            {
                "type": "object",
                "properties": {"path": path_schema("the folder"), "text": {"type": "string"}},
                "required": ["path", "text"],
            },
            "read",
            search_folder,
        ),
        ToolSpec(
            "write_file",
            "Create or replace a text file.",
            {
                "type": "object",
                "properties": {
                    "path": {**path_schema("the file"), "pattern": RELATIVE_PATH},
                    "content": {"type": "string"},
                },
                "required": ["path", "content"],
            },
            "write",
            write_file,
            check_write,
        ),
        ToolSpec(
            "run_command",
            "Run a shell command in the working folder and return its output.",
            {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
            "execute",
            run_command,
            check_command,
        ),
    ]
