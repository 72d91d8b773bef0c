"""The one API front ends use: conversations, routed and streamed replies, and the user's feedback.

A session owns the engine (loaded lazily: `macaron doctor` never pays for it), loads the model's
expert adapters once, routes each turn to one expert, activates that expert's adapters, renders
the conversation with the model's chat template (dropping the oldest turns when the context is
full) and streams the reply. Every message, turn and piece of feedback is written to the store
as it happens, so a crash loses at most the reply being generated. Conversations are trees:
editing a message or regenerating a reply adds a sibling and moves the current leaf; nothing is
overwritten. Front ends never touch SQLite or llama.cpp directly.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from macaron_local.adapter_names import shown_adapters
from macaron_local.catalog import SLOTS, Catalog, Manifest
from macaron_local.daemon.locks import AppOpenMarker, GeneratingMarker
from macaron_local.daemon.watch import StoreWatcher
from macaron_local.engine import AdapterHandle, Completion, Engine, EngineConfig, Generation, GenerationParams
from macaron_local.engine.select import engine_settings, open_engine
from macaron_local.engine.template import Message
from macaron_local.errors import AdapterError, InvalidInputError, MacaronError, ModelError
from macaron_local.fit import adapter_ram_budget
from macaron_local.learn.episodes import latest_corrections
from macaron_local.learn.personal import PERSONAL_SLOT, SERVED_SLOTS, personal_for
from macaron_local.learning_setup import LearningSetup, Readiness
from macaron_local.protocol.runner import Protocol
from macaron_local.router import Route
from macaron_local.settings import Settings, write_private_atomic
from macaron_local.store import AdapterVersion, LearningRun, Store, open_default_store
from macaron_local.swarm import SwarmResult, choose, gather_variants, run_swarm
from macaron_local.tools.prompting import offer_tools
from macaron_local.tools.spec import ToolSpec
from macaron_local.transcript import TranscriptItem, build_transcript

if TYPE_CHECKING:
    from macaron_local.daemon.status import DaemonStatus


@dataclass
class Reply:
    """A reply being generated. Iterate it for text; afterwards `completion` is final and
    `message_id` names the stored reply (also after a cancel: what was said is kept)."""

    route: Route
    adapters: tuple[str, ...]
    dropped_messages: int
    generation: Generation
    conversation_id: str = ""
    user_message_id: str = ""
    message_id: str | None = None
    notices: tuple[str, ...] = ()  # what changed since the last turn ("L0 Chat updated: ...")
    content: str = ""  # once done: the reply as stored (without its reasoning block)
    thinking: str = ""  # once done: the reasoning block, kept out of the reply
    summary: str | None = None  # once done: the hidden summary of the task it closed
    _on_done: Callable[[Reply], None] | None = field(default=None, repr=False)

    def __iter__(self) -> Iterator[str]:
        try:
            yield from self.generation
        finally:
            if self._on_done is not None:
                done, self._on_done = self._on_done, None
                done(self)

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


@dataclass(frozen=True)
class LearningStatus:
    paused: bool
    pending_feedback: int
    runs: list[LearningRun]


class Session:
    """The user's conversations with one model (its experts loaded once, switched per turn)."""

    def __init__(
        self,
        settings: Settings | None = None,
        model: str | None = None,
        *,
        engine_config: dict | None = None,
        store: Store | None = None,
    ) -> None:
        self.settings = settings or Settings.load()
        self.catalog = Catalog(self.settings)
        self.manifest: Manifest = self.catalog.get(model) if model else self.catalog.default()
        self._engine_overrides = engine_config or {}
        self._engine: Engine | None = None
        self._experts: dict[str, AdapterHandle] = {}
        self._personal: dict[str, AdapterHandle] = {}
        self._labels: dict[str, str] = {}  # adapter key -> what a turn records and the UI shows
        self._served: dict[str, str] = {}  # slot -> id of the personal version loaded for it
        self._announced: set[tuple[str, str | None]] = set()  # (slot, version id) already told
        self._listeners: list[Callable[[], None]] = []
        self._watcher: StoreWatcher | None = None
        self._replaced: list[AdapterHandle] = []  # superseded personal adapters still to free
        self._store = store
        self._learning_setup: LearningSetup | None = None
        self.conversation_id: str | None = None
        self.leaf_id: str | None = None
        self.last_route: Route | None = None
        self.system_prompt: str = str(self.settings.get("system_prompt"))
        self._open_marker = AppOpenMarker.hold(self.settings)  # the nightly memory plan counts an open app
        self._protocol: Protocol | None = None

    @property
    def protocol(self) -> Protocol:
        """The model's route / answer / summary protocol (its profile and options)."""
        if self._protocol is None:
            self._protocol = Protocol(
                self.manifest, routing=str(self.settings.get("routing")), profile_files=self._profile_files()
            )
        return self._protocol

    def _profile_files(self) -> dict[str, Path]:
        """A pulled model's routing-profile files (Tall: Mind Lab's), each checked against its
        pinned sha256 first (a ModelError says how to fetch it again); none for a model whose
        profile ships in the package."""
        paths = self.catalog.profile_paths(self.manifest)
        for role in paths:
            self.catalog.profile_text(self.manifest, role)
        return paths

    # ----------------------------------------------------------------- model
    @property
    def store(self) -> Store:
        if self._store is None:
            self._store = open_default_store(self.settings)
        return self._store

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

    @property
    def loaded(self) -> bool:
        return self._engine is not None

    def load(self) -> None:
        path = self.model_path
        remote = engine_settings(self.settings)
        served_elsewhere = remote.remote and remote.url is not None  # the base lives on the server
        if not path.is_file() and not served_elsewhere:
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
            "max_adapter_bytes": adapter_ram_budget(path),  # experts beyond RAM load on demand
            **self._engine_overrides,
        }
        engine = open_engine(EngineConfig(model_path=path, **options), remote)
        try:
            for slot in SLOTS:
                adapter_path = self.catalog.expert_path(self.manifest, slot)
                if adapter_path is not None:
                    if not adapter_path.is_file() and not served_elsewhere:
                        pull = f"macaron models pull {self.manifest.name}"
                        raise ModelError(f"expert {slot} adapter {adapter_path} is missing; run `{pull}`")
                    self._experts[slot] = engine.load_adapter(adapter_path, name=slot)
                    self._labels[self._experts[slot].key] = adapter_path.name
            for slot in SERVED_SLOTS:  # the user's own deployed versions, stacked on the experts
                version = self.store.deployed_adapter(slot, self.manifest.name)
                if version is not None:
                    try:
                        self._serve(engine, slot, version)
                    except MacaronError:
                        # A damaged or missing file must not stop the app: the expert serves
                        # alone, and the first turn's update check says why (once).
                        continue
        except BaseException:
            engine.close()
            raise
        self._engine = engine
        self._watch_registry()

    def switch_model(self, name: str) -> None:
        """Use another model from the next turn on (the current engine is closed)."""
        manifest = self.catalog.get(name)
        self._close_engine()
        self.manifest = manifest
        self._protocol = None

    def set_personal_adapter(self, slot: str, path: Path | None) -> None:
        """Serve the user's own adapter for `slot` stacked on the expert (None removes it)."""
        if path is None:
            self._personal.pop(slot, None)
        else:
            self._personal[slot] = self.engine.load_adapter(path)

    def _serve(self, engine: Engine, slot: str, version: AdapterVersion | None) -> None:
        """Stack `version` (None: nothing) on `slot`'s expert from the next turn on, and free
        the version it replaces: night after night, old versions must not pile up in memory."""
        previous = self._personal.get(slot)
        if version is None:
            self._personal.pop(slot, None)
            self._served.pop(slot, None)
        else:
            self._personal[slot] = engine.load_adapter(version.path)
            self._labels[self._personal[slot].key] = f"personal {version.id}"
            self._served[slot] = version.id
        if previous is not None:
            self._replaced.append(previous)
        self._free_replaced(engine)

    def _free_replaced(self, engine: Engine) -> None:
        """Unload superseded adapters nothing serves any more; one still active (the last turn
        used it) is freed at the next change."""
        in_use = {h.key for h in (*self._experts.values(), *self._personal.values())}
        waiting = []
        for handle in self._replaced:
            if handle.key in in_use:
                continue  # the same file serves again (a rollback to it)
            try:
                engine.unload_adapter(handle)
            except AdapterError:
                waiting.append(handle)
        self._replaced = waiting

    def adapters_for(self, slot: str) -> list[AdapterHandle]:
        """The active set for a turn routed to `slot`: the expert, then the personal adapter."""
        return [h for h in (self._experts.get(slot), personal_for(slot, self._personal)) if h is not None]

    # ----------------------------------------------------------------- conversations
    @property
    def messages(self) -> list[Message]:
        """The current branch of the open conversation, oldest first, as the model will see it:
        a corrected reply reads as the user's corrected version."""
        if self.leaf_id is None or self.conversation_id is None:
            return []
        corrected = latest_corrections(self.store.get_conversation(self.conversation_id).feedback)
        return [{"role": m.role, "content": corrected.get(m.id, m.content)} for m in self.store.path(self.leaf_id)]

    def new_conversation(self) -> None:
        """Start afresh; the conversation is created in the store with its first message."""
        self.conversation_id = None
        self.leaf_id = None
        self.last_route = None

    def open_conversation(self, conversation_id: str) -> None:
        conversation = self.store.get_conversation(conversation_id)
        self.conversation_id = conversation.id
        self.leaf_id = conversation.current_leaf_id
        self.last_route = None

    def transcript(self) -> list[TranscriptItem]:
        """The current branch as a front end shows it (see `macaron_local.transcript`)."""
        if self.conversation_id is None or self.leaf_id is None:
            return []
        return build_transcript(self.store, self.conversation_id, self.leaf_id)

    def switch_branch(self, message_id: str, step: int) -> bool:
        """Show the previous (-1) or next (+1) sibling of `message_id` and its latest descendants."""
        siblings = self.store.siblings(message_id)
        ids = [m.id for m in siblings]
        if message_id not in ids or self.conversation_id is None:
            return False
        index = ids.index(message_id) + step
        if not 0 <= index < len(ids):
            return False
        self.leaf_id = self.store.set_current_leaf(self.conversation_id, ids[index], descend=True)
        return True

    def select(self, message_id: str) -> None:
        """Make the branch ending at `message_id` current (e.g. an earlier sibling)."""
        if self.conversation_id is None:
            raise InvalidInputError("no conversation is open")
        self.store.set_current_leaf(self.conversation_id, message_id)
        self.leaf_id = message_id

    # ----------------------------------------------------------------- turns
    def route(self, text: str, expert: str | None = None, pending: str | None = None) -> Route:
        """Which expert answers `text` (the route hop on L0 unless chosen or pending)."""
        engine = self.engine  # loads the experts first: the hop runs on L0's adapters
        return self.protocol.route(engine, text, self.adapters_for("L0"), explicit=expert, pending=pending)

    def default_params(self) -> GenerationParams:
        return GenerationParams(
            max_tokens=int(self.settings.get("max_tokens")),
            temperature=float(self.settings.get("temperature")),
            repeat_penalty=float(self.settings.get("repeat_penalty")),
        )

    def send(
        self,
        text: str,
        *,
        expert: str | None = None,
        params: GenerationParams | None = None,
        cancel: threading.Event | None = None,
        role: str = "user",
        tools: Sequence[ToolSpec] = (),
        tool_choice: str = "auto",
    ) -> Reply:
        """Store `text` as the next message, route it, and start streaming the reply.

        `role="tool"` sends a tool result: it goes back to the expert that answered last (the
        one that made the call), whatever its text says, with no route hop. `tools` are offered
        to the model (`tool_choice` as in the OpenAI API); running them is the agent's job
        (`macaron_local.tools.agent`).
        """
        if not text.strip():
            raise InvalidInputError("the message is empty")
        if self.conversation_id is None:
            self.conversation_id = self.store.new_conversation(self.manifest.name, self.system_prompt)
        message_id = self.store.add_message(self.conversation_id, role, text, self.leaf_id)
        self.leaf_id = message_id
        return self._reply_to(message_id, text, expert, params, cancel, tools=tools, tool_choice=tool_choice)

    def add_history(self, messages: Sequence[Message]) -> None:
        """Record earlier messages without answering them: an API client sends the turns it
        already has with each request, and they are context for the reply and for learning."""
        for message in messages:
            if self.conversation_id is None:
                self.conversation_id = self.store.new_conversation(self.manifest.name, self.system_prompt)
            role, content = message["role"], message["content"]
            self.leaf_id = self.store.add_message(self.conversation_id, role, content, self.leaf_id)

    def edit(self, message_id: str, text: str, **kw) -> Reply:
        """Edit an earlier user message: a new sibling branch, answered afresh."""
        original = self.store.get_message(message_id)
        if original.role != "user":
            raise InvalidInputError("only your own messages can be edited; correct a reply instead")
        self.leaf_id = original.parent_id
        return self.send(text, **kw)

    def regenerate(self, message_id: str | None = None, **kw) -> Reply:
        """Answer the same message again: the old reply is kept as a sibling and recorded as a
        regenerate (a weak negative for learning)."""
        target = self.store.get_message(message_id or self._require_leaf())
        if target.role != "assistant" or target.parent_id is None:
            raise InvalidInputError("only a reply can be regenerated")
        self.store.add_feedback(target.id, "regenerate")
        parent = self.store.get_message(target.parent_id)
        self.leaf_id = parent.id
        return self._reply_to(parent.id, parent.content, kw.pop("expert", None), **kw)

    def correct(self, message_id: str, text: str) -> int:
        """Record the user's corrected version of a reply. From then on the reply is shown and
        fed to the model as corrected, while the original stays stored untouched (learning
        needs both). The conversation's later turns stay where they are. Returns the feedback id."""
        target = self.store.get_message(message_id)
        if target.role != "assistant" or target.parent_id is None:
            raise InvalidInputError("only a reply can be corrected")
        if not text.strip():
            raise InvalidInputError("the corrected reply is empty")
        return self.store.add_feedback(target.id, "correction", text=text)

    def record_tool_calls(self, message_id: str, calls: Sequence[dict]) -> None:
        """Store the tool calls the reply `message_id` made and what became of each."""
        self.store.set_turn_tool_calls(message_id, calls)

    def rate(self, message_id: str, value: int, comment: str | None = None) -> int:
        return self.store.add_feedback(message_id, "rating", value=value, text=comment)

    def _require_leaf(self) -> str:
        if self.leaf_id is None:
            raise InvalidInputError("there is no reply yet")
        return self.leaf_id

    def _reply_to(
        self,
        message_id: str,
        text: str,
        expert: str | None = None,
        params: GenerationParams | None = None,
        cancel: threading.Event | None = None,
        *,
        tools: Sequence[ToolSpec] = (),
        tool_choice: str = "auto",
    ) -> Reply:
        """Route (unless a tool result is pending for an expert), answer from that expert's own
        view, and when the reply closes its task run the hidden summary hop."""
        params = params or self.default_params()
        notices = self._apply_registry_updates()
        conversation_id = self.conversation_id
        assert conversation_id is not None
        protocol = self.protocol
        steps = protocol.steps(self.store, conversation_id, message_id)
        decision = self.route(text, expert, pending=protocol.pending_expert(steps))
        self.last_route = decision
        engine = self.engine
        active = self.adapters_for(decision.slot)
        engine.set_adapters(active, view=decision.slot)
        view, variables, params = offer_tools(
            protocol.answer_view(steps, decision.slot, self.system_prompt),
            params,
            tools,
            tool_choice,
            engine.template.source,
            grammar=protocol.options.tool_grammar,
        )
        tokens, dropped = engine.prompt_for(view, params.max_tokens, **variables)
        generation = engine.stream(tokens, params, cancel)
        marker = GeneratingMarker.hold(self.settings)  # the daemon waits while this is held

        def finished(reply: Reply) -> None:
            marker.release()
            done = reply.completion
            split = protocol.split(done.text)
            reply.content, reply.thinking = split.content, split.thinking
            reply.message_id, _ = self.store.add_reply(
                conversation_id,
                message_id,
                split.content,
                {
                    "model": self.manifest.name,
                    "expert": decision.slot,
                    "route_method": decision.method,
                    "route_reason": decision.reason,
                    "route_raw": decision.raw,
                    "route_ms": decision.ms,
                    "adapters": list(reply.adapters),
                    "sampling": {
                        "temperature": params.temperature,
                        "top_p": params.top_p,
                        "top_k": params.top_k,
                        "min_p": params.min_p,
                        "max_tokens": params.max_tokens,
                    },
                    "prompt_tokens": done.prompt_tokens,
                    "completion_tokens": len(done.tokens),
                    "ttft_ms": done.ttft_ms,
                    "total_ms": done.total_ms,
                    "finish_reason": done.finish_reason or "cancelled",
                    "thinking": split.thinking or None,
                },
            )
            if self.conversation_id == conversation_id:
                self.leaf_id = reply.message_id
            if done.finish_reason != "cancelled" and not split.tool_call:
                self._summarize(conversation_id, reply.message_id, active, reply)

        return Reply(
            route=decision,
            adapters=tuple(self._labels.get(h.key, h.path.name) for h in active),
            dropped_messages=dropped,
            generation=generation,
            conversation_id=conversation_id,
            user_message_id=message_id,
            notices=tuple(notices),
            _on_done=finished,
        )

    def _summarize(self, conversation_id: str, reply_id: str, adapters: list[AdapterHandle], reply: Reply) -> None:
        """The summary hop for the task `reply_id` closed (hidden; stored on its turn)."""
        task = self.protocol.closing_task(self.protocol.steps(self.store, conversation_id, reply_id))
        if task is None:
            return
        try:
            hop = self.protocol.summarize(self.engine, task, self.system_prompt, adapters)
        except MacaronError:
            return  # no room in the context (or a failed hop): the reply stands without a summary
        self.store.set_turn_summary(reply_id, hop.text, hop.ms)
        reply.summary = hop.text

    # ----------------------------------------------------------------- history
    def list_conversations(self, limit: int = 50):
        return self.store.list_conversations(limit=limit)

    def search(self, query: str, limit: int = 20):
        return self.store.search(query, limit=limit)

    def rename(self, conversation_id: str, title: str) -> None:
        self.store.rename(conversation_id, title)

    def forget(self, conversation_id: str):
        """Delete a conversation everywhere and mark what learned from it."""
        result = self.store.forget(conversation_id)
        if self.conversation_id == conversation_id:
            self.new_conversation()
        return result

    def export_markdown_file(self, directory: Path) -> Path:
        """Write the open conversation as `<title>.md` in `directory` (atomically, 0600)."""
        conversation = self.store.get_conversation(self._require_conversation())
        stem = re.sub(r"[^A-Za-z0-9._-]+", "-", conversation.title or "conversation").strip("-")[:60]
        path = directory / f"{stem or 'conversation'}.md"
        write_private_atomic(path, self.export_markdown(conversation.id).encode("utf-8"))
        return path

    def available_models(self) -> list[Manifest]:
        """Models whose base file is on this machine (a switch never starts a download)."""
        return [m for m in self.catalog.manifests() if self.catalog.base_path(m).is_file()]

    # ----------------------------------------------------------------- learning
    def learning_status(self) -> LearningStatus:
        runs = self.store.learning_runs()
        used = {i for run in runs for i in run.feedback_ids}
        pending = sum(1 for item in self.store.feedback_rows() if item.feedback.id not in used)
        return LearningStatus(bool(self.settings.get("learning_paused")), pending, runs[::-1][:20])

    def adapter_names(self, recorded: Sequence[str]) -> list[str]:
        """A reply's adapters (`Reply.adapters`, as turns record them) as a reader sees them:
        a learned version by when it was learned, not by its id (`adapter_names`)."""
        return shown_adapters(self.store, recorded)

    def deployed_versions(self) -> dict[str, AdapterVersion]:
        """Each slot's deployed personal adapter version for this model."""
        found = {slot: self.store.deployed_adapter(slot, self.manifest.name) for slot in SERVED_SLOTS}
        return {slot: version for slot, version in found.items() if version is not None}

    def rollback(self, slot: str) -> AdapterVersion | None:
        """Serve the previous version of `slot`'s personal adapter from the next turn on."""
        restored = self.store.rollback_adapter(slot, self.manifest.name)
        if self._engine is not None:
            self._serve(self._engine, slot, restored)
            self._announced.add((slot, restored.id if restored else None))
        return restored

    def set_learning_paused(self, paused: bool) -> None:
        self.settings.save(learning_paused=paused)

    @property
    def learning_setup(self) -> LearningSetup:
        """Setting learning up (schedule, trainer, the user's answer); settable for tests."""
        if self._learning_setup is None:
            self._learning_setup = LearningSetup(self.settings)
        return self._learning_setup

    @learning_setup.setter
    def learning_setup(self, value: LearningSetup) -> None:
        self._learning_setup = value

    def learning_readiness(self) -> Readiness:
        """Whether and when the feedback waiting now will be learned from, or why not and the one
        action that fixes it; `.notice("Correction saved.")` is what to say after feedback."""
        return self.learning_setup.readiness(self.store)

    def export_markdown(self, conversation_id: str | None = None) -> str:
        """The current branch of a conversation as Markdown, for sharing or keeping."""
        conversation = self.store.get_conversation(conversation_id or self._require_conversation())
        lines = [f"# {conversation.title or 'Conversation'}", ""]
        for message in self.store.path(conversation.current_leaf_id) if conversation.current_leaf_id else []:
            lines += [f"## {message.role.capitalize()}", "", message.content, ""]
        return "\n".join(lines)

    def _require_conversation(self) -> str:
        if self.conversation_id is None:
            raise InvalidInputError("no conversation is open")
        return self.conversation_id

    # ----------------------------------------------------------------- deployed adapters
    # The nightly daemon deploys from another process. A watchdog on the store tells listeners
    # (the app) at once; each turn re-reads the four deployment pointers (cheap), so a version
    # deployed a moment before a turn is never missed, whatever the watchdog's latency.
    def on_adapters_changed(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` (from a background thread) when the store may have a new deployment;
        then `pending_updates()` says what changed. Returns a function that unsubscribes."""
        self._listeners.append(callback)
        return lambda: self._listeners.remove(callback) if callback in self._listeners else None

    def _watch_registry(self) -> None:
        if self._watcher is None:
            watcher = StoreWatcher(self.store.db_path, self._registry_touched)
            if watcher.start():
                self._watcher = watcher

    def _registry_touched(self) -> None:
        for callback in list(self._listeners):
            callback()

    def _registry_changes(self) -> list[tuple[str, AdapterVersion | None]]:
        """(slot, deployed version) for each slot whose deployment differs from what is served."""
        deployed = self.deployed_versions()
        return [
            (slot, deployed.get(slot))
            for slot in SERVED_SLOTS
            if (deployed[slot].id if slot in deployed else None) != self._served.get(slot)
        ]

    def _describe_change(self, slot: str, version: AdapterVersion | None) -> str:
        expert = self.manifest.experts.get(slot)
        name = f"{slot} {expert.name if expert else SLOTS.get(slot, '')}".strip()
        if slot == PERSONAL_SLOT:
            name = "Your personal adapter (every expert)"
        previous = self._served.get(slot)
        if version is None:
            return f"{name}: learned version {previous} rolled back; the expert answers as shipped"
        if previous is not None and self._created_at(previous) > version.created_at:
            return f"{name} rolled back to learned version {version.id}"
        ids = set(version.feedback_ids)
        kinds: dict[str, int] = {}
        for item in self.store.feedback_rows(since_id=min(ids, default=1) - 1):
            if item.feedback.id in ids:
                kinds[item.feedback.kind] = kinds.get(item.feedback.kind, 0) + 1
        words = {"correction": "correction", "rating": "rating", "regenerate": "regenerated reply"}
        parts = [f"{n} {words.get(k, k)}{'' if n == 1 else 's'}" for k, n in sorted(kinds.items())]
        if not parts:
            return f"{name} updated to learned version {version.id}"
        learned = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
        return f"{name} updated: learned from {learned}"

    def _created_at(self, version_id: str) -> str:
        try:
            return self.store.adapter_version(version_id).created_at
        except MacaronError:
            return ""

    def pending_updates(self) -> list[str]:
        """What has been deployed (or rolled back) elsewhere and not yet told; it is served
        from the next turn. Each change is told once."""
        notices = []
        for slot, version in self._registry_changes():
            key = (slot, version.id if version else None)
            if key not in self._announced:
                self._announced.add(key)
                notices.append(self._describe_change(slot, version))
        return notices

    def _apply_registry_updates(self) -> list[str]:
        """Serve every slot's deployed version; returns the changes not told before. A version
        that cannot be loaded is told once and the previous one stays in service."""
        engine = self.engine
        notices = []
        for slot, version in self._registry_changes():
            key = (slot, version.id if version else None)
            told = key in self._announced
            try:
                notice = self._describe_change(slot, version)
                self._serve(engine, slot, version)
            except MacaronError as exc:
                if not told:
                    still = "the old one still serves" if slot in self._served else "the expert serves alone"
                    notices.append(f"{slot}: the new version could not be loaded ({exc}); {still}")
                self._announced.add(key)
                continue
            if not told:
                notices.append(notice)
            self._announced.discard(key)
        return notices

    def daemon_status(self) -> DaemonStatus:
        """The nightly learning daemon: installed or not, its window, its recent runs."""
        from macaron_local.daemon.status import daemon_status

        return daemon_status(self.settings, self.store, ask_os=False)

    # ----------------------------------------------------------------- lifecycle
    def _close_engine(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
            self._watcher = None
        if self._engine is not None:
            self._engine.close()
            self._engine = None
            self._experts.clear()
            self._personal.clear()
            self._replaced.clear()
            self._served.clear()

    def close(self) -> None:
        self._close_engine()
        self._open_marker.release()
        if self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- swarm
    def vote(self, text: str, k: int, *, params: GenerationParams | None = None) -> SwarmResult:
        """Ask `text` of the first `k` adapter variants (swarm.gather_variants), each greedily,
        and store the reply of the earliest variant that gave the majority's answer.

        The turn is recorded like a routed one, so the vote is in the history and learning sees
        which expert wrote the stored text: `route_method` "vote", the split line as
        `route_reason`, and every variant's answer under `sampling["vote"]`.
        """
        if not text.strip():
            raise InvalidInputError("the message is empty")
        variants = choose(gather_variants(self.store, self.catalog, self.manifest, enough=k), k)
        engine = self.engine
        if self.conversation_id is None:
            self.conversation_id = self.store.new_conversation(self.manifest.name, self.system_prompt)
        conversation_id = self.conversation_id
        message_id = self.store.add_message(conversation_id, "user", text, self.leaf_id)
        self.leaf_id, self.last_route = message_id, None
        params = params or self.default_params()
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        outcome = run_swarm(engine, variants, [*system, *self.messages], params)
        win = outcome.winning
        votes = [{"label": a.variant.label, "answer": a.answer, "text": a.text} for a in outcome.answers]
        sampling = {
            "temperature": 0.0,
            "max_tokens": params.max_tokens,
            "vote": {"k": outcome.result.k, "votes": outcome.result.split, "variants": votes},
        }
        self.leaf_id, _ = self.store.add_reply(
            conversation_id,
            message_id,
            win.text,
            {
                "model": self.manifest.name,
                "expert": win.variant.slot,
                "route_method": "vote",
                "route_reason": outcome.result.summary(),
                "adapters": [win.variant.label] if win.variant.paths else [],
                "sampling": sampling,
                "prompt_tokens": win.completion.prompt_tokens,
                "completion_tokens": len(win.completion.tokens),
                "ttft_ms": win.completion.ttft_ms,
                "total_ms": outcome.wall_ms,
                "finish_reason": win.completion.finish_reason,
            },
        )
        return replace(outcome, message_id=self.leaf_id)
