"""vLLM as the engine, the way Mind Lab serves Tall: native multi-LoRA, one model name per expert.

The server is started by the user (on a GPU box) with the experts registered by name:

    vllm serve Qwen/Qwen3.6-35B-A3B --enable-lora --max-lora-rank 64 --max-loras 4 \\
        --lora-modules L0=/models/L0 L1=/models/L1 L2=/models/L2 L3=/models/L3

A request picks its adapter with `model`. vLLM applies one LoRA per request, so an expert
with the user's personal adapter stacked on it is served as one adapter: the two stacked
along the rank (exact: B1 A1 + B2 A2 = [B1 B2] [A1; A2]), built here from their PEFT folders
and loaded through vLLM's runtime API (`/v1/load_lora_adapter`, which needs the server started
with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). vLLM loads PEFT folders, not GGUF: a GGUF adapter
is served from the PEFT folder exported next to it (`<name>.peft/`).

Everything the session needs maps onto vLLM's OpenAI-compatible API and its extensions:
tokens (`/tokenize` with `messages`, rendered by the model's own template on the server),
completions on token ids (`return_token_ids`), teacher-forced scoring (`prompt_logprobs`) and
the route hop's choice (`allowed_token_ids`). The request builders are plain functions so
that what is sent can be checked without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from macaron_local.adapters.validate import BaseModelInfo
from macaron_local.engine.llama_engine import AdapterHandle, EngineConfig, GenerationParams
from macaron_local.engine.remote.base import Piece, RemoteEngine
from macaron_local.engine.remote.http import JsonClient
from macaron_local.engine.template import CHATML, ChatTemplate, Message
from macaron_local.errors import AdapterError, MacaronError
from macaron_local.store.adapter_files import STACK_PREFIX


def peft_folder(path: Path) -> Path:
    """The PEFT folder vLLM loads for `path` (a PEFT folder itself, or a GGUF's export)."""
    return path if path.is_dir() else path.with_suffix(".peft")


def completion_request(model: str, prompt: Sequence[int], params: GenerationParams, seed: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": [int(t) for t in prompt],
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_k": params.top_k if params.temperature > 0 else -1,
        "top_p": params.top_p if params.temperature > 0 else 1.0,
        "min_p": params.min_p if params.temperature > 0 else 0.0,
        "repetition_penalty": params.repeat_penalty,
        "seed": params.seed if params.seed is not None else seed,
        "stream": True,
        "return_token_ids": True,
        "skip_special_tokens": True,
    }
    if params.grammar is not None:
        body["structured_outputs"] = {"grammar": params.grammar}
    return body


def scoring_request(model: str, prompt: Sequence[int], completion: Sequence[int]) -> dict[str, Any]:
    """Teacher forcing: the completion is part of the prompt, and vLLM returns each prompt
    token's log-probability (`prompt_logprobs = 0`: only the token itself)."""
    return {
        "model": model,
        "prompt": [int(t) for t in [*prompt, *completion]],
        "max_tokens": 1,
        "temperature": 0.0,
        "prompt_logprobs": 0,
    }


def choice_request(model: str, tokens: Sequence[int], allowed: Sequence[int]) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": [int(t) for t in tokens],
        "max_tokens": 1,
        "temperature": 0.0,
        "allowed_token_ids": sorted({int(t) for t in allowed}),
        "return_token_ids": True,
    }


def render_request(
    model: str, messages: Sequence[Message], add_generation_prompt: bool, continue_final: bool, variables: dict
) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [dict(m) for m in messages],
        "add_generation_prompt": add_generation_prompt and not continue_final,
        "continue_final_message": continue_final,
        "add_special_tokens": False,  # the template writes BOS itself where the model wants one
        "chat_template_kwargs": variables,
    }


def scored_logprobs(response: dict[str, Any], prompt_length: int, completion: Sequence[int]) -> list[float]:
    """The completion's log-probabilities from a scoring response's `prompt_logprobs`."""
    rows = response["choices"][0]["prompt_logprobs"]
    values = []
    for row, token in zip(rows[prompt_length:], completion, strict=False):
        entry = (row or {}).get(str(int(token)))
        if entry is None:
            raise MacaronError(f"vLLM did not score token {token}")
        values.append(float(entry["logprob"]))
    return values


def stream_piece(event: dict[str, Any]) -> Piece:
    """One streamed completion chunk as a Piece. A reply ended by the model's end token
    ("stop" with no stop string) carries that token last in `token_ids`; it is taken off."""
    choice = (event.get("choices") or [{}])[0]
    tokens = [int(t) for t in choice.get("token_ids") or []]
    reason = choice.get("finish_reason") or ""
    stop_token = None
    if reason == "stop" and choice.get("stop_reason") is None and tokens:
        stop_token = tokens.pop()
    finish = {"stop": "stop", "length": "length"}.get(reason, "stop" if reason else "")
    return Piece(tokens, str(choice.get("text") or ""), finish, None, stop_token)


def _local_template(path: Path) -> str | None:
    """The base file's chat template when it is on this machine (the tool family is read from
    it); rendering itself is the server's, with the model's own template."""
    if not path.is_file():
        return None
    from macaron_local.adapters.gguf_header import MODEL_LIMITS, read_header
    from macaron_local.errors import ModelError

    value = read_header(path, ModelError, MODEL_LIMITS).value("tokenizer.chat_template")
    return value if isinstance(value, str) else None


def stacked_name(pairs: Sequence[tuple[AdapterHandle, float]]) -> str:
    return "macaron-" + "+".join(f"{h.key}x{scale:g}" for h, scale in pairs)


class VllmEngine(RemoteEngine):
    kind = "vllm"

    def __init__(
        self,
        config: EngineConfig,
        *,
        url: str,
        token: str | None = None,
        timeout_s: float = 600.0,
        path_prefix: str | None = None,
    ) -> None:
        local_base = config.model_path.is_file()
        super().__init__(config, BaseModelInfo.from_gguf(config.model_path) if local_base else None)
        self.client = JsonClient(url, token=token, timeout_s=timeout_s)
        self.path_prefix = path_prefix
        self._names: dict[str, str] = {}  # adapter key -> vLLM model name
        self._stack_dirs: dict[str, Path] = {}  # stacked set name -> the folder written and loaded for it
        models = self.client.get("/v1/models").get("data") or []
        self.base_model = next((m["id"] for m in models if not m.get("parent")), models[0]["id"] if models else "")
        self._served = {m["id"] for m in models}
        self._template = ChatTemplate(_local_template(config.model_path) or CHATML)

    @property
    def template(self) -> ChatTemplate:
        return self._template

    def _model(self) -> str:
        """The model name of the active set: the base, one adapter, or a stacked adapter."""
        pairs = self.active_handles()
        if not pairs:
            return self.base_model
        if len(pairs) == 1 and pairs[0][1] == 1.0:
            return self._names[pairs[0][0].key]
        name = stacked_name(pairs)
        if name not in self._stack_dirs:
            self._load_stack(pairs, name)
        return name

    def _load_stack(self, pairs: Sequence[tuple[AdapterHandle, float]], name: str) -> None:
        from macaron_local.adapters.peft_stack import stack_peft

        folders = [peft_folder(h.path) for h, _ in pairs]
        missing = [str(f) for f in folders if not (f / "adapter_config.json").is_file()]
        if missing:
            raise AdapterError(f"vLLM serves one adapter per request; to stack, {missing[0]} must be a PEFT folder")
        # Next to the personal adapter's folder (where the server sees adapters), named after
        # this process and the keys stacked: it holds the user's weights, so it is deleted
        # when any of them is unloaded or the engine closes, a forget removes it with its
        # version's files, and a garbage collection takes one a dead process left.
        target = folders[-1].parent / f"{STACK_PREFIX}{os.getpid()}-{name}.peft"
        stack_peft([(f, s) for f, (_, s) in zip(folders, pairs, strict=True)], target)
        self._stack_dirs[name] = target
        self._load(name, target)

    def _drop_stack(self, name: str) -> None:
        if name in self._served:
            with contextlib.suppress(MacaronError):  # the server may be gone; the folder still goes
                self.client.post_text("/v1/unload_lora_adapter", {"lora_name": name}, timeout=10)
            self._served.discard(name)
        folder = self._stack_dirs.pop(name, None)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)

    def _server_path(self, folder: Path) -> str:
        return str(Path(self.path_prefix) / folder.name) if self.path_prefix else str(folder)

    def _load(self, name: str, folder: Path) -> None:
        self.client.post_text("/v1/load_lora_adapter", {"lora_name": name, "lora_path": self._server_path(folder)})
        self._served.add(name)

    # ----------------------------------------------------------------- tokens
    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
        body = {"model": self.base_model, "prompt": text, "add_special_tokens": add_bos}
        return [int(t) for t in self.client.post("/tokenize", body)["tokens"]]

    def detokenize(self, tokens: Sequence[int]) -> str:
        body = {"model": self.base_model, "tokens": [int(t) for t in tokens]}
        return str(self.client.post("/detokenize", body)["prompt"])

    def render_tokens(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, *, continue_final: bool = False,
        **variables: object,
    ) -> list[int]:  # fmt: skip
        body = render_request(self.base_model, messages, add_generation_prompt, continue_final, dict(variables))
        return [int(t) for t in self.client.post("/tokenize", body)["tokens"]]

    # ----------------------------------------------------------------- adapters
    def _register(self, handle: AdapterHandle, name: str | None) -> None:
        if name is not None and name in self._served:
            self._names[handle.key] = name  # an expert registered at the server's start
            return
        folder = peft_folder(handle.path)
        if not (folder / "adapter_config.json").is_file():
            raise AdapterError(f"vLLM loads PEFT folders; {folder} (for {handle.path.name}) is not one")
        served = f"macaron-{handle.key}"
        self._load(served, folder)
        self._names[handle.key] = served

    def _unregister(self, handle: AdapterHandle) -> None:
        for stack in [n for n in self._stack_dirs if handle.key in n]:
            self._drop_stack(stack)
        name = self._names.pop(handle.key, None)
        if name is not None and name.startswith("macaron-"):
            self.client.post_text("/v1/unload_lora_adapter", {"lora_name": name})
            self._served.discard(name)

    # ----------------------------------------------------------------- generation
    def _pieces(self, prompt: list[int], params: GenerationParams) -> Iterator[Piece]:
        body = completion_request(self._model(), prompt, params, self.config.seed)
        for event in self.client.stream("/v1/completions", body):
            yield stream_piece(event)

    def _score(self, prompt: list[int], completion: list[int]) -> list[float]:
        response = self.client.post("/v1/completions", scoring_request(self._model(), prompt, completion))
        return scored_logprobs(response, len(prompt), completion)

    def best_next(self, tokens: Sequence[int], allowed: Sequence[int]) -> int:
        with self._lock:
            response = self.client.post("/v1/completions", choice_request(self._model(), tokens, allowed))
        got = [int(t) for t in (response["choices"][0].get("token_ids") or [])]
        if not got or got[0] not in set(allowed):
            raise MacaronError("vLLM answered outside the allowed tokens")
        return got[0]

    def _shutdown(self) -> None:
        for stack in list(self._stack_dirs):
            self._drop_stack(stack)
        for name in [n for n in self._served if n.startswith("macaron-")]:
            with contextlib.suppress(MacaronError):  # the server may be gone; nothing here holds memory
                self.client.post_text("/v1/unload_lora_adapter", {"lora_name": name}, timeout=10)
