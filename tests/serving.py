"""A real `macaron serve` process on this machine for tests and benchmarks, and a small raw
HTTP client (http.client) for what the openai client cannot send: broken JSON, huge bodies,
a connection closed mid-stream."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Server:
    process: subprocess.Popen
    host: str
    port: int

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def connection(self, timeout: float = 120) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | dict | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 120,
    ) -> tuple[int, dict[str, str], Any]:
        """(status, headers, parsed JSON body) of one request."""
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        connection = self.connection(timeout)
        try:
            connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
            response = connection.getresponse()
            raw = response.read()
            return response.status, dict(response.getheaders()), json.loads(raw) if raw else None
        finally:
            connection.close()

    def stop(self) -> str:
        """Stop the server (as Ctrl-C would) and return what it wrote to stderr."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.stderr.read() if self.process.stderr else ""


def start_server(home: Path | str, *args: str, env: dict[str, str] | None = None, timeout: float = 180) -> Server:
    """Start `macaron serve --port 0 ARGS` and wait until it answers `/v1/models`."""
    environ = {**os.environ, "MACARON_HOME": str(home), "HF_HUB_OFFLINE": "1", **(env or {})}
    process = subprocess.Popen(
        [sys.executable, "-m", "macaron_local", "serve", "--port", "0", *args],
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline() if process.stdout else ""
    found = re.search(r"http://\[?([^\]/]+?)\]?:(\d+)/v1", line)
    if not found:
        process.kill()
        raise RuntimeError(f"the server did not start: {line!r} {process.communicate()[1]!r}")
    server = Server(process, found.group(1), int(found.group(2)))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            server.request("GET", "/v1/models")
            return server
        except OSError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError("the server never answered")


def sse_events(response: http.client.HTTPResponse):
    """The JSON objects of an SSE stream, up to `[DONE]`."""
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line[len("data: ") :])
