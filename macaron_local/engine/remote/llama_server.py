"""llama.cpp's own `llama-server` as the engine: one started here, or one the user runs elsewhere.

llama-server loads adapters only at start (`--lora a.gguf,b.gguf --lora-init-without-apply`) and
picks them per request with a `lora` list of ids and scales. So a server started here is
restarted with the longer list when an adapter it lacks is loaded (a new night's personal
version); a server the user runs must have been started with every adapter it is asked for.

Its known traps (see shared notes) are avoided, not hoped away:
- adapters loaded with `--lora-init-without-apply` are applied at scale 1.0 to a request that
  names none, so every request lists every adapter, with 0.0 for the inactive ones;
- the host-RAM prompt cache ignores which adapters computed it, so a started server runs with
  `--cache-ram 0`; against a user's server, prompt caching is off unless `cache_prompt = true`
  says it runs that way too.
Teacher-forced scoring uses llama.cpp's token-id grammar (`<[id]>`): the server is made to emit
exactly the given tokens and reports each one's log-probability before sampling.
"""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from macaron_local.adapters.validate import BaseModelInfo
from macaron_local.engine.llama_engine import AdapterHandle, EngineConfig, GenerationParams, default_threads
from macaron_local.engine.llama_load import server_flags
from macaron_local.engine.remote.base import Piece, RemoteEngine
from macaron_local.engine.remote.http import EngineUnavailableError, JsonClient
from macaron_local.engine.template import CHATML, ChatTemplate, Message, continue_final_message
from macaron_local.errors import AdapterError, MacaronError

#: llama-cpp-python's sampler order, so that both engines sample alike.
SAMPLERS = ["penalties", "top_k", "typ_p", "top_p", "min_p", "temperature"]
START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def forced_grammar(tokens: Sequence[int]) -> str:
    """GBNF that allows exactly `tokens`, by id (end-of-generation tokens are left out: the
    grammar's end already allows only those)."""
    return "root ::= " + " ".join(f"<[{int(t)}]>" for t in tokens)


def choice_grammar(tokens: Sequence[int]) -> str:
    return "root ::= " + " | ".join(f"<[{int(t)}]>" for t in sorted(set(tokens)))


class ManagedServer:
    """A llama-server process on 127.0.0.1 owned by this engine (stopped with it)."""

    def __init__(self, binary: Path, model: Path, config: EngineConfig) -> None:
        self.binary, self.model, self.config = binary, model, config
        self.adapters: list[Path] = []
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.restarts = -1  # the first start is not a restart
        self._log_dir = Path(tempfile.mkdtemp(prefix="macaron-llama-server-"))
        self.log_path = self._log_dir / "server.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        threads = str(self.config.n_threads or default_threads())
        args = [
            str(self.binary), "-m", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
            "-c", str(self.config.n_ctx), "-b", str(self.config.n_batch), "-ub", str(self.config.n_batch),
            "-t", threads, "-tb", threads, "-np", "1", "-fa", "off", "--cache-ram", "0",
            "--seed", str(self.config.seed), "--no-webui", "--no-warmup", *server_flags(),
        ]  # fmt: skip
        if self.config.kv_f32:
            args += ["-ctk", "f32", "-ctv", "f32"]
        if self.adapters:
            args += ["--lora", ",".join(str(p) for p in self.adapters), "--lora-init-without-apply"]
        return args

    def start(self, adapters: list[Path]) -> None:
        self.stop()
        self.adapters = list(adapters)
        self.port = free_port()
        log = open(self.log_path, "ab")  # noqa: SIM115 - the process owns it until it exits
        self.process = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        log.close()
        _RUNNING.add(self)
        self.restarts += 1
        client = JsonClient(self.url, timeout_s=5)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineUnavailableError(f"llama-server exited at start: {self.last_log_line()}")
            try:
                if client.get("/health").get("status") == "ok":
                    return
            except EngineUnavailableError:
                pass
            time.sleep(0.2)
        self.stop()
        raise EngineUnavailableError(f"llama-server did not become ready in {START_TIMEOUT_S:.0f} s")

    def last_log_line(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        return lines[-1][:300] if lines else "no output"

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop()
        _RUNNING.discard(self)
        shutil.rmtree(self._log_dir, ignore_errors=True)


#: Servers started here and not yet closed: stopped when this process exits, however it exits
#: short of SIGKILL (a thread-bound PR_SET_PDEATHSIG would stop them when a worker ends).
_RUNNING: set[ManagedServer] = set()


@atexit.register
def _stop_running() -> None:
    for server in list(_RUNNING):
        server.stop()


def find_binary(configured: str | None) -> Path:
    candidate = configured or shutil.which("llama-server")
    if not candidate:
        raise MacaronError("no llama-server binary: set [engine] binary, put llama-server on PATH, or set [engine] url")
    path = Path(os.path.expanduser(candidate))
    if not path.is_file() or not os.access(path, os.X_OK):
        raise MacaronError(f"[engine] binary {path} is not an executable file")
    return path


class LlamaServerEngine(RemoteEngine):
    kind = "llama-server"

    def __init__(
        self,
        config: EngineConfig,
        *,
        url: str | None = None,
        binary: str | None = None,
        token: str | None = None,
        cache_prompt: bool | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        local_base = config.model_path.is_file()
        super().__init__(config, BaseModelInfo.from_gguf(config.model_path) if local_base else None)
        self.managed: ManagedServer | None = None
        if url is None:
            if not local_base:
                raise MacaronError(f"the base model {config.model_path} is not here to start llama-server with")
            self.managed = ManagedServer(find_binary(binary), config.model_path, config)
            self.managed.start([])
            url = self.managed.url
        self.client = JsonClient(url, token=token, timeout_s=timeout_s)
        self.cache_prompt = True if self.managed else bool(cache_prompt)
        self._ids: dict[str, int] = {}  # adapter key -> the server's adapter id
        self._eog: frozenset[int] | None = None
        self._template: ChatTemplate | None = None
        self._props: dict[str, Any] = {}
        try:
            self._read_props()
        except BaseException:
            self._shutdown()
            raise

    # ----------------------------------------------------------------- server facts
    def _read_props(self) -> None:
        self._props = self.client.get("/props")
        self._template = ChatTemplate(
            self._props.get("chat_template") or CHATML,
            bos_token=self._props.get("bos_token", ""),
            eos_token=self._props.get("eos_token", ""),
        )
        self._server_adapters = self.client.get("/lora-adapters")

    @property
    def url(self) -> str:
        return self.client.base_url

    @property
    def template(self) -> ChatTemplate:
        assert self._template is not None
        return self._template

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
        body = {"content": text, "add_special": add_bos, "parse_special": special}
        return [int(t) for t in self.client.post("/tokenize", body)["tokens"]]

    def detokenize(self, tokens: Sequence[int]) -> str:
        return str(self.client.post("/detokenize", {"tokens": [int(t) for t in tokens]})["content"])

    def render_tokens(
        self, messages: Sequence[Message], add_generation_prompt: bool = True, *, continue_final: bool = False,
        **variables: object,
    ) -> list[int]:  # fmt: skip
        """The same rendering as the in-process engine (the template the server reports,
        rendered here), so both engines see the same tokens."""
        text = self.template.render(messages, add_generation_prompt and not continue_final, **variables)
        if continue_final:
            text = continue_final_message(text, messages[-1]["content"])
        bos = self.template.bos_token
        return self.tokenize(text, add_bos=not (bos and text.startswith(bos)))

    # ----------------------------------------------------------------- adapters
    def _register(self, handle: AdapterHandle, name: str | None) -> None:
        listed = self._listed()
        if str(handle.path) in listed:
            self._ids[handle.key] = listed[str(handle.path)]
            return
        if self.managed is None:
            raise AdapterError(
                f"the llama-server at {self.url} was not started with {handle.path}; add it to its --lora list"
            )
        self.managed.start([*self.managed.adapters, handle.path])  # loaded only at start
        self.client = JsonClient(self.managed.url, token=self.client.token, timeout_s=self.client.timeout_s)
        self._read_props()
        listed = self._listed()
        for key, known in list(self._adapters.items()):
            self._ids[key] = listed[str(known.path)]
        self._ids[handle.key] = listed[str(handle.path)]

    def _listed(self) -> dict[str, int]:
        """The server's adapters as resolved path -> id (from its last /lora-adapters)."""
        return {str(Path(a["path"]).resolve()): int(a["id"]) for a in self._server_adapters}

    def _unregister(self, handle: AdapterHandle) -> None:
        self._ids.pop(handle.key, None)  # freed at the next restart; never applied meanwhile

    def _lora(self) -> list[dict[str, float]]:
        """Every adapter the server holds, inactive ones at 0.0 (see the module's note)."""
        scales = {self._ids[key]: scale for key, scale in self._active}
        return [{"id": int(a["id"]), "scale": float(scales.get(int(a["id"]), 0.0))} for a in self._server_adapters]

    # ----------------------------------------------------------------- generation
    def _body(self, prompt: list[int], params: GenerationParams) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": prompt,
            "n_predict": params.max_tokens,
            "temperature": params.temperature,
            "top_k": params.top_k,
            "top_p": params.top_p,
            "min_p": params.min_p,
            "repeat_penalty": params.repeat_penalty,
            "seed": params.seed if params.seed is not None else self.config.seed,
            "samplers": SAMPLERS,
            "return_tokens": True,
            "cache_prompt": self.cache_prompt,
            "lora": self._lora(),
        }
        if params.grammar is not None:
            body["grammar"] = params.grammar
        return body

    def _pieces(self, prompt: list[int], params: GenerationParams) -> Iterator[Piece]:
        body = {**self._body(prompt, params), "stream": True}
        stop_token = None
        for event in self.client.stream("/completion", body):
            tokens = []
            for token in (int(t) for t in event.get("tokens") or []):
                if self._is_eog(token):  # the token the reply ends on is not part of it
                    stop_token = token
                else:
                    tokens.append(token)
            finish = ""
            if event.get("stop"):
                finish = "stop" if event.get("stop_type", "") in ("eos", "word") else "length"
            timings = event.get("timings") or {}
            reused = int(timings["cache_n"]) if "cache_n" in timings else None
            yield Piece(tokens, str(event.get("content") or ""), finish, reused, stop_token)

    def _score(self, prompt: list[int], completion: list[int]) -> list[float]:
        """Teacher-forced log-probabilities, one request per run of tokens that ends at an
        end-of-generation token (the grammar cannot name one; the end of the grammar allows
        only those, so the server emits it and reports its probability)."""
        values: list[float] = []
        done = 0
        while done < len(completion):
            segment = completion[done:]
            eog = [i for i, t in enumerate(segment) if self._is_eog(t)]
            if eog:
                segment = segment[: eog[0] + 1]
            forced = segment[:-1] if eog else segment
            body = {
                "prompt": prompt + completion[:done],
                "n_predict": len(segment),
                "temperature": 0.0,
                "samplers": ["temperature"],
                "grammar": forced_grammar(forced) if forced else 'root ::= ""',
                "n_probs": 1,
                "return_tokens": True,
                "cache_prompt": self.cache_prompt,
                "lora": self._lora(),
            }
            if eog:  # the grammar's end allows every end-of-generation token: pick this one
                body["logit_bias"] = [[segment[-1], 1000.0]]
            out = self.client.post("/completion", body)
            got = [int(t) for t in out.get("tokens") or []]
            if got != segment:
                raise MacaronError(f"llama-server did not follow the forced tokens ({got[:8]} vs {segment[:8]})")
            values += [float(p["logprob"]) for p in out["completion_probabilities"]]
            done += len(segment)
        return values

    def _is_eog(self, token: int) -> bool:
        if self._eog is None:
            self._eog = self._eog_tokens()
        return token in self._eog

    def _eog_tokens(self) -> frozenset[int]:
        """The vocabulary's end-of-generation tokens: read from the base file when it is here
        (vocabulary only, no weights), else the template's end of message."""
        if self.config.model_path.is_file():
            import llama_cpp

            vocab_only = llama_cpp.Llama(str(self.config.model_path), vocab_only=True, verbose=False)
            try:
                vocab = llama_cpp.llama_model_get_vocab(vocab_only.model)
                return frozenset(t for t in range(vocab_only.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t))
            finally:
                vocab_only.close()
        stop = self.stop_token()
        return frozenset() if stop is None else frozenset({stop})

    def best_next(self, tokens: Sequence[int], allowed: Sequence[int]) -> int:
        body = {
            "prompt": list(tokens),
            "n_predict": 1,
            "temperature": 0.0,
            "samplers": ["temperature"],
            "grammar": choice_grammar(allowed),
            "return_tokens": True,
            "cache_prompt": self.cache_prompt,
            "lora": self._lora(),
        }
        with self._lock:
            got = [int(t) for t in self.client.post("/completion", body).get("tokens") or []]
        if not got or got[0] not in set(allowed):
            raise MacaronError("llama-server answered outside the allowed tokens")
        return got[0]

    def _shutdown(self) -> None:
        if self.managed is not None:
            self.managed.close()
