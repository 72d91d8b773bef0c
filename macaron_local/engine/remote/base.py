"""What every remote engine shares: the in-process engine's interface over a server.

Session, protocol, tools and learning talk to an engine through a small surface (tokens,
prompts, adapters, `stream`/`generate`, `token_logprobs`, `best_next`). A remote engine keeps
that surface and moves the model to a server: llama.cpp's `llama-server` or vLLM. What stays
here is the bookkeeping both need: validated adapter handles keyed by content, the active set
and its view, and assembling a `Completion` from a server's stream. The server keeps its own
KV cache per adapter set, so a view switch costs nothing here.
"""

from __future__ import annotations

import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from macaron_local.adapters.validate import AdapterReport, BaseModelInfo, validate_adapter
from macaron_local.engine.llama_engine import (
    AdapterHandle,
    AdapterSet,
    Completion,
    EngineConfig,
    GenerationParams,
    Streams,
    file_key,
)
from macaron_local.engine.template import ChatTemplate, Message, fit_messages
from macaron_local.errors import AdapterError, MacaronError


@dataclass
class Piece:
    """One step of a server's stream: new token ids and their text; `finish` on the last."""

    tokens: list[int]
    text: str
    finish: str = ""  # "stop" or "length" once the server is done
    reused_prompt_tokens: int | None = None
    stop_token: int | None = None  # the end-of-generation token a "stop" ended on, if known


class RemoteEngine(AdapterSet, Streams, ABC):
    """An engine whose model runs in a server. Like `Engine`, one generation at a time."""

    kind = "remote"

    def __init__(self, config: EngineConfig, base_info: BaseModelInfo | None) -> None:
        self.config = config
        self.base_info = base_info  # None: the base file is not on this machine (a remote box)
        self._lock = threading.RLock()
        self._adapters: dict[str, AdapterHandle] = {}
        self._active: tuple[tuple[str, float], ...] = ()
        self._view = ""
        self._closed = False
        self.switch_count = 0

    # ----------------------------------------------------------------- subclasses
    @property
    @abstractmethod
    def template(self) -> ChatTemplate: ...

    @abstractmethod
    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]: ...

    @abstractmethod
    def detokenize(self, tokens: Sequence[int]) -> str: ...

    @abstractmethod
    def render_tokens(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, *, continue_final: bool = False,
        **variables: object,
    ) -> list[int]: ...  # fmt: skip

    @abstractmethod
    def _register(self, handle: AdapterHandle, name: str | None) -> None:
        """Make the server able to apply `handle` (load it, or check it was loaded at start)."""

    def _unregister(self, handle: AdapterHandle) -> None:  # noqa: B027 - optional for subclasses
        """Let the server free `handle` where it can."""

    @abstractmethod
    def _pieces(self, prompt: list[int], params: GenerationParams) -> Iterator[Piece]:
        """The server's stream for one generation under the active set."""

    @abstractmethod
    def _score(self, prompt: list[int], completion: list[int]) -> list[float]:
        """log p of each completion token, teacher-forced, under the active set."""

    @abstractmethod
    def best_next(self, tokens: Sequence[int], allowed: Sequence[int]) -> int:
        """The most likely token after `tokens` among `allowed` (the route hop's choice)."""

    @abstractmethod
    def _shutdown(self) -> None: ...

    # ----------------------------------------------------------------- tokens and prompts
    def token_text(self, token: int) -> str:
        return "" if token < 0 else self.detokenize([token])

    def prompt_for(
        self, messages: Sequence[Message], max_new_tokens: int, **variables: object
    ) -> tuple[list[int], int]:
        """As `Engine.prompt_for`: the oldest turns (never system prompts) give way to fit."""
        budget = self.config.n_ctx - max_new_tokens
        kept, dropped = fit_messages(messages, lambda m: len(self.render_tokens(m, **variables)), budget)
        return self.render_tokens(kept, **variables), dropped

    # ----------------------------------------------------------------- adapters
    def load_adapter(self, path: str | os.PathLike[str], *, name: str | None = None) -> AdapterHandle:
        """Validate an adapter here (a malformed file never reaches any server) and make the
        server able to apply it. `name` is the expert's slot where the server knows experts
        by name (vLLM's `L0`..`L3`)."""
        path = Path(path).resolve()
        with self._lock:
            key = file_key(path) if path.is_file() else "dir-" + path.name
            if key in self._adapters:
                return self._adapters[key]
            if self.base_info is not None and path.is_file():
                report = validate_adapter(path, self.base_info)
            else:
                report = AdapterReport(path, "unchecked here", 0.0, (), 0, ())
            handle = AdapterHandle(key=key, path=path, report=report, pointer=name)
            self._register(handle, name)
            self._adapters[key] = handle
            return handle

    def unload_adapter(self, handle: AdapterHandle) -> None:
        with self._lock:
            if any(key == handle.key for key, _ in self._active):
                raise AdapterError(f"adapter {handle.path} is active; switch away from it first")
            if self._adapters.pop(handle.key, None) is not None:
                self._unregister(handle)

    def set_adapters(
        self,
        adapters: Sequence[AdapterHandle | tuple[AdapterHandle, float]],
        *,
        view: str = "",
        remember: bool = True,
    ) -> bool:
        """Make exactly `adapters` active for `view` (the server keeps the KV per set)."""
        pairs = [(a, 1.0) if isinstance(a, AdapterHandle) else a for a in adapters]
        new_key = tuple((handle.key, float(scale)) for handle, scale in pairs)
        with self._lock:
            for handle, _ in pairs:
                if handle.key not in self._adapters:
                    raise AdapterError(f"adapter {handle.path} was not loaded by this engine")
            changed = new_key != self._active or view != self._view
            if new_key != self._active:
                self.switch_count += 1
            self._active, self._view = new_key, view
            return changed

    # ----------------------------------------------------------------- generation
    def _stream(
        self, prompt: list[int], params: GenerationParams, cancel: threading.Event | None, result: Completion
    ) -> Iterator[str]:
        if len(prompt) + 1 > self.config.n_ctx:
            raise MacaronError(f"the prompt ({len(prompt)} tokens) does not fit the context ({self.config.n_ctx})")
        params = replace(params, max_tokens=min(params.max_tokens, self.config.n_ctx - len(prompt)))
        with self._lock:
            started = time.perf_counter()
            result.finish_reason = "length"
            pieces = self._pieces(prompt, params)
            try:
                for piece in pieces:
                    if piece.reused_prompt_tokens is not None:
                        result.reused_prompt_tokens = piece.reused_prompt_tokens
                    if piece.tokens and not result.tokens:
                        result.ttft_ms = (time.perf_counter() - started) * 1000
                    if cancel is not None and cancel.is_set():
                        result.finish_reason = "cancelled"
                        break
                    room = params.max_tokens - len(result.tokens)
                    result.tokens.extend(piece.tokens[:room])
                    if piece.text:
                        result.text += piece.text
                        yield piece.text
                    if piece.finish:
                        result.finish_reason = piece.finish
                        if piece.finish == "stop":
                            result.stop_token = piece.stop_token if piece.stop_token is not None else self.stop_token()
                        break
            finally:
                pieces.close()  # type: ignore[attr-defined]  # drops the connection: the server stops
                result.total_ms = (time.perf_counter() - started) * 1000

    def stop_token(self) -> int | None:
        """The template's end-of-message token (what a "stop" reply ends on), read once."""
        if not hasattr(self, "_stop_token"):
            eos = self.template.eos_token
            tokens = self.tokenize(eos, special=True) if eos else []
            self._stop_token = tokens[0] if len(tokens) == 1 else None
        return self._stop_token

    # ----------------------------------------------------------------- scoring
    def token_logprobs(self, prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> np.ndarray:
        """As `Engine.token_logprobs`, computed by the server (teacher-forced)."""
        prompt, completion = list(prompt_tokens), list(completion_tokens)
        if not prompt:
            raise MacaronError("scoring needs at least one prompt token")
        if not completion:
            return np.zeros(0)
        if len(prompt) + len(completion) > self.config.n_ctx:
            raise MacaronError(f"{len(prompt) + len(completion)} tokens do not fit the context ({self.config.n_ctx})")
        with self._lock:
            values = self._score(prompt, completion)
        if len(values) != len(completion):
            raise MacaronError(f"the engine scored {len(values)} of {len(completion)} tokens")
        return np.asarray(values, dtype=np.float64)

    def next_logits(self, tokens: Sequence[int]) -> np.ndarray:
        raise MacaronError(f"a {self.kind} engine does not return whole logit rows; use best_next")

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._adapters.clear()
            self._active = ()
            self._shutdown()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
