"""The `[engine]` table of settings.toml: which engine runs the model.

    [engine]
    kind = "llama-server"          # "local" (default: llama.cpp in this process), "llama-server" or "vllm"
    url = "http://gpu-box:8080"    # a server the user runs; without it, llama-server is started here
    binary = "~/bin/llama-server"  # the llama-server to start (default: the one on PATH)
    cache_prompt = false           # a user's llama-server: true only if it runs with --cache-ram 0
    timeout_s = 600                # one request past this fails in one line
    lora_path_prefix = "/models"   # vLLM: where the server sees this machine's adapter folders

A server's bearer token lives in the OS keyring (`macaron auth engine-token`), never here.
Every value is checked when read; a bad one is one line naming the key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from macaron_local.errors import InvalidInputError

KINDS = ("local", "llama-server", "vllm")


@dataclass(frozen=True)
class RemoteEngineConfig:
    kind: str = "local"
    url: str | None = None
    binary: str | None = None
    cache_prompt: bool = False
    timeout_s: float = 600.0
    lora_path_prefix: str | None = None

    @property
    def remote(self) -> bool:
        return self.kind != "local"

    def describe(self) -> str:
        if self.kind == "local":
            return "llama.cpp in this process"
        return f"{self.kind} at {self.url}" if self.url else f"{self.kind} started here"


def engine_config(table: Mapping[str, Any] | None) -> RemoteEngineConfig:
    table = table or {}
    if not isinstance(table, Mapping):
        raise InvalidInputError("settings [engine] must be a table")
    kind = table.get("kind", "local")
    if kind not in KINDS:
        raise InvalidInputError(f"settings [engine] kind must be one of {', '.join(KINDS)} (got {kind!r})")
    url = table.get("url")
    if url is not None:
        parsed = urlparse(url) if isinstance(url, str) else None
        if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise InvalidInputError("settings [engine] url must be an http:// or https:// address")
    if kind == "vllm" and url is None:
        raise InvalidInputError('settings [engine] kind = "vllm" needs url = the vLLM server\'s address')
    for key in ("binary", "lora_path_prefix"):
        if table.get(key) is not None and (not isinstance(table[key], str) or not table[key]):
            raise InvalidInputError(f"settings [engine] {key} must be a path")
    if not isinstance(table.get("cache_prompt", False), bool):
        raise InvalidInputError("settings [engine] cache_prompt must be true or false")
    timeout = table.get("timeout_s", 600.0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 1 <= timeout <= 86400:
        raise InvalidInputError("settings [engine] timeout_s must be a number from 1 to 86400")
    return RemoteEngineConfig(
        kind=kind,
        url=url,
        binary=table.get("binary"),
        cache_prompt=table.get("cache_prompt", False),
        timeout_s=float(timeout),
        lora_path_prefix=table.get("lora_path_prefix"),
    )
