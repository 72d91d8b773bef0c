"""The local inference engine: llama.cpp (through llama-cpp-python) with hot-swappable LoRA adapters.

The base model is loaded once (memory-mapped). Each adapter is validated by our own code and then
loaded once; a turn chooses its active set with `llama_set_adapters_lora`, which costs nothing when
the set is unchanged. llama.cpp does not touch the KV cache when adapters change, and
llama-cpp-python's `generate` reuses the longest common token prefix, so a switch without KV
handling would serve keys/values computed under another adapter set. On every switch the engine
either resets the cache or restores a state saved under the new set (`kv_switch`).
"""

from __future__ import annotations

import codecs
import ctypes
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import llama_cpp
import numpy as np

from macaron_local.adapters.validate import AdapterReport, BaseModelInfo, validate_adapter
from macaron_local.engine.llama_load import open_llama
from macaron_local.engine.template import CHATML, ChatTemplate, Message, continue_final_message, fit_messages
from macaron_local.errors import AdapterError, MacaronError, ModelError
from macaron_local.hashing import sha256_file

KV_SWITCH_POLICIES = ("reset", "state")


def default_threads() -> int:
    """All cores: on small machines llama.cpp's default (half the cores) leaves speed unused."""
    return max(1, min(os.cpu_count() or 1, 16))


@dataclass
class EngineConfig:
    model_path: Path
    n_ctx: int = 4096
    n_threads: int = 0  # 0: default_threads()
    n_batch: int = 512
    kv_f32: bool = False  # F32 KV cache: exact logits for parity tests, twice the memory
    kv_switch: str = "state"  # "state" (restore KV saved under the new set) or "reset"
    max_saved_states: int = 8  # saved KV states (one per adapter set and view), oldest dropped first
    max_saved_state_bytes: int = 512 * 2**20  # and never more than this many bytes of them
    seed: int = 0
    #: Adapter bytes llama.cpp may hold at once (it copies each adapter into its own buffers);
    #: beyond it the least recently used inactive adapter is freed and reloaded when next used.
    #: 0: no limit. Tall's experts are 5.4 GB each at Q8_0: a 40 GB machine keeps two.
    max_adapter_bytes: int = 0


@dataclass
class GenerationParams:
    max_tokens: int = 512
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    seed: int | None = None
    grammar: str | None = None  # llama.cpp GBNF the reply must follow (a small model's tool call)


@dataclass(frozen=True)
class AdapterHandle:
    """A validated adapter loaded into llama.cpp. `key` identifies its file content."""

    key: str
    path: Path
    report: AdapterReport
    pointer: object = field(compare=False, repr=False, hash=False)


@dataclass
class Completion:
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0
    finish_reason: str = ""  # "stop", "length" or "cancelled"
    stop_token: int | None = None  # the end-of-generation token that ended a "stop" reply
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    adapters: tuple[str, ...] = ()


#: A saved KV state's key: the adapter set (key, scale pairs) and the view it was computed for.
StateKey = tuple[tuple[tuple[str, float], ...], str]


@dataclass(frozen=True)
class KVSnapshot:
    """The KV cells of one conversation under one adapter set, and the tokens they hold.

    For a model whose state cannot be cut back (recurrent or hybrid: qwen35moe), `checkpoint`
    is the state as it was at the end of the last prompt, before the reply was generated: the
    next turn's view holds the reply as re-tokenized text (and without its thinking block),
    which can differ from the generated tokens, and only this checkpoint is then a prefix.
    """

    tokens: np.ndarray
    data: bytes
    checkpoint: KVSnapshot | None = None

    @property
    def nbytes(self) -> int:
        return len(self.data) + (self.checkpoint.nbytes if self.checkpoint else 0)


class Generation:
    """An in-progress reply: iterate for text chunks; `result` is complete once iteration ends."""

    def __init__(self, chunks: Iterator[str], result: Completion) -> None:
        self._chunks = chunks
        self.result = result

    def __iter__(self) -> Iterator[str]:
        return self._chunks

    def close(self) -> None:
        """Stop early (the engine lock is released and the reply keeps what was generated)."""
        self._chunks.close()  # type: ignore[attr-defined]


def file_key(path: Path) -> str:
    """A short content hash: the same adapter file is loaded once however it is named."""
    return sha256_file(path)[:16]


class AdapterSet:
    """What every engine reports of its adapters: which are resident, which are active (with
    their scales) and for which conversation view. The in-process and the remote engines keep
    the same three fields; how they load and apply adapters is their own."""

    _adapters: dict[str, AdapterHandle]
    _active: tuple[tuple[str, float], ...]
    _view: str

    @property
    def loaded(self) -> tuple[Path, ...]:
        """Every adapter file resident now (active or not). An engine that frees adapters to
        stay within a memory budget does not list those; they reload when used."""
        return tuple(handle.path for handle in self._adapters.values())

    @property
    def active(self) -> tuple[tuple[str, float], ...]:
        """The active set as (adapter key, scale) pairs."""
        return self._active

    def active_handles(self) -> list[tuple[AdapterHandle, float]]:
        """The active set as handles and scales (to restore it after a temporary switch)."""
        return [(self._adapters[key], scale) for key, scale in self._active]

    @property
    def view(self) -> str:
        """The conversation view the live KV cells hold (see `set_adapters`)."""
        return self._view


class Streams:
    """Replies as streams, the same on every engine: `stream` hands back the text as it is
    produced and a Completion that fills in as it ends; `generate` runs one to its end. Each
    engine produces the text in its own `_stream` (llama.cpp here, an HTTP server remotely)."""

    _active: tuple[tuple[str, float], ...]

    def _stream(
        self, prompt: list[int], params: GenerationParams, cancel: threading.Event | None, result: Completion
    ) -> Iterator[str]:
        raise NotImplementedError

    def stream(
        self,
        prompt_tokens: Sequence[int],
        params: GenerationParams | None = None,
        cancel: threading.Event | None = None,
    ) -> Generation:
        """Start a reply to `prompt_tokens`; iterate the result for text as it is produced."""
        params = params or GenerationParams()
        result = Completion(prompt_tokens=len(prompt_tokens), adapters=tuple(k for k, _ in self._active))
        return Generation(self._stream(list(prompt_tokens), params, cancel, result), result)

    def generate(self, prompt_tokens: Sequence[int], params: GenerationParams | None = None) -> Completion:
        generation = self.stream(prompt_tokens, params)
        for _ in generation:
            pass
        return generation.result


class Engine(AdapterSet, Streams):
    """One base model, any number of validated adapters, one context. Not re-entrant: one
    generation at a time (a lock enforces it)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.kv_switch not in KV_SWITCH_POLICIES:
            raise MacaronError(f"kv_switch must be one of {', '.join(KV_SWITCH_POLICIES)}")
        self.config = config
        self.base_info = BaseModelInfo.from_gguf(config.model_path)
        if self.base_info.kind == "adapter":
            raise ModelError(f"{config.model_path} is an adapter, not a base model")
        threads = config.n_threads or default_threads()
        kv_type = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if config.kv_f32 else {}
        try:
            self.llm = open_llama(
                config.model_path,
                n_ctx=config.n_ctx,
                n_batch=config.n_batch,
                n_threads=threads,
                n_threads_batch=threads,
                seed=config.seed,
                flash_attn=False,
                logits_all=False,
                verbose=False,
                **kv_type,
            )
        except (ValueError, RuntimeError) as exc:
            raise ModelError(f"llama.cpp could not load {config.model_path}: {exc}") from None
        self._lock = threading.RLock()
        self._closing = threading.Event()  # set by close(): a reply being written stops at its next token
        self._vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self._n_vocab = self.llm.n_vocab()
        self._adapters: OrderedDict[str, AdapterHandle] = OrderedDict()  # resident, least recently used first
        self._evicted: dict[str, AdapterHandle] = {}  # loaded once, freed for room, reloaded on demand
        self._sizes: dict[str, int] = {}  # file bytes per adapter key, taken when first loaded
        self.reload_count = 0
        self._active: tuple[tuple[str, float], ...] = ()
        self._view = ""  # which conversation view the live KV cells belong to
        self._remember = True  # whether the live KV is worth saving when switching away
        self._states: OrderedDict[StateKey, KVSnapshot] = OrderedDict()
        #: Recurrent/hybrid memory is cut back only to its end: views keep prompt checkpoints.
        model = self.llm.model
        self._whole_state_only = bool(
            llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model)
        )
        self._checkpoint: KVSnapshot | None = None  # the live view's, see KVSnapshot
        self.template = self._load_template()
        self.switch_count = 0

    # ----------------------------------------------------------------- tokens and prompts
    def _load_template(self) -> ChatTemplate:
        source = self.llm.metadata.get("tokenizer.chat_template") or CHATML
        return ChatTemplate(
            source,
            bos_token=self.token_text(self.llm.token_bos()),
            eos_token=self.token_text(self.llm.token_eos()),
        )

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        return self.llm.detokenize([token], special=True).decode("utf-8", errors="replace")

    def tokenize(self, text: str, *, add_bos: bool = False, special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.llm.detokenize(list(tokens)).decode("utf-8", errors="replace")

    def is_end_of_generation(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self._vocab, token))

    def render_tokens(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        *,
        continue_final: bool = False,
        **variables: object,
    ) -> list[int]:
        """Tokens of the templated conversation. BOS is added only if the model wants one and
        the template did not already write it. `continue_final` ends the prompt inside the last
        message (an assistant prefill the model continues); `variables` go to the template."""
        text = self.template.render(messages, add_generation_prompt and not continue_final, **variables)
        if continue_final:
            text = continue_final_message(text, messages[-1]["content"])
        wants_bos = self.llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"
        add_bos = wants_bos and not (self.template.bos_token and text.startswith(self.template.bos_token))
        return self.tokenize(text, add_bos=add_bos)

    def prompt_for(
        self, messages: Sequence[Message], max_new_tokens: int, **variables: object
    ) -> tuple[list[int], int]:
        """Tokens for answering `messages` with room for `max_new_tokens`; drops the oldest
        turns (never system prompts) when the context is too small. Returns (tokens, dropped)."""
        budget = self.config.n_ctx - max_new_tokens
        kept, dropped = fit_messages(messages, lambda m: len(self.render_tokens(m, **variables)), budget)
        return self.render_tokens(kept, **variables), dropped

    # ----------------------------------------------------------------- adapters
    def load_adapter(self, path: str | os.PathLike[str], *, name: str | None = None) -> AdapterHandle:
        """Validate and load an adapter once; loading the same content again returns the handle.
        `name` (an expert's slot) matters only to engines that serve adapters by name."""
        path = Path(path).resolve()
        with self._lock:
            report = validate_adapter(path, self.base_info)
            key = file_key(path)
            if key in self._adapters:
                self._adapters.move_to_end(key)
                return self._adapters[key]
            if key in self._evicted:
                return self._evicted[key]  # stays out until a turn uses it
            self._sizes[key] = path.stat().st_size
            self._make_room(self._sizes[key], keep={k for k, _ in self._active})
            handle = AdapterHandle(key=key, path=path, report=report, pointer=self._init_adapter(path))
            self._adapters[key] = handle
            return handle

    def _init_adapter(self, path: Path) -> object:
        pointer = llama_cpp.llama_adapter_lora_init(self.llm.model, str(path).encode("utf-8"))
        if not pointer:  # the binding's NULL is a falsy pointer, not None
            raise AdapterError(f"{path}: llama.cpp refused the adapter")
        return pointer

    def _make_room(self, size: int, keep: set[str]) -> None:
        """Free least recently used adapters (never one in `keep`, which must not be active on
        the context) until `size` more bytes fit in max_adapter_bytes."""
        limit = self.config.max_adapter_bytes
        if limit <= 0:
            return
        while sum(self._sizes.get(k, 0) for k in self._adapters) + size > limit:
            victim = next((k for k in self._adapters if k not in keep), None)
            if victim is None:
                return  # the set in use alone exceeds the budget: it is loaded anyway
            handle = self._adapters.pop(victim)
            llama_cpp.llama_adapter_lora_free(handle.pointer)
            self._evicted[victim] = handle

    def _reload(self, key: str, keep: set[str]) -> None:
        """Load an evicted adapter again (validated again: the file may have changed)."""
        handle = self._evicted[key]
        report = validate_adapter(handle.path, self.base_info)
        if file_key(handle.path) != key:
            raise AdapterError(f"{handle.path} changed on disk since it was first loaded")
        self._make_room(self._sizes.get(key, 0), keep)
        self._adapters[key] = replace(handle, report=report, pointer=self._init_adapter(handle.path))
        del self._evicted[key]
        self.reload_count += 1

    def unload_adapter(self, handle: AdapterHandle) -> None:
        """Free an adapter that is no longer needed (a learning run's stale rollout adapters)."""
        with self._lock:
            if any(key == handle.key for key, _ in self._active):
                raise AdapterError(f"adapter {handle.path} is active; switch away from it first")
            resident = self._adapters.pop(handle.key, None)
            if resident is not None or self._evicted.pop(handle.key, None) is not None:
                self._states = OrderedDict((k, v) for k, v in self._states.items() if handle.key not in dict(k[0]))
            if resident is not None:
                llama_cpp.llama_adapter_lora_free(resident.pointer)

    def set_adapters(
        self,
        adapters: Sequence[AdapterHandle | tuple[AdapterHandle, float]],
        *,
        view: str = "",
        remember: bool = True,
    ) -> bool:
        """Make exactly `adapters` active for `view`. Returns True when the adapter set or the
        view changed (and the KV cache was reset or restored), False when both already were.

        A view names one token sequence that grows turn after turn (an expert's own view of
        the conversation). With `kv_switch = "state"` the KV of the view being left is saved
        under (adapter set, view) and the one saved for the new pair is restored, so going
        back to an expert only prefills what was appended since. `remember=False` marks a
        one-off prompt (the route hop) whose KV is not worth keeping when switching away.
        """
        pairs = [(a, 1.0) if isinstance(a, AdapterHandle) else a for a in adapters]
        new_key = tuple((handle.key, float(scale)) for handle, scale in pairs)
        with self._lock:
            if new_key == self._active and view == self._view:
                self._remember = remember
                return False
            for handle, _ in pairs:
                if handle.key not in self._adapters and handle.key not in self._evicted:
                    raise AdapterError(f"adapter {handle.path} was not loaded by this engine")
            if self.config.kv_switch == "state" and self.llm.n_tokens > 0 and self._remember:
                self._remember_state((self._active, self._view))
            if new_key != self._active:
                wanted = {key for key, _ in new_key}
                if any(key not in self._adapters for key in wanted):  # on demand: detach, make room, load
                    llama_cpp.llama_set_adapters_lora(self.llm.ctx, None, 0, None)
                    self._active = ()
                    for key in [k for k, _ in new_key if k not in self._adapters]:
                        self._reload(key, keep=wanted)
                for key in wanted:
                    self._adapters.move_to_end(key)
                n = len(pairs)
                pointers = [self._adapters[h.key].pointer for h, _ in pairs]
                array = (llama_cpp.llama_adapter_lora_p_ctypes * max(n, 1))(*pointers)
                scales = (ctypes.c_float * max(n, 1))(*(s for _, s in pairs))
                if llama_cpp.llama_set_adapters_lora(self.llm.ctx, array if n else None, n, scales if n else None) != 0:
                    raise AdapterError("llama.cpp could not activate the adapter set")
                self._active = new_key
                self.switch_count += 1
            self._view, self._remember = view, remember
            saved = self._states.pop((new_key, view), None) if self.config.kv_switch == "state" else None
            if saved is not None:
                self._restore_state(saved)
            else:
                self._clear_kv()
            return True

    @property
    def saved_states(self) -> list[tuple[StateKey, int, int]]:
        """(key, tokens, bytes) of every saved KV state, oldest first: what the cache holds."""
        return [(key, len(s.tokens), s.nbytes) for key, s in self._states.items()]

    def _remember_state(self, key: StateKey) -> None:
        """Keep the KV cells of the current conversation, computed under the set `key`.

        Only the sequence's KV cells are copied (llama_state_seq_*), not llama-cpp-python's
        whole `save_state`, which also copies a logits buffer of n_batch x n_vocab floats.
        """
        self._states[key] = replace(self._snapshot(), checkpoint=self._checkpoint)
        self._states.move_to_end(key)

        def held() -> int:
            return sum(s.nbytes for s in self._states.values())

        while len(self._states) > self.config.max_saved_states or (
            len(self._states) > 1 and held() > self.config.max_saved_state_bytes
        ):
            self._states.popitem(last=False)

    def _snapshot(self) -> KVSnapshot:
        """The live sequence's state and the tokens it holds."""
        ctx = self.llm.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(ctx, buffer, size, 0)
        tokens = np.array(self.llm.input_ids[: self.llm.n_tokens], copy=True)
        return KVSnapshot(tokens=tokens, data=bytes(buffer)[:written])

    def _restore_state(self, snapshot: KVSnapshot) -> None:
        self._clear_kv()
        data = (ctypes.c_uint8 * len(snapshot.data)).from_buffer_copy(snapshot.data)
        if llama_cpp.llama_state_seq_set_data(self.llm.ctx, data, len(snapshot.data), 0) == 0:
            self._clear_kv()  # could not restore: recompute from scratch instead
            return
        n = len(snapshot.tokens)
        self.llm.input_ids[:n] = snapshot.tokens
        self.llm.n_tokens = n
        self.llm._requires_eval = True  # logits are not restored: generate() replays a token
        self._checkpoint = snapshot.checkpoint

    def _clear_kv(self) -> None:
        self.llm.reset()
        self.llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        self._checkpoint = None

    def _back_to_checkpoint(self, prompt: Sequence[int]) -> None:
        """Where the live state diverges from `prompt` inside its tokens and cannot be cut
        back (recurrent/hybrid memory), go back to the last prompt checkpoint when that is a
        prefix of `prompt`: only the rest is prefilled, not the whole view."""
        checkpoint = self._checkpoint
        if not self._whole_state_only or checkpoint is None:
            return
        n = len(checkpoint.tokens)
        if self._common_prefix(prompt) >= self.llm.n_tokens or not 0 < n < len(prompt):
            return  # the live state already is a prefix, or the checkpoint would not help
        if list(checkpoint.tokens) != list(prompt[:n]):
            return
        self._restore_state(checkpoint)
        self._checkpoint = checkpoint  # still the last prompt's end, and still a prefix

    # ----------------------------------------------------------------- generation
    def _stream(
        self,
        prompt: list[int],
        params: GenerationParams,
        cancel: threading.Event | None,
        result: Completion,
    ) -> Iterator[str]:
        if len(prompt) + 1 > self.config.n_ctx:
            raise MacaronError(f"the prompt ({len(prompt)} tokens) does not fit the context ({self.config.n_ctx})")
        max_tokens = min(params.max_tokens, self.config.n_ctx - len(prompt))
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        with self._lock:
            if params.seed is not None:
                self.llm.set_seed(params.seed)
            self._back_to_checkpoint(prompt)
            result.reused_prompt_tokens = self._reusable_prefix(prompt)
            started = time.perf_counter()
            result.finish_reason = "length"
            try:
                for token in self.llm.generate(
                    prompt,
                    temp=params.temperature,
                    top_k=params.top_k,
                    top_p=params.top_p,
                    min_p=params.min_p,
                    repeat_penalty=params.repeat_penalty,
                    grammar=self._grammar(params.grammar),
                ):
                    if not result.tokens:
                        result.ttft_ms = (time.perf_counter() - started) * 1000
                        if self._whole_state_only and self._remember:  # the state holds exactly the prompt
                            self._checkpoint = self._snapshot()  # (a one-off view's is never reused)
                    if (cancel is not None and cancel.is_set()) or self._closing.is_set():
                        result.finish_reason = "cancelled"
                        break
                    if self.is_end_of_generation(token):
                        result.finish_reason = "stop"
                        result.stop_token = token
                        break
                    result.tokens.append(token)
                    piece = decoder.decode(self.llm.detokenize([token]))
                    result.text += piece
                    if piece:
                        yield piece
                    if len(result.tokens) >= max_tokens:
                        break
                tail = decoder.decode(b"", final=True)
                result.text += tail
                if tail:
                    yield tail
            finally:
                result.total_ms = (time.perf_counter() - started) * 1000

    @staticmethod
    def _grammar(source: str | None):
        """llama-cpp-python's grammar object for GBNF `source` (parsed by llama.cpp's sampler).
        Only grammars this program builds reach it (tools.prompting.call_grammar)."""
        return None if source is None else llama_cpp.LlamaGrammar.from_string(source, verbose=False)

    def _reusable_prefix(self, prompt: Sequence[int]) -> int:
        """How many of `prompt`'s tokens the KV cache really keeps for this generation.

        llama-cpp-python keeps the common prefix (less one token when the whole prompt is
        cached, replayed to refresh the logits) only where llama.cpp can cut the cache back to
        it. A recurrent or hybrid model (qwen35moe's Gated DeltaNet layers) cannot cut its
        state back, so a view that diverges inside the cached tokens is prefilled whole. The cut
        is made here first (llama-cpp-python's own is then a no-op), so the count is what
        llama.cpp did, not what the token ids suggest.
        """
        common = self._common_prefix(prompt)
        if common == len(prompt) == self.llm.n_tokens and not self.llm._requires_eval:
            return common  # the exact prompt is live: sampling starts at once
        keep = common - 1 if common == len(prompt) else common
        if keep > 0 and not self.llm._ctx.kv_cache_seq_rm(-1, keep, -1):
            return 0
        return max(keep, 0)

    def _common_prefix(self, tokens: Sequence[int]) -> int:
        cached = self.llm.input_ids[: self.llm.n_tokens]
        n = 0
        for a, b in zip(cached, tokens, strict=False):
            if a != b:
                break
            n += 1
        return n

    # ----------------------------------------------------------------- scoring
    def logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits (n_tokens, n_vocab) for every position, under the active adapter set."""
        with self._lock:
            return self._decode_for_logits(list(tokens), 0)

    def next_logits(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits (n_vocab,) for the token after `tokens`; the KV prefix shared with the previous
        evaluation is reused, so stepping one token at a time costs one token each."""
        if not tokens:
            raise MacaronError("next_logits needs at least one token")
        with self._lock:
            return self._decode_for_logits(list(tokens), len(tokens) - 1)[-1]

    def best_next(self, tokens: Sequence[int], allowed: Sequence[int]) -> int:
        """The most likely token after `tokens` among `allowed` (what a remote engine does with
        a choice grammar; here, read from the logits)."""
        logits = self.next_logits(tokens)
        return max(allowed, key=lambda t: float(logits[t]))

    def token_logprobs(self, prompt_tokens: Sequence[int], completion_tokens: Sequence[int]) -> np.ndarray:
        """log p(completion[i] | prompt + completion[:i]) for each completion token (float64).

        Learning needs these to compare the sampler's and the trainer's probabilities. The KV
        prefix shared with the previous call is reused, so scoring many completions of one
        prompt costs one prompt evaluation.
        """
        prompt, completion = list(prompt_tokens), list(completion_tokens)
        if not prompt:
            raise MacaronError("scoring needs at least one prompt token")
        if not completion:
            return np.zeros(0)
        with self._lock:
            rows = self._decode_for_logits(prompt + completion, len(prompt) - 1)[: len(completion)]
        rows = rows.astype(np.float64)
        peak = rows.max(axis=1, keepdims=True)
        log_norm = np.log(np.exp(rows - peak).sum(axis=1)) + peak[:, 0]
        return rows[np.arange(len(completion)), completion] - log_norm

    def _decode_for_logits(self, tokens: list[int], first_output: int) -> np.ndarray:
        """Evaluate `tokens` and return the logits of positions >= `first_output`."""
        if len(tokens) > self.config.n_ctx:
            raise MacaronError(f"{len(tokens)} tokens do not fit the context ({self.config.n_ctx})")
        llm = self.llm
        start = min(self._common_prefix(tokens), first_output)
        if not llm._ctx.kv_cache_seq_rm(-1, start, -1):  # recurrent state (qwen35moe) cannot be cut back
            llm._ctx.kv_cache_seq_rm(-1, 0, -1)
            start = 0
        llm.n_tokens = start
        out = np.empty((len(tokens) - first_output, self._n_vocab), dtype=np.float32)
        batch = llm._batch.batch
        n_batch = llm.n_batch
        written = 0
        for chunk_start in range(start, len(tokens), n_batch):
            chunk = tokens[chunk_start : chunk_start + n_batch]
            n_out = 0
            for i, token in enumerate(chunk):
                pos = chunk_start + i
                batch.token[i] = token
                batch.pos[i] = pos
                batch.seq_id[i][0] = 0
                batch.n_seq_id[i] = 1
                batch.logits[i] = pos >= first_output
                n_out += pos >= first_output
            batch.n_tokens = len(chunk)
            if llama_cpp.llama_decode(llm.ctx, batch) != 0:
                self._clear_kv()
                raise MacaronError("llama.cpp failed to evaluate the tokens")
            llm.input_ids[chunk_start : chunk_start + len(chunk)] = chunk
            llm.n_tokens = chunk_start + len(chunk)
            if n_out:
                flat = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_out * self._n_vocab,))
                out[written : written + n_out] = flat.reshape(n_out, self._n_vocab)
                written += n_out
        llm._requires_eval = True  # generate() must refresh its logits before sampling
        return out

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Free the model. A reply still being written on another thread holds the engine until
        its next token; it stops there (finish reason `cancelled`) instead of running to the end."""
        self._closing.set()
        with self._lock:
            if getattr(self, "llm", None) is None:
                return
            llama_cpp.llama_set_adapters_lora(self.llm.ctx, None, 0, None)
            for handle in self._adapters.values():
                llama_cpp.llama_adapter_lora_free(handle.pointer)
            self._adapters.clear()
            self._states.clear()
            self.llm.close()
            self.llm = None  # type: ignore[assignment]

    @property
    def closed(self) -> bool:
        """True once `close` freed the model (the nightly sequential plan checks it)."""
        return getattr(self, "llm", None) is None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
