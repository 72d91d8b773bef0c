"""The one API front ends use: open a model, send a message, get a routed, streamed reply.

A session owns the engine (loaded lazily: `macaron doctor` never pays for it), loads the model's
expert adapters once, routes each turn to one expert, activates that expert's adapters, renders
the conversation with the model's chat template (dropping the oldest turns when the context is
full) and streams the reply. Front ends never touch llama.cpp directly.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from macaron_local.catalog import SLOTS, Catalog, Manifest
from macaron_local.engine import AdapterHandle, Completion, Engine, EngineConfig, Generation, GenerationParams
from macaron_local.engine.template import Message
from macaron_local.errors import ModelError
from macaron_local.router import Route, route
from macaron_local.settings import Settings


@dataclass
class Reply:
    """A reply being generated. Iterate it for text; afterwards `completion` is final."""

    route: Route
    adapters: tuple[str, ...]
    dropped_messages: int
    generation: Generation
    _on_done: object = field(default=None, repr=False)

    def __iter__(self) -> Iterator[str]:
        yield from self.generation
        if callable(self._on_done):
            self._on_done(self)

    @property
    def completion(self) -> Completion:
        return self.generation.result

    @property
    def text(self) -> str:
        return self.completion.text

    def wait(self) -> Reply:
        """Consume the whole stream (for callers that do not display it)."""
        for _ in self:
            pass
        return self


class Session:
    """One conversation with one model (its experts loaded once, switched per turn)."""

    def __init__(
        self,
        settings: Settings | None = None,
        model: str | None = None,
        *,
        engine_config: dict | None = None,
    ) -> None:
        self.settings = settings or Settings.load()
        self.catalog = Catalog(self.settings)
        self.manifest: Manifest = self.catalog.get(model) if model else self.catalog.default()
        self._engine_overrides = engine_config or {}
        self._engine: Engine | None = None
        self._experts: dict[str, AdapterHandle] = {}
        self._personal: dict[str, AdapterHandle] = {}
        self.messages: list[Message] = []
        self.last_route: Route | None = None
        self.system_prompt: str = str(self.settings.get("system_prompt"))
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- model
    @property
    def model_path(self) -> Path:
        return self.catalog.base_path(self.manifest)

    @property
    def engine(self) -> Engine:
        """The loaded engine; the first access loads the base model and its expert adapters."""
        if self._engine is None:
            self.load()
        assert self._engine is not None
        return self._engine

    def load(self) -> None:
        path = self.model_path
        if not path.is_file():
            hint = (
                f"run `macaron models pull {self.manifest.name}`"
                if self.manifest.base.kind == "huggingface"
                else "check the manifest"
            )
            raise ModelError(f"model {self.manifest.name!r} is not on this machine ({path}); {hint}")
        options = {
            "n_ctx": int(self.settings.get("n_ctx")),
            "n_threads": int(self.settings.get("n_threads")),
            "kv_switch": str(self.settings.get("kv_switch")),
            **self._engine_overrides,
        }
        config = EngineConfig(model_path=path, **options)
        engine = Engine(config)
        try:
            for slot in SLOTS:
                adapter_path = self.catalog.expert_path(self.manifest, slot)
                if adapter_path is not None:
                    if not adapter_path.is_file():
                        pull = f"macaron models pull {self.manifest.name}"
                        raise ModelError(f"expert {slot} adapter {adapter_path} is missing; run `{pull}`")
                    self._experts[slot] = engine.load_adapter(adapter_path)
        except BaseException:
            engine.close()
            raise
        self._engine = engine

    def set_personal_adapter(self, slot: str, path: Path | None) -> None:
        """Serve the user's own adapter for `slot` stacked on the expert (None removes it)."""
        if path is None:
            self._personal.pop(slot, None)
        else:
            self._personal[slot] = self.engine.load_adapter(path)

    def adapters_for(self, slot: str) -> list[AdapterHandle]:
        """The active set for a turn routed to `slot`: the expert, then the personal adapter."""
        return [h for h in (self._experts.get(slot), self._personal.get(slot)) if h is not None]

    # ----------------------------------------------------------------- turns
    def new_conversation(self) -> None:
        self.messages = []
        self.last_route = None

    def route(self, text: str, expert: str | None = None, sticky_slot: str | None = None) -> Route:
        self.engine  # the expert adapters are known once the model is loaded  # noqa: B018
        classifier = self._classify if "L0" in self._experts else None
        return route(text, explicit=expert, sticky_slot=sticky_slot, classifier=classifier)

    def _classify(self, messages: list[dict[str, str]], prefix: str, labels: Sequence[str]) -> list[float]:
        """Score each label as the continuation of L0's forced answer prefix."""
        engine = self.engine
        engine.set_adapters(self.adapters_for("L0"))
        prompt = engine.render_tokens(messages) + engine.tokenize(prefix)
        return [float(engine.token_logprobs(prompt, engine.tokenize(label)).sum()) for label in labels]

    def send(
        self,
        text: str,
        *,
        expert: str | None = None,
        params: GenerationParams | None = None,
        cancel: threading.Event | None = None,
        role: str = "user",
    ) -> Reply:
        """Route `text`, activate that expert's adapters and start streaming the reply. The
        message and, once the stream ends, the reply are appended to the conversation.

        `role="tool"` sends a tool result: it goes back to the expert that answered last (the
        one that made the call), whatever its text says.
        """
        params = params or GenerationParams(
            max_tokens=int(self.settings.get("max_tokens")),
            temperature=float(self.settings.get("temperature")),
        )
        sticky = self.last_route.slot if role == "tool" and self.last_route else None
        decision = self.route(text, expert, sticky_slot=sticky)
        self.last_route = decision
        engine = self.engine
        active = self.adapters_for(decision.slot)
        engine.set_adapters(active)
        conversation = [*self.messages, {"role": role, "content": text}]
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        tokens, dropped = engine.prompt_for([*system, *conversation], params.max_tokens)
        self.messages = conversation

        def finished(reply: Reply) -> None:
            self.messages.append({"role": "assistant", "content": reply.text})

        return Reply(
            route=decision,
            adapters=tuple(h.path.name for h in active),
            dropped_messages=dropped,
            generation=engine.stream(tokens, params, cancel),
            _on_done=finished,
        )

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
            self._engine = None
            self._experts.clear()
            self._personal.clear()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
