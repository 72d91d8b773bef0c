"""A local stand-in for the Hugging Face Hub, so download tests never touch the network.

It is a real HTTP server (two, in fact) on 127.0.0.1 that answers the requests huggingface_hub
2.4.0 makes to fetch a file, the way huggingface.co answers them:

* ``HEAD`` / ``GET {endpoint}/{repo_id}/resolve/{revision}/{path}`` (`get_hf_file_metadata`,
  `hf_hub_download`, `http_get`). Every answer carries ``X-Repo-Commit`` (without it
  huggingface_hub refuses the endpoint as "not a Hub"). Small files are answered in place with
  ``ETag`` = the git blob sha1 and ``Content-Length``. Git-LFS files (``*.gguf``,
  ``*.safetensors``, ``*.bin``, as the hub's default ``.gitattributes`` tracks them) get a
  ``302`` to a second server standing in for the CDN, with ``X-Linked-Etag`` (the sha256) and
  ``X-Linked-Size``; huggingface_hub stops at a redirect to another origin and takes the metadata
  from the 302 itself, then downloads from the CDN without the token. No ``X-Xet-*`` headers are
  ever sent, so huggingface_hub never takes its Xet path.
* ``Range: bytes=N-`` is honoured with ``206`` and ``Content-Range`` (what resuming needs).
* Errors carry the hub's ``X-Error-Code`` so huggingface_hub raises its specific exceptions:
  ``EntryNotFound`` (404, unknown file), ``RevisionNotFound`` (404), ``RepoNotFound`` (401 without
  a token, 404 with one), ``GatedRepo`` (401 without a token) and 401 "Invalid credentials in
  Authorization header" for a wrong token.

* ``POST {endpoint}/api/models/{repo_id}/paths-info/{revision}`` (`HfApi.get_paths_info`, form
  fields ``paths`` and ``expand``): a JSON list with one entry per path that exists, a file's
  ``size`` and git ``oid``, and for LFS files ``lfs: {oid: sha256, size, pointerSize}``; paths
  that do not exist are left out, as the hub does. A folder path is listed as a directory.
* A third server stands in for GitHub's raw-content host: ``GET /{owner}/{repo}/{commit}/{path}``
  serves `github_files`; `use_fake_hub` points ``MACARON_GITHUB_RAW_URL`` at it.

It counts requests and body bytes served, can cut the next transfer off after N bytes (a dropped
connection) and can then stay down (503 to everything: a pull that dies and is run again later).
`use_fake_hub` points an already-imported huggingface_hub at it.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<revision>[^/]+)/(?P<path>.+)$")
PATHS_INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/paths-info/(?P<revision>[^/]+)$")
RAW = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/(?P<commit>[0-9a-f]{40})/(?P<path>.+)$")
BLOB = re.compile(r"^/blobs/(?P<sha>[0-9a-f]{64})$")


@dataclass(frozen=True)
class Request:
    """One request as the server saw it."""

    server: str  # "hub", "cdn" or "github"
    method: str
    path: str
    range: str | None
    authorization: str | None


class FakeHub:
    """Serves `files` {(repo_id, path): bytes}; optional bearer `token` for the `gated` repos.

    Use as a context manager (or call `close`). `url` is the value for HF_ENDPOINT.
    """

    def __init__(
        self,
        files: dict[tuple[str, str], bytes] | None = None,
        *,
        token: str | None = None,
        gated: tuple[str, ...] | set[str] = (),
    ) -> None:
        self.files: dict[tuple[str, str], bytes] = dict(files or {})
        #: GitHub raw files: {(owner/repo, commit, path): bytes}
        self.github_files: dict[tuple[str, str, str], bytes] = {}
        self.token = token
        self.gated: set[str] = set(gated)
        #: Bytes to send instead of a file's real content while advertising the real ETag/size
        #: (a transfer corrupted on the way).
        self.corrupt: dict[tuple[str, str], bytes] = {}
        #: While True every request gets a 503, as from a hub that is down.
        self.unavailable = False
        self.requests: list[Request] = []
        self.bytes_served = 0
        self._cut_after: int | None = None
        self._cut_only: bytes | None = None
        self._down_after_cut = False
        self._fail_after_cut = 0
        self._failing = 0  # how many more requests get a 503
        self._lock = threading.Lock()
        self._hub = _start(self, "hub")
        self._cdn = _start(self, "cdn")
        self._github = _start(self, "github")

    # -- addresses and content identities ------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._hub.server_address[1]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._cdn.server_address[1]}"

    @property
    def github_url(self) -> str:
        return f"http://127.0.0.1:{self._github.server_address[1]}"

    @staticmethod
    def commit(repo: str) -> str:
        return hashlib.sha1(f"commit of {repo}".encode()).hexdigest()

    @staticmethod
    def is_lfs(path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)

    @staticmethod
    def git_etag(data: bytes) -> str:
        """Git's blob sha1: what the hub sends as the ETag of a non-LFS file."""
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    # -- control ---------------------------------------------------------------------------------

    def cut_next_transfer(
        self, after: int, *, then_go_down: bool = False, then_fail: int = 0, only: bytes | None = None
    ) -> None:
        """Close the connection of the next GET body after `after` bytes (once), or of the next
        one serving the file whose content is `only`. Afterwards answer 503 to the next
        `then_fail` requests, or with `then_go_down` to everything until `unavailable` is reset."""
        with self._lock:
            self._cut_only = only
            self._cut_after = after
            self._down_after_cut = then_go_down
            self._fail_after_cut = then_fail

    def gets(self, server: str | None = None) -> list[Request]:
        """The GET requests made so far (to the hub, the CDN, or both)."""
        return [r for r in self.requests if r.method == "GET" and server in (None, r.server)]

    def reset_counters(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_served = 0

    def close(self) -> None:
        for server in (self._hub, self._cdn, self._github):
            server.shutdown()
            server.server_close()

    def __enter__(self) -> FakeHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- used by the handler ---------------------------------------------------------------------

    def _record(self, request: Request) -> None:
        with self._lock:
            self.requests.append(request)

    def _take_cut(self, data: bytes) -> int | None:
        with self._lock:
            if self._cut_only is not None and self._cut_only != data:
                return None
            cut, self._cut_after = self._cut_after, None
            if cut is not None:
                self.unavailable = self.unavailable or self._down_after_cut
                self._failing, self._fail_after_cut = self._fail_after_cut, 0
                self._down_after_cut = False
            return cut

    def _fails_now(self) -> bool:
        with self._lock:
            if self._failing:
                self._failing -= 1
                return True
            return self.unavailable

    def _served(self, n: int) -> None:
        with self._lock:
            self.bytes_served += n

    def _by_sha(self, sha: str) -> tuple[str, str] | None:
        for key, data in list(self.files.items()):
            if hashlib.sha256(data).hexdigest() == sha:
                return key
        return None


def _start(hub: FakeHub, role: str) -> ThreadingHTTPServer:
    handler = type(f"{role.title()}Handler", (_Handler,), {"hub": hub, "role": role})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, args=(0.02,), name=f"fake-{role}", daemon=True).start()
    return server


class _Handler(BaseHTTPRequestHandler):
    """HTTP/1.0: one request per connection, so a cut transfer is simply a closed socket."""

    hub: FakeHub
    role: str

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (stdlib's name)
        pass  # keep test output clean

    def do_HEAD(self) -> None:  # noqa: N802 (stdlib's name)
        self._handle(body=False)

    def do_GET(self) -> None:  # noqa: N802 (stdlib's name)
        self._handle(body=True)

    def do_POST(self) -> None:  # noqa: N802 (stdlib's name)
        self._handle(body=True)

    def _handle(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub._record(
            Request(
                self.role,
                self.command,
                path,
                self.headers.get("Range"),
                self.headers.get("Authorization"),
            )
        )
        if self.hub._fails_now():
            self._error(503, None, "Service Unavailable", body)
        elif self.role == "cdn":
            self._cdn(path, body)
        elif self.role == "github":
            self._raw(path, body)
        elif self.command == "POST":
            self._paths_info(path)
        else:
            self._resolve(path, body)

    # -- the hub ---------------------------------------------------------------------------------

    def _resolve(self, path: str, body: bool) -> None:
        hub = self.hub
        match = RESOLVE.match(path)
        if match is None:
            return self._error(404, "EntryNotFound", "Not found", body)
        repo, revision, file = match["repo"], match["revision"], match["path"]
        commit = self._repo_access(repo, revision, body)
        if commit is None:
            return None
        data = hub.files.get((repo, file))
        if data is None:
            return self._error(404, "EntryNotFound", f"{file} does not exist", body, commit)
        if hub.is_lfs(file):
            sha = hashlib.sha256(data).hexdigest()
            self.send_response(302)
            self.send_header("Location", f"{hub.cdn_url}/blobs/{sha}")
            self.send_header("X-Repo-Commit", commit)
            self.send_header("ETag", f'"{hub.git_etag(b"lfs pointer " + sha.encode())}"')
            self.send_header("X-Linked-Etag", f'"{sha}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        served = hub.corrupt.get((repo, file), data)
        self._content(served, body, etag=hub.git_etag(data), commit=commit)
        return None

    def _repo_access(self, repo: str, revision: str, body: bool) -> str | None:
        """The commit `revision` names in `repo`, or None after answering the hub's error."""
        hub = self.hub
        auth = self.headers.get("Authorization")
        if auth is not None and hub.token is not None and auth != f"Bearer {hub.token}":
            self._error(401, None, "Invalid credentials in Authorization header", body)
            return None
        known_repos = {r for r, _ in hub.files} | hub.gated
        if repo not in known_repos:
            self._error(404 if auth else 401, "RepoNotFound", "Repository not found", body)
            return None
        if repo in hub.gated and auth is None:
            message = (
                f"Access to model {repo} is restricted. You must have access to it and be "
                "authenticated to access it. Please log in."
            )
            self._error(401, "GatedRepo", message, body)
            return None
        commit = hub.commit(repo)
        if revision not in ("main", commit):
            self._error(404, "RevisionNotFound", "Invalid rev id: " + revision, body, commit)
            return None
        return commit

    def _paths_info(self, path: str) -> None:
        hub = self.hub
        length = int(self.headers.get("Content-Length") or 0)
        form = parse_qs(self.rfile.read(length).decode())
        match = PATHS_INFO.match(path)
        if match is None:
            return self._error(404, None, "Not found", True)
        repo = match["repo"]
        if self._repo_access(repo, match["revision"], True) is None:
            return None
        entries = []
        for wanted in form.get("paths", []):
            wanted = wanted.strip("/")
            data = hub.files.get((repo, wanted))
            if data is not None:
                entry = {"type": "file", "path": wanted, "size": len(data), "oid": hub.git_etag(data)}
                if hub.is_lfs(wanted):
                    sha = hashlib.sha256(data).hexdigest()
                    entry["oid"] = hub.git_etag(b"lfs pointer " + sha.encode())
                    entry["lfs"] = {"oid": sha, "size": len(data), "pointerSize": 134}
                entries.append(entry)
            elif any(r == repo and p.startswith(wanted + "/") for r, p in hub.files):
                entries.append({"type": "directory", "path": wanted, "oid": hub.git_etag(wanted.encode())})
        payload = json.dumps(entries).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)
        return None

    # -- GitHub's raw-content host -----------------------------------------------------------------

    def _raw(self, path: str, body: bool) -> None:
        match = RAW.match(path)
        data = self.hub.github_files.get((match["repo"], match["commit"], match["path"])) if match else None
        if data is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._content(data, body, etag=hashlib.sha256(data).hexdigest())

    # -- the CDN ---------------------------------------------------------------------------------

    def _cdn(self, path: str, body: bool) -> None:
        match = BLOB.match(path)
        key = self.hub._by_sha(match["sha"]) if match else None
        if key is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = self.hub.files[key]
        served = self.hub.corrupt.get(key, data)
        self._content(served, body, etag=hashlib.sha256(data).hexdigest())

    # -- responses -------------------------------------------------------------------------------

    def _content(self, data: bytes, body: bool, *, etag: str, commit: str | None = None) -> None:
        start, end = 0, len(data) - 1
        status = 200
        wanted = self.headers.get("Range")
        if wanted:
            found = re.fullmatch(r"bytes=(\d+)-(\d*)", wanted.strip())
            if found is None or int(found[1]) >= len(data):
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{len(data)}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            start = int(found[1])
            end = min(int(found[2]), end) if found[2] else end
            status = 206
        chunk = data[start : end + 1]
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(chunk)))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", f'"{etag}"')
        if commit:
            self.send_header("X-Repo-Commit", commit)
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        if not body:
            return
        cut = self.hub._take_cut(data)
        if cut is not None and cut < len(chunk):
            chunk = chunk[:cut]
            self.close_connection = True
        # Counted before the write: the client can finish reading, and the test read the count,
        # before this thread runs again after a write.
        self.hub._served(len(chunk))
        self.wfile.write(chunk)
        self.wfile.flush()

    def _error(self, status: int, code: str | None, message: str, body: bool, commit: str | None = None) -> None:
        payload = json.dumps({"error": message}).encode()
        self.send_response(status)
        if code:
            self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body:
            self.wfile.write(payload)


def use_fake_hub(hub: FakeHub, monkeypatch: pytest.MonkeyPatch, hf_home: Path) -> None:
    """Point huggingface_hub at `hub`, with no token, cache or network of the user's.

    huggingface_hub reads its environment once, at import, into `huggingface_hub.constants`, and
    reads those constants at call time; setting the variables now is therefore not enough when it
    is already imported (pytest imports it early), so the constants are patched as well. The
    environment is set too, for code that reads it at call time (macaron_local.download does) and
    for subprocesses. Disabling telemetry matters beyond politeness: without it, huggingface_hub
    2.4's `build_hf_headers` fetches `{ENDPOINT}/api/agent-harnesses` once per process (to tag the
    user agent) and caches it under HF_HOME.
    """
    from huggingface_hub import constants

    env = {
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_XET_CACHE": str(hf_home / "xet"),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
        "MACARON_GITHUB_RAW_URL": hub.github_url,
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HUGGINGFACE_CO_STAGING"):
        monkeypatch.delenv(name, raising=False)

    patched = {
        "ENDPOINT": hub.url,
        "HUGGINGFACE_CO_URL_TEMPLATE": hub.url + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(hf_home),
        "HF_HUB_CACHE": str(hf_home / "hub"),
        "HF_XET_CACHE": str(hf_home / "xet"),
        "HF_TOKEN_PATH": str(hf_home / "token"),
        "HF_STORED_TOKENS_PATH": str(hf_home / "stored_tokens"),
        "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True,
        "HF_HUB_DISABLE_XET": True,
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": True,
    }
    for name, value in patched.items():
        monkeypatch.setattr(constants, name, value, raising=False)
