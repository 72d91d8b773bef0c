"""A small JSON-over-HTTP client for remote engines (llama-server, vLLM), on the standard library.

Remote engines are reached only when the user configured one (`[engine]` in settings), so this
client never runs otherwise. Every failure (refused connection, timeout, an error status, a body
that is not JSON) becomes one `EngineUnavailableError` line naming the server, never a
traceback. Streams are server-sent events: `data: {...}` lines, `data: [DONE]` at the end.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from macaron_local.errors import MacaronError


class EngineUnavailableError(MacaronError):
    """The remote engine could not be reached, or answered with an error."""


class JsonClient:
    def __init__(self, base_url: str, *, token: str | None = None, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def _request(self, method: str, path: str, body: Any | None) -> urllib.request.Request:
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)

    def _open(self, request: urllib.request.Request, timeout: float | None = None):
        try:
            return urllib.request.urlopen(request, timeout=timeout or self.timeout_s)
        except urllib.error.HTTPError as exc:
            detail = _error_detail(exc.read(4096))
            raise EngineUnavailableError(f"{request.full_url}: HTTP {exc.code}{detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            raise EngineUnavailableError(f"cannot reach {request.full_url}: {reason}") from None

    def get(self, path: str, timeout: float | None = None) -> Any:
        with self._open(self._request("GET", path, None), timeout) as response:
            return _parse(response.read(), self.base_url + path)

    def post(self, path: str, body: Any, timeout: float | None = None) -> Any:
        with self._open(self._request("POST", path, body), timeout) as response:
            return _parse(response.read(), self.base_url + path)

    def post_text(self, path: str, body: Any, timeout: float | None = None) -> str:
        """POST `body` to an endpoint that answers in plain text (vLLM's adapter loading says
        "Success: ..." as text/plain; its errors are still JSON, read by `_open`)."""
        with self._open(self._request("POST", path, body), timeout) as response:
            return response.read().decode("utf-8", errors="replace")

    def stream(self, path: str, body: Any) -> Iterator[dict[str, Any]]:
        """POST `body` and yield each server-sent event's JSON object until the stream ends.
        Closing the iterator closes the connection, which stops the server's generation."""
        response = self._open(self._request("POST", path, body))
        try:
            for raw in response:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    return
                event = _parse(payload.encode("utf-8"), self.base_url + path)
                if isinstance(event, dict) and "error" in event:
                    raise EngineUnavailableError(f"{self.base_url}{path}: {_message(event['error'])}")
                yield event
        except (ConnectionError, TimeoutError) as exc:
            raise EngineUnavailableError(f"{self.base_url}{path}: the stream broke ({exc})") from None
        finally:
            response.close()


def _parse(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        raise EngineUnavailableError(f"{where} did not answer with JSON") from None


def _message(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def _error_detail(data: bytes) -> str:
    try:
        body = json.loads(data)
    except ValueError:
        text = data.decode("utf-8", errors="replace").strip()
        return f": {text[:200]}" if text else ""
    if isinstance(body, dict):
        for key in ("error", "detail", "message"):
            if key in body:
                return f": {_message(body[key])[:200]}"
    return ""
