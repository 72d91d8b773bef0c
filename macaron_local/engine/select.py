"""Open the engine the settings choose: llama.cpp in this process, or a remote server.

Everything that runs the model (the session, `ask`, learning's rollouts and its gate) opens it
here, so one `[engine]` table moves all of them at once.
"""

from __future__ import annotations

from macaron_local.engine.llama_engine import Engine, EngineConfig
from macaron_local.engine.remote.base import RemoteEngine
from macaron_local.engine.remote.config import RemoteEngineConfig, engine_config

AnyEngine = Engine | RemoteEngine


def open_engine(config: EngineConfig, remote: RemoteEngineConfig | None = None) -> AnyEngine:
    remote = remote or RemoteEngineConfig()
    if remote.kind == "local":
        return Engine(config)
    from macaron_local import secrets

    token = secrets.get_engine_token() if remote.url else None  # a server started here needs none
    if remote.kind == "llama-server":
        from macaron_local.engine.remote.llama_server import LlamaServerEngine

        return LlamaServerEngine(
            config, url=remote.url, binary=remote.binary, token=token,
            cache_prompt=remote.cache_prompt, timeout_s=remote.timeout_s,
        )  # fmt: skip
    from macaron_local.engine.remote.vllm import VllmEngine

    assert remote.url is not None  # engine_config requires it
    return VllmEngine(
        config, url=remote.url, token=token, timeout_s=remote.timeout_s, path_prefix=remote.lora_path_prefix
    )


def engine_settings(settings: object) -> RemoteEngineConfig:
    """The checked `[engine]` table of `settings` (a Settings or a plain mapping)."""
    get = getattr(settings, "get", None)
    table = get("engine") if callable(get) else None
    return engine_config(table)
