"""One night of learning: plan -> train -> export -> parity -> gate -> back off -> register -> deploy.

The user has one personal adapter (`learn.personal`), shared by every expert: it is trained on
all of the user's feedback, each episode with the expert that answered it underneath, and it
starts from the deployed version (`learn.warm`). `learn.plan` decides what the night learns
(new feedback + a bounded replay of older episodes) and what the gate judges on (this night's
held-out conversations, and a bounded window of earlier nights'); `learn.gate` judges a
candidate the way the user is served.

The candidate judged first is the mean of the run's late checkpoints and its final
(`learn.averaging`): a run of two episodes a step wanders, and the average keeps what its
checkpoints share. When the gate rejects it the run backs off instead of giving up, cheapest
first, within `config.backoff_s` seconds: the final, the run's own earlier checkpoints,
tonight's update at half strength (halfway from where the night started), then one retrain at
half the learning rate with four times the KL anchor. Once one passes, the scan stops after
`config.backoff_patience` more that do not beat it. The best candidate that passes every
check (highest reward on all held-out feedback, tonight's and earlier nights', less the
probability earlier lessons' taught tokens lost) is deployed.
Every candidate tried is registered (rejected ones as `rejected`) with its evaluations, and
listed in the run's record with its reasons.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from macaron_local.adapters.validate import BaseModelInfo
from macaron_local.catalog import SLOTS, Catalog, Manifest
from macaron_local.engine import AdapterHandle, Engine, EngineConfig, GenerationParams
from macaron_local.engine.select import engine_settings, open_engine
from macaron_local.learn import fluency, gate, validation
from macaron_local.learn.anchor_hold import AnchorHold, anchor_hold
from macaron_local.learn.anchors import answer_anchors, pick_anchors
from macaron_local.learn.averaging import tail_average
from macaron_local.learn.backends.gguf_weights import frozen_deltas
from macaron_local.learn.compose import compose, night_styles
from macaron_local.learn.episodes import Episode, episodes_from_store
from macaron_local.learn.export import (
    ParityReport,
    export_gguf,
    parity_check,
    parity_from_effects,
    trainer_effects,
    trainer_logprobs,
)
from macaron_local.learn.guards import RowGuard
from macaron_local.learn.imitation import ImitationGuard, imitation_guard
from macaron_local.learn.lesson_guard import LessonGuard, lesson_guard, lesson_questions
from macaron_local.learn.loop import (
    LearnConfig,
    StepLog,
    TrainResult,
    adapts,
    completion_tokens,
    lesson_reward,
    sample_night,
    set_lora_weights,
    train,
    train_on_rollouts,
)
from macaron_local.learn.memory_plan import nightly_mode
from macaron_local.learn.passages import PassageGuard, passage_tokens
from macaron_local.learn.personal import PERSONAL_SLOT
from macaron_local.learn.plan import NightPlan, learned_feedback, plan_night, planned_steps, tonights_lesson
from macaron_local.learn.retention import Lessons
from macaron_local.learn.stacking import expert_trainer_source, stacked_source
from macaron_local.learn.warm import warm_start
from macaron_local.learn.workdir import run_workdir
from macaron_local.store import AdapterVersion, Store

MAX_NLL_INCREASE = gate.MAX_NLL_INCREASE
#: The adapter's effect may differ by this much (nats, any token) between llama.cpp's quantized
#: base and the trainer's dequantized copy, plus PARITY_REL_TOLERANCE of the token's own effect.
#: Measured on the embedded model: the residual grows with the effect (the largest, 0.7 to 0.95
#: nats, sat on tokens the adapter moved 5 to 8 nats, 10 to 18% of it; relative L2 error 4 to
#: 8%), so a fixed 1-nat limit alone rejected strong candidates with no other sign of a bad
#: export (1.02 and 1.39 nats at most, means 0.12 and 0.13 like the passing ones'). Float32
#: bases agree to about 1e-6. A broken export (stale or missing pairs, a wrong scale) differs by
#: the whole effect or a large share of it.
PARITY_TOLERANCE = 1.0
PARITY_REL_TOLERANCE = 0.25
GATE_REPLY = gate.GATE_REPLY
HALF = 0.5


@dataclass
class SlotReport:
    slot: str
    decision: str  # deployed | rejected | skipped
    reason: str
    version_id: str | None = None
    run_id: str | None = None
    metrics: dict = field(default_factory=dict)


@dataclass
class Candidate:
    """One adapter the gate may deploy: LoRA weights and how they were obtained."""

    name: str
    step: int
    lr: float
    kl_beta: float
    weights: dict[str, np.ndarray]
    scale: float = 1.0
    passed: bool = False
    reasons: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    file: Path | None = None
    version_id: str | None = None
    origin: dict[str, np.ndarray] | None = None  # where the night started (None: from zero)
    averaged_steps: list[int] = field(default_factory=list)  # the steps an average is the mean of

    def served_weights(self) -> dict[str, np.ndarray]:
        """The LoRA this candidate serves: the trained weights, or at `scale` < 1 the point that
        far along the night's path from its `origin`, so a half-strength back-off halves only what
        tonight changed, never what earlier nights taught (scaling the whole warm-started adapter
        halved night 1's greeting). An origin whose B factors are all zero serves no update: its
        A is taken as the end's, and the candidate is then exactly `scale` x the update."""
        if self.scale == 1.0:
            return self.weights
        origin = self.origin if adapts(self.origin) else {}
        served = {}
        for name, end in self.weights.items():
            start = origin.get(name)
            if start is None:
                start = np.zeros_like(end) if name.endswith("lora_B") else end
            served[name] = (start + np.float32(self.scale) * (end - start)).astype(end.dtype)
        return served

    def summary(self) -> dict:
        return {
            "name": self.name,
            "step": self.step,
            "lr": self.lr,
            "kl_beta": self.kl_beta,
            "scale": self.scale,
            "passed": self.passed,
            "reasons": self.reasons,
            **({"averaged_steps": self.averaged_steps} if self.averaged_steps else {}),
            **self.figures,
        }


@dataclass
class Night:
    """What every phase of one night shares (where it records, what it serves, how it is
    driven), so the phases take the night whole instead of a dozen arguments each."""

    store: Store
    catalog: Catalog
    manifest: Manifest
    config: LearnConfig
    system_prompt: str
    serve: GenerationParams
    base: BaseModelInfo
    deployed: AdapterVersion | None  # the personal version being served when the night began
    started: float
    backend_factory: Callable[[float], object]  # learning rate -> a trainer backend (local nights)
    on_step: Callable[[StepLog], None] | None = None
    should_stop: Callable[[], bool] = lambda: False
    on_notice: Callable[[str], None] | None = None  # a line for the user (training stopped early)


@dataclass
class Trained:
    """What training left for the gate: the run, its final weights and how it started."""

    result: TrainResult
    final_weights: dict[str, np.ndarray]
    train_wall: float
    start_note: str


def split_by_conversation(episodes: list[Episode], share: float = 0.25, seed: int = 0) -> tuple[list, list]:
    """Hold out whole conversations (never a reply whose siblings were trained on)."""
    conversations = sorted({e.conversation_id for e in episodes})
    random.Random(seed).shuffle(conversations)
    n_held = max(1, round(len(conversations) * share)) if len(conversations) >= 4 else 0
    held = set(conversations[:n_held])
    return [e for e in episodes if e.conversation_id not in held], [e for e in episodes if e.conversation_id in held]


def serve_params(catalog: Catalog) -> GenerationParams:
    """The chat's sampling settings (greedy by default), for judging answers as served."""
    settings = catalog.settings
    return GenerationParams(
        temperature=float(settings.get("temperature")), repeat_penalty=float(settings.get("repeat_penalty"))
    )


class Experts:
    """The shipped experts, in the engine and (one at a time) folded into the trainer's base."""

    def __init__(self, engine: Engine | None, catalog: Catalog, manifest: Manifest, base: BaseModelInfo) -> None:
        """`engine` None: the trainer's side alone (the sequential plan's closed engine)."""
        self.engine = engine
        self.paths = {slot: catalog.expert_path(manifest, slot) for slot in SLOTS}
        loaded = self.paths.items() if engine is not None else ()
        self.handles = {slot: engine.load_adapter(p, name=slot) for slot, p in loaded if p is not None}
        self.base = base
        self.sources = {str(p): expert_trainer_source(catalog, manifest, s) for s, p in self.paths.items() if p}
        self._deltas: dict[str, dict[str, np.ndarray]] = {}
        self._folded = ""  # the expert file folded into the backend now ("" = none)
        self.backend = None

    def group(self, episode: Episode) -> str:
        """Episodes with the same expert underneath train together ("" = the bare base)."""
        return str(self.paths.get(episode.slot) or "")

    def stack(self, personal: AdapterHandle | None) -> gate.Stack:
        return lambda slot: [h for h in (self.handles.get(slot), personal) if h is not None]

    def underneath(self, group: str) -> list[AdapterHandle]:
        """Fold `group`'s expert into the backend (unfolding the previous one); the engine's set."""
        if group != self._folded and getattr(self.backend, "stacks_experts", False):  # Tall: stacked
            self.backend.stack_expert(stacked_source(self.sources, group))
            self._folded = group
        if group != self._folded and self.backend is not None:
            names = self.backend.linear_weight_names()
            if self._folded:
                self.backend.fold_in({k: -v for k, v in self._delta(self._folded, names).items()})
            if group:
                self.backend.fold_in(self._delta(group, names))
            self._folded = group
        return [h for slot, h in self.handles.items() if str(self.paths[slot]) == group][:1]

    def _delta(self, path: str, names: list[str]) -> dict[str, np.ndarray]:
        if path not in self._deltas:
            self._deltas[path] = frozen_deltas(Path(path), self.base, names)
        return self._deltas[path]


def learn_personal(
    store: Store,
    catalog: Catalog,
    manifest: Manifest,
    episodes: list[Episode],
    config: LearnConfig,
    on_step: Callable[[StepLog], None] | None = None,
    backend_factory: Callable[[float], object] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    system_prompt: str | None = None,
    mode: str | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> SlotReport:
    """Plan, train, gate (backing off if need be) and deploy the user's personal adapter.

    `mode` is how the base is held: `together` (engine and trainer side by side) or
    `sequential` (one at a time); None takes it from this machine's memory plan."""
    started = time.perf_counter()
    slot = PERSONAL_SLOT
    runs = store.learning_runs()
    skipped = plan_night(episodes, runs, config).skipped
    if skipped:  # leaving noise out cannot give a skipped night work, so no model is loaded for it
        return SlotReport(slot, "skipped", skipped)
    if system_prompt is None:
        system_prompt = str(catalog.settings.get("system_prompt") or "")
    if backend_factory is None:
        from macaron_local.learn.backends import make_backend

        def backend_factory(lr: float):
            return make_backend(config.backend, lr)

    night = Night(
        store, catalog, manifest, config, system_prompt, serve_params(catalog),
        BaseModelInfo.from_gguf(catalog.base_path(manifest)), store.deployed_adapter(slot, manifest.name),
        started, backend_factory, on_step, should_stop, on_notice,
    )  # fmt: skip
    if config.trainer != "local":
        from macaron_local.learn.remote_run import learn_personal_remote

        with _night_engine(catalog, manifest) as engine:
            planned = _plan(Experts(engine, catalog, manifest, night.base), episodes, runs, config, system_prompt)
        if isinstance(planned, SlotReport):
            return planned
        return learn_personal_remote(night, planned, on_notice=on_notice)
    mode = mode or nightly_mode(catalog.settings)
    if mode not in ("together", "sequential"):
        raise ValueError(f"unknown memory mode {mode!r} (together or sequential)")
    # One load of the base for the whole night: the noise check, the anchors' answers, the
    # guards, the rollouts and (together) the gate. The sequential plan closes it after its
    # rollouts and reopens it for the gate.
    with run_workdir(store.db_path.parent / "learn-work") as workdir, _night_engine(catalog, manifest) as engine:
        experts = Experts(engine, catalog, manifest, night.base)
        planned = _plan(experts, episodes, runs, config, system_prompt)
        if isinstance(planned, SlotReport):
            return planned
        plan = planned
        plan.anchors = answer_anchors(engine, plan.anchors, experts.stack(None))
        guards = _guards(engine, night, experts, plan)
        learn = _learn_sequential if mode == "sequential" else _learn_together
        return learn(night, plan, engine, experts, guards, workdir)


def _learn_together(
    night: Night, plan: NightPlan, engine: Engine, experts: Experts, guards: list[RowGuard], workdir: Path
) -> SlotReport:
    """The night with engine and trainer side by side: rollouts, steps, parity and the gate all
    on the one engine `learn_personal` opened, with the gentler retrain offered as the last
    back-off."""
    config, base = night.config, night.base
    backend, start_note = _load_trainer(night, experts)
    samples, corrections = _held_out_tokens(engine, plan)
    stop = validation.EarlyStop(config.early_stop_patience, config.overfit_margin)
    reader = validation.HeldoutReader(backend, corrections, lambda: experts.underneath(""), stop)
    result = train(
        backend,
        engine,
        base,
        plan.train,
        config,
        workdir,
        reward=lesson_reward(plan.lesson, config.lesson_reward),
        on_step=night.on_step,
        should_stop=night.should_stop,
        steps=plan.steps,
        underneath=experts.underneath,
        group_of=experts.group,
        checkpoint_every=config.refresh_every,
        guards=guards,
        at_checkpoint=reader.at_checkpoint,
    )
    if _cut_short(result, plan):
        return _interrupted(night.store, plan, result)
    train_wall = time.perf_counter() - night.started
    experts.underneath("")  # parity compares the adapter alone, on the bare base, both sides

    def prepare(candidate: Candidate) -> tuple[Path, ParityReport]:
        set_lora_weights(backend, candidate.served_weights())
        file = export_gguf(
            backend, base, workdir / f"candidate-{candidate.name}.gguf", "personal", keep_peft=config.export_peft
        )
        return file, parity_check(engine, file, backend, samples, PARITY_TOLERANCE, PARITY_REL_TOLERANCE)

    def retrain() -> Candidate:
        return _retrain(backend, engine, night, plan, workdir, experts, result.start, guards)

    def validate(candidate: Candidate) -> float | None:
        def load() -> None:
            set_lora_weights(backend, candidate.served_weights())

        return reader.reading(candidate.name, candidate.step, candidate.scale, load)

    trained = Trained(result, backend.lora_weights(), train_wall, start_note)
    extra = _guard_figures(guards) | _report_early_stop(night, result, reader, plan)
    return _gate_and_record(night, engine, experts, plan, trained, prepare, retrain, extra, validate)


def _held_out_tokens(engine: Engine, plan: NightPlan) -> tuple[list, list]:
    """Tonight's held-out episodes as (prompt, completion) tokens, at most 4 of each: those with
    a chosen reply (parity's samples: any text will do) and the corrections among them (the
    reading's: a liked reply the model sampled itself reads lower as training sharpens the
    policy, by 0.8 nats a token over a 108-step ratings night that served 1.0)."""
    samples = [completion_tokens(engine, e.messages, e.chosen) for e in plan.held_new if e.chosen][:4]
    corrections = [completion_tokens(engine, e.messages, e.chosen) for e in plan.held_new if e.corrected][:4]
    return samples, corrections


def _cut_short(result: TrainResult, plan: NightPlan) -> bool:
    """Whether training ended before its planned steps for a reason other than stopping early
    (the user or the daemon stopped it): the night is then recorded as interrupted."""
    return len(result.steps) < plan.steps and not result.stopped_early


def _report_early_stop(night: Night, result: TrainResult, reader: validation.HeldoutReader, plan: NightPlan) -> dict:
    """Tell the user when training stopped short of its planned steps (a progress bar left at
    60 of 72 would look stuck while the gate judges), and return the run record's account of
    it: the planned steps, and why it stopped early."""
    figures: dict = {"planned_steps": plan.steps}
    if result.stopped_early:
        figures["early_stop"] = reader.stop.note(len(result.steps), plan.steps)
        if night.on_notice is not None:
            night.on_notice(figures["early_stop"])
    return figures


def _night_engine(catalog: Catalog, manifest: Manifest):
    """The engine a night runs on: the base, with the user's thread setting as the chat uses it."""
    threads = int(catalog.settings.get("n_threads") or 0)
    config = EngineConfig(model_path=catalog.base_path(manifest), n_ctx=2048, kv_switch="reset", n_threads=threads)
    return open_engine(config, engine_settings(catalog.settings))


def _plan(
    experts: Experts, episodes: list[Episode], runs: list, config: LearnConfig, system_prompt: str
) -> NightPlan | SlotReport:
    """The night's plan, once corrections that read as noise are left out (`_drop_noise`), with
    its anchors picked (not yet answered) and its steps counted; a SlotReport when it is skipped."""
    episodes, noisy = _drop_noise(experts, episodes, learned_feedback(runs))
    if not episodes:
        reason = f"all {noisy} correction(s) read as noise, not language: nothing to learn"
        return SlotReport(PERSONAL_SLOT, "skipped", reason)
    plan = plan_night(episodes, runs, config)
    if plan.skipped:
        return SlotReport(PERSONAL_SLOT, "skipped", plan.skipped)
    plan.noisy = noisy
    plan.lesson = tonights_lesson(plan)
    if config.compose_styles:
        _compose_styles(plan)
    plan.anchors = pick_anchors(len(plan.new_train), config.anchor_ratio, plan.night, system_prompt)
    plan.steps = planned_steps(plan, config)
    return plan


def _compose_styles(plan: NightPlan) -> None:
    """Every style tonight's new corrections keep adding (learn/compose.py), applied to the
    trained corrections (tonight's and the replayed ones) that lack it; held-out ones stay as
    the user wrote them."""
    styles = night_styles([*plan.new_train, *plan.held_new])
    plan.new_train, changed_new = compose(plan.new_train, styles)
    plan.replay, changed_old = compose(plan.replay, styles)
    plan.styles, plan.composed = styles, changed_new + changed_old


def _drop_noise(experts: Experts, episodes: list[Episode], learned: set[int]) -> tuple[list[Episode], int]:
    """The episodes without those whose correction reads as noise to the bare experts
    (`fluency.noisy_corrections`, on `experts`' engine), and how many were dropped. Only
    feedback no deployed run has learned is judged (what was learned passed this before), so the
    cost follows the new feedback, not the history: one teacher-forced pass per judged correction."""
    unlearned = [e for e in episodes if not set(e.feedback_ids) <= learned]
    if not unlearned:
        return episodes, 0
    noisy = {id(e) for e in fluency.noisy_corrections(experts.engine, experts.stack(None), unlearned)}
    return [e for e in episodes if id(e) not in noisy], len(noisy)


def _load_trainer(night: Night, experts: Experts):
    """The trainer with a fresh personal LoRA, warm-started from the deployed version if any."""
    config, deployed = night.config, night.deployed
    backend = night.backend_factory(config.lr)
    backend.load(night.catalog.base_path(night.manifest), checkpoint=night.catalog.trainer_checkpoint(night.manifest))
    backend.add_lora(rank=config.rank, alpha=config.alpha, seed=config.seed)
    experts.backend = backend
    start_note = "started from zero"
    if deployed is not None and config.warm_start:
        start_note = warm_start(backend, Path(deployed.path), night.base, config.rank, config.alpha)
    return backend, start_note


def _interrupted(store: Store, plan: NightPlan, result: TrainResult) -> SlotReport:
    slot = PERSONAL_SLOT
    reason = f"interrupted after {len(result.steps)} of {plan.steps} steps; its feedback waits for the next run"
    run_id = store.record_learning_run(
        slot=slot,
        status="interrupted",
        feedback_ids=[],  # not consumed: the next run still counts it as new
        decision="skipped",
        reason=reason,
        metrics={"steps": len(result.steps), "pending_feedback_ids": plan.feedback_ids},
    )
    return SlotReport(slot, "skipped", reason, None, run_id, {"steps": len(result.steps)})


def _candidates(result: TrainResult, final_weights: dict[str, np.ndarray], config: LearnConfig) -> list[Candidate]:
    """Every candidate the night may judge, the first judged first: the mean of the run's late
    checkpoints and its final (`learn.averaging`, where `average_share` finds any), then the
    final, then the back-off ones (`_fallbacks`). The average stands for the whole run (its
    step is the final's), so where the two pass within noise of each other it is deployed."""
    final = Candidate("final", len(result.steps), config.lr, config.kl_beta, final_weights)
    fallbacks = _fallbacks(result, final, config)
    averaged = tail_average(result.checkpoints, final.step, final_weights, config.average_share)
    if averaged is None:
        return [final, *fallbacks]
    weights, steps = averaged
    average = Candidate("average", final.step, config.lr, config.kl_beta, weights, averaged_steps=steps)
    return [average, final, *fallbacks]


def _fallbacks(result: TrainResult, final: Candidate, config: LearnConfig) -> list[Candidate]:
    """The cheap back-off candidates, in the order they are judged: the run's checkpoints
    (newest first), then tonight's update at half strength (halfway from where it started)."""
    fallbacks = [
        Candidate(f"step-{c.step}", c.step, config.lr, config.kl_beta, c.weights) for c in reversed(result.checkpoints)
    ]
    fallbacks.append(
        Candidate("final-half", final.step, config.lr, config.kl_beta, final.weights, HALF, origin=result.start)
    )
    return fallbacks


def judge_in_turn(
    candidates: Sequence[Candidate],
    judge: Callable[[Candidate], Candidate],
    affordable: Callable[[], bool],
    patience: int,
    passed: Candidate | None = None,
) -> list[Candidate]:
    """Judge `candidates` in order while another judgement fits the budget (`affordable`), and,
    once one has passed (or from the start, given one that `passed` already), until `patience`
    in a row (0: no limit) have not beaten the best that passed (on `gate.choice_score`).
    Returns those judged, in order."""
    judged: list[Candidate] = []
    best = passed
    since_best = 0
    for candidate in candidates:
        if not affordable() or (best is not None and patience and since_best >= patience):
            break
        judged.append(judge(candidate))
        leader = best_passing([*([passed] if passed else []), *judged])  # ties: the earlier stays
        if leader is not best:
            best, since_best = leader, 0
        elif best is not None:
            since_best += 1
    return judged


def back_off(
    first: Candidate,
    fallbacks: Sequence[Candidate],
    gains: dict[str, float | None],
    judge: Callable[[Candidate], Candidate],
    affordable: Callable[[], bool],
    config: LearnConfig,
) -> tuple[list[Candidate], str]:
    """After the first candidate (the average, or the final) is judged: the back-off candidates
    judged (best reader of tonight's held-out corrections first, `gains`) and why a first that
    passed was looked past ("": it was not). A rejected first is always backed off from; a
    passing one only when it overfit (`validation.overfit`), and then it is the best so far that
    the others must beat."""
    overfit_note = validation.overfit(gains, first.name, config.overfit_margin) if first.passed else ""
    if first.passed and not overfit_note:
        return [], ""
    passed = first if first.passed else None
    ordered = validation.ranked(fallbacks, gains, margin=config.overfit_margin)
    return judge_in_turn(ordered, judge, affordable, config.backoff_patience, passed), overfit_note


def best_passing(candidates: Sequence[Candidate]) -> Candidate | None:
    """The passing candidate with the highest `gate.choice_score` (the first of equals); None
    when none passed. What the back-off's patience measures from, and the leader `to_deploy`
    measures the others against."""
    return max((c for c in candidates if c.passed), key=lambda c: c.figures["choice_score"], default=None)


def to_deploy(candidates: Sequence[Candidate]) -> tuple[Candidate | None, str]:
    """The passing candidate the night deploys, and a note when it is not the leader on
    `gate.choice_score` (""): the most trained one (steps x strength) that the leader does not
    beat beyond noise, by the gate's own test (`gate.significantly_better`: by at least
    `MIN_HELDOUT_GAIN` and more than a standard error, episode by episode).
    Every passing candidate kept the regression set; among those the held-out reward cannot tell
    apart, its highest is noise, and a lesson can form late. An allergy night's step 24 led on
    0.169 against the final's 0.123 over 3 held-out episodes and served 0.375 on the scenario's check;
    steps 36 to 54 served 0.75. A leader clearly ahead still wins: stop 35's tldr final passed
    on -0.133 and served 0.375, and its step 30 (0.004) served 1.0."""
    leader = best_passing(candidates)
    if leader is None:
        return None, ""
    lead = leader.figures["choice_rewards"]  # every judged candidate has them (gate.verdict)
    for candidate in sorted((c for c in candidates if c.passed), key=lambda c: c.step * c.scale, reverse=True):
        if candidate is leader:
            return leader, ""
        if not gate.significantly_better(lead, candidate.figures["choice_rewards"]):
            return candidate, (
                f"{candidate.name}: the most trained of the passing candidates that {leader.name} (the best choice "
                f"score, {leader.figures['choice_score']:.3f} against {candidate.figures['choice_score']:.3f}) "
                "does not beat beyond noise"
            )
    return leader, ""


def _gate_and_record(
    night: Night,
    engine: Engine,
    experts: Experts,
    plan: NightPlan,
    trained: Trained,
    prepare: Callable[[Candidate], tuple[Path, ParityReport]],
    retrain: Callable[[], Candidate] | None,
    extra_metrics: dict,
    validate: Callable[[Candidate], float | None] | None = None,
) -> SlotReport:
    """Judge the first candidate (`_candidates`: the average of the run's late checkpoints, or
    the final), then the back-off ones, the way the user is served, register
    every one tried and deploy the best that passes. `prepare` gives a candidate's exported
    file and its parity report; `retrain` (None: not offered) the gentler retrain; `validate`
    (None: not offered) a candidate's gain on tonight's held-out corrections in the trainer
    (`learn.validation`): a final that passed is looked past when a back-off candidate reads
    them clearly better."""
    slot = PERSONAL_SLOT
    store, manifest, config, deployed = night.store, night.manifest, night.config, night.deployed
    system_prompt, serve, started = night.system_prompt, night.serve, night.started
    result, train_wall = trained.result, trained.train_wall
    current_handle = engine.load_adapter(deployed.path) if deployed else None
    judging = started_judging = time.perf_counter()
    bare = experts.stack(None)
    lesson = plan.lesson
    bare_scores = gate.score(engine, bare, [], plan.held_old, system_prompt, serve)
    reference = bare_scores.regression
    current = gate.score(
        engine, experts.stack(current_handle), plan.held_new, plan.held_old, system_prompt, serve, False, bare, lesson
    )
    lessons = (
        Lessons(engine, experts.stack(None), experts.stack(current_handle), plan.held_old)
        if current_handle is not None and plan.held_old
        else None
    )

    def judge(candidate: Candidate) -> Candidate:
        candidate.file, parity = prepare(candidate)
        handle = engine.load_adapter(candidate.file)
        scores = gate.score(
            engine, experts.stack(handle), plan.held_new, plan.held_old, system_prompt, serve, bare=bare, lesson=lesson
        )
        kept = lessons.kept_by(experts.stack(handle)) if lessons is not None else None
        reasons, figures = gate.verdict(scores, current, reference, kept, bare_scores.held_old)
        if not parity.ok:
            reasons.insert(0, parity.summary())
        figures["parity_max_abs_diff"] = round(parity.max_abs_diff, 5)
        figures["parity_mean_abs_diff"] = round(parity.mean_abs_diff, 5)
        figures["parity_max_excess"] = round(parity.max_excess, 5)
        candidate.reasons, candidate.figures, candidate.passed = reasons, figures, not reasons
        engine.set_adapters([])
        engine.unload_adapter(handle)
        return candidate

    first, *fallbacks = _candidates(result, trained.final_weights, config)
    tried = [judge(first)]
    judge_s = time.perf_counter() - judging
    budget_end = time.perf_counter() + config.backoff_s
    validating = time.perf_counter()
    gains = {c.name: validate(c) for c in [first, *fallbacks]} if validate is not None else {}
    validate_s = time.perf_counter() - validating
    backed_off, overfit_note = back_off(
        first, fallbacks, gains, judge, lambda: time.perf_counter() + judge_s <= budget_end, config
    )
    tried += backed_off
    if (
        retrain is not None
        and not any(c.passed for c in tried)
        and time.perf_counter() + train_wall + judge_s <= budget_end
    ):
        tried.append(judge(retrain()))
    # The best for the user is the best on everything held out: tonight's feedback and what
    # earlier nights taught (choosing on tonight's alone preferred a candidate that forgot more),
    # less what the taught tokens lost (gate.choice_score).
    best, choice_note = to_deploy(tried)
    chosen = best or first
    decision = "deployed" if best else "rejected"
    if best:
        f = best.figures
        reason = (
            f"{best.name}: held-out feedback {f['heldout_reward_before']:.3f} -> {f['heldout_reward_after']:.3f}, "
            f"passage NLL {f['regression_nll_delta']:+.1%} vs the bare experts, "
            f"factual answers {f['regression_qa_reference']} -> {f['regression_qa_after']}"
        )
    else:
        reason = "; ".join(first.reasons)
        if len(tried) > 1:
            reason += f" (and {len(tried) - 1} fallback candidate(s) failed too)"
    metrics = {
        "train_episodes": len(plan.new_train) + len(plan.replay),
        "anchor_episodes": len(plan.anchors),
        "new_episodes": len(plan.new_train),
        "replay_episodes": len(plan.replay),
        "heldout_episodes": len(plan.held_new),
        "heldout_conversations": plan.new_heldout_conversations,
        "night": plan.night,
        "noise_corrections_left_out": plan.noisy,
        "lesson_words": sorted(lesson),
        "composed_styles": [s.name for s in plan.styles],
        "composed_corrections": plan.composed,
        "start": trained.start_note,
        "steps": len(result.steps),
        # a skipped step's loss was not finite: null, not the NaN strict JSON has no word for
        "losses": [round(s.loss, 4) if math.isfinite(s.loss) else None for s in result.steps],
        "skipped_steps": result.skipped_steps,
        "final_kl": round(result.steps[-1].kl, 4) if result.steps and math.isfinite(result.steps[-1].kl) else None,
        "trainer_tokens_per_s": round(result.trainer_tokens_per_s, 1),
        "train_s": round(train_wall, 1),
        "rollout_s": round(result.rollout_seconds, 1),  # the engine's sampling, within train_s
        "trainer_s": round(result.trainer_seconds, 1),  # the trainer's steps, within train_s
        "judge_s": round(time.perf_counter() - started_judging, 1),
        "validate_s": round(validate_s, 1),  # the trainer's reading of the held-out corrections
        "heldout_logprob_gain": {name: round(g, 4) for name, g in gains.items() if g is not None},
        **({"overfit": overfit_note} if overfit_note else {}),
        "chosen": chosen.name,
        **({"choice": choice_note} if choice_note else {}),
        **chosen.figures,
        "candidates": [c.summary() for c in tried],
        **extra_metrics,
    }
    metrics["wall_s"] = round(time.perf_counter() - started, 1)
    feedback_ids = plan.feedback_ids
    run_id = store.record_learning_run(
        slot=slot, status="done", feedback_ids=feedback_ids, decision=decision, reason=reason, metrics=metrics
    )
    for candidate in tried:
        assert candidate.file is not None
        companion = candidate.file.with_suffix(".peft")
        version = store.register_adapter(
            candidate.file,
            peft_dir=companion if candidate is chosen and companion.is_dir() else None,
            slot=slot,
            base_model=manifest.name,
            rank=config.rank,
            parent_id=deployed.id if deployed else None,
            learning_run_id=run_id,
            feedback_ids=feedback_ids,
            evaluations={"candidate": candidate.summary(), "run": {k: metrics[k] for k in ("night", "steps")}},
            status="candidate" if candidate is best else "rejected",
        )
        candidate.version_id = version.id
    assert chosen.version_id is not None
    if best:
        store.deploy_adapter(chosen.version_id)
    store.set_learning_run_adapter(run_id, chosen.version_id)
    return SlotReport(slot, decision, reason, chosen.version_id, run_id, metrics)


def _learn_sequential(
    night: Night, plan: NightPlan, engine: Engine, experts: Experts, guards: list[RowGuard], workdir: Path
) -> SlotReport:
    """The night with one copy of the base resident at a time (the memory plan's `sequential`):

    1. engine only (`engine`, opened by the caller, which planned on it): every step's rollouts
       (with llama.cpp's log-probabilities) and the parity samples' tokens, then the engine is
       closed;
    2. trainer only: it steps on those rollouts (the importance ratio against the recorded
       sampler log-probabilities corrects for their staleness: see `loop.train_on_rollouts`),
       exports every candidate the gate may judge and keeps its side of parity as numbers, then
       it is freed;
    3. engine only again: parity against those numbers, the gate, register, deploy.
    The gentler retrain (the last back-off) would need the trainer a second time after the gate
    and is not offered in this plan. `phases` in the run's metrics records what was resident
    when, read from the engine and trainer objects themselves."""
    import gc
    import weakref

    store, catalog, manifest, config, base = night.store, night.catalog, night.manifest, night.config, night.base
    phases: list[str] = []
    with engine:
        rollouts, rollout_s = sample_night(
            engine,
            plan.train,
            config,
            steps=plan.steps,
            reward=lesson_reward(plan.lesson, config.lesson_reward),
            should_stop=night.should_stop,
            underneath=experts.underneath,
            group_of=experts.group,
        )
        samples, corrections = _held_out_tokens(engine, plan)
        phases.append(f"rollouts: {len(rollouts)} steps through llama.cpp, no trainer loaded")
    rollout_engine = weakref.ref(engine)
    del engine, experts
    gc.collect()

    def engine_gone() -> bool:
        held = rollout_engine()
        return held is None or held.closed

    phases.append(f"engine closed: {engine_gone()}")
    if len(rollouts) < plan.steps:  # stopped while sampling: no trainer is loaded for nothing
        return _interrupted(store, plan, TrainResult())
    trainer_experts = Experts(None, catalog, manifest, base)
    backend, start_note = _load_trainer(night, trainer_experts)
    bare = functools.partial(trainer_experts.underneath, "")
    stop = validation.EarlyStop(config.early_stop_patience, config.overfit_margin)
    reader = validation.HeldoutReader(backend, corrections, bare, stop)
    open_while_training: list[bool] = []

    def stepped(log: StepLog) -> None:
        open_while_training.append(not engine_gone())
        if night.on_step is not None:
            night.on_step(log)

    result = train_on_rollouts(
        backend,
        rollouts,
        config,
        on_step=stepped,
        should_stop=night.should_stop,
        underneath=trainer_experts.underneath,
        checkpoint_every=config.refresh_every,
        guards=guards,
        at_checkpoint=reader.at_checkpoint,
    )
    result.rollout_seconds = rollout_s
    phases.append(f"trained {len(result.steps)} steps, engine open while training: {any(open_while_training)}")
    if _cut_short(result, plan):
        return _interrupted(store, plan, result)
    stop_figures = _report_early_stop(night, result, reader, plan)
    trained = Trained(result, backend.lora_weights(), time.perf_counter() - night.started, start_note)
    trainer_experts.underneath("")  # parity compares the adapter alone, on the bare base
    prepared: dict[str, tuple[Path, list[np.ndarray]]] = {}
    readings: dict[str, float | None] = {}
    unadapted = trainer_logprobs(backend, samples, reference=True)  # the same for every candidate
    for candidate in _candidates(result, trained.final_weights, config):
        set_lora_weights(backend, candidate.served_weights())
        file = export_gguf(
            backend, base, workdir / f"candidate-{candidate.name}.gguf", "personal", keep_peft=config.export_peft
        )
        prepared[candidate.name] = (file, trainer_effects(backend, samples, unadapted))
        readings[candidate.name] = reader.reading(candidate.name, candidate.step, candidate.scale, lambda: None)
    trainer = weakref.ref(backend)
    del backend, trainer_experts, reader, bare
    gc.collect()
    _free_accelerator_cache()
    phases.append(f"trainer freed before the engine reopened: {trainer() is None}")

    with _night_engine(catalog, manifest) as engine:
        experts = Experts(engine, catalog, manifest, base)
        experts.underneath("")

        def prepare(candidate: Candidate) -> tuple[Path, ParityReport]:
            file, effects = prepared[candidate.name]
            return file, parity_from_effects(engine, file, samples, effects, PARITY_TOLERANCE, PARITY_REL_TOLERANCE)

        def validate(candidate: Candidate) -> float | None:
            return readings[candidate.name]

        phases.append("gate: engine reopened for parity and the gate, no trainer loaded")
        extra = {"memory_plan": "sequential", "phases": phases, "rollout_s": round(rollout_s, 1)}
        extra |= _guard_figures(guards) | stop_figures
        return _gate_and_record(night, engine, experts, plan, trained, prepare, None, extra, validate)


def _free_accelerator_cache() -> None:
    """Return the freed trainer's CUDA/MPS blocks to the device before llama.cpp reloads."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    mx = sys.modules.get("mlx.core")
    if mx is not None and hasattr(mx, "clear_cache"):
        mx.clear_cache()


def _guard_figures(guards: list[RowGuard]) -> dict:
    """What the night held besides its feedback: the imitation rows of the main pass (taken
    before the gate, so a gentler retrain's second deal is not counted), the lesson rows and
    their taught tokens."""
    lessons = [g for g in guards if isinstance(g, LessonGuard)]
    imitations = [g for g in guards if isinstance(g, ImitationGuard)]
    return {
        "imitation_rows_per_step": sum(g.per_step for g in imitations),
        "imitation_rows": sum(g.rows_dealt for g in imitations),
        "lesson_rows": sum(len(g.prompts) for g in lessons),
        "anchor_hold_tokens": sum(g.held_tokens for g in guards if isinstance(g, AnchorHold)),
        "lesson_tokens": sum(g.held_tokens for g in lessons),
    }


def _guards(engine: Engine, night: Night, experts: Experts, plan: NightPlan) -> list[RowGuard]:
    """The rows every step adds, built while the engine is open: the plain-text passages
    (learn/passages.py), the anchors' known tokens (learn/anchor_hold.py), the corrections'
    extra SFT rows on a night the step cap crowds (learn/imitation.py) and, on a night that
    continues a deployed version, that version's lessons on everyday requests
    (learn/lesson_guard.py)."""
    config, deployed, night_number = night.config, night.deployed, plan.night
    guards: list[RowGuard] = [PassageGuard(passage_tokens(engine), config.passages_per_step, config.passage_weight)]
    guards.append(
        anchor_hold(
            engine,
            plan.anchors,
            plan.styles,
            experts.stack(None),
            experts.group,
            config.anchor_holds_per_step,
            config.anchor_hold_weight,
        )
    )
    guards.append(
        imitation_guard(
            engine,
            plan.train,
            plan.steps,
            config.episodes_per_step,
            config.imitation_visits,
            config.sft_weight,
            experts.group,
            config.seed,
        )
    )
    if deployed is not None and config.warm_start and config.lesson_weight > 0 and config.lesson_questions > 0:
        questions = lesson_questions(config.lesson_questions, night_number, night.system_prompt)
        handle = engine.load_adapter(deployed.path)
        stacks = experts.stack(None), experts.stack(handle)
        guards.append(
            lesson_guard(engine, questions, *stacks, experts.group, config.lessons_per_step, config.lesson_weight)
        )
        engine.unload_adapter(handle)
    return guards


def _retrain(
    backend, engine: Engine, night: Night, plan: NightPlan, workdir: Path, experts: Experts, initial, guards
) -> Candidate:
    """The last fallback: the night again from its start, half the step size, 4x the KL anchor."""
    config, base = night.config, night.base
    gentler = dataclasses.replace(config, lr=config.lr / 2, kl_beta=config.kl_beta * 4, seed=config.seed + 1)
    set_lora_weights(backend, initial)
    backend.reset_optimizer(gentler.lr)
    result = train(
        backend,
        engine,
        base,
        plan.train,
        gentler,
        workdir,
        reward=lesson_reward(plan.lesson, gentler.lesson_reward),
        steps=plan.steps,
        underneath=experts.underneath,
        group_of=experts.group,
        guards=guards,
    )
    experts.underneath("")
    return Candidate("retrain-gentler", len(result.steps), gentler.lr, gentler.kl_beta, backend.lora_weights())


def learn_once(
    store: Store,
    catalog: Catalog,
    manifest: Manifest,
    config: LearnConfig | None = None,
    slots: list[str] | None = None,
    on_step: Callable[[StepLog], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    system_prompt: str | None = None,
    mode: str | None = None,
    on_notice: Callable[[str], None] | None = None,
) -> list[SlotReport]:
    """One night: the personal adapter, learned from the feedback of every expert's turns (or
    only of the expert `slots` given). Returns one report, or none when there is no feedback."""
    config = config or LearnConfig()
    if engine_settings(catalog.settings).kind == "vllm":
        config = dataclasses.replace(config, export_peft=True)  # vLLM loads each candidate as a PEFT folder
    episodes = [e for e in episodes_from_store(store) if slots is None or e.slot in slots]
    if not episodes or should_stop():
        return []
    report = learn_personal(
        store, catalog, manifest, episodes, config, on_step, None, should_stop, system_prompt, mode, on_notice
    )
    return [report]
