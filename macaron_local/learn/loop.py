"""One learning run's inner loop: on-policy GRPO with the user's correction in every group.

Each step, for a few episodes:
1. rollouts: `group_size` replies sampled by the engine (llama.cpp, the same quantized model
   the user runs) under the adapter being trained, re-exported every `refresh_every` steps;
2. the correction joins the group as one more member (off-policy): what the model would never
   sample (a personal fact, a house style) can still win the group (an anchor joins as its
   first sentence: `member_text`);
3. rewards: how much closer each member is to the correction than to the rejected reply,
   less what it gives back of a correction that cut the reply short (rewards.length_given_back);
4. loss = clipped policy gradient with group-normalised advantages and truncated importance
   weights against the sampler's log-probabilities + beta * KL to the reference
   + sft_weight * NLL of the corrections. The reference is where the night started: the base
   (LoRA off) on a first night, the deployed version on a night that continues it
   (`kl_reference`), so the KL bounds tonight's change, not the sum of every night's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from macaron_local.adapters.validate import BaseModelInfo
from macaron_local.engine import AdapterHandle, Engine, GenerationParams
from macaron_local.learn import losses
from macaron_local.learn.arrays import ops_for
from macaron_local.learn.averaging import AVERAGE_SHARE
from macaron_local.learn.backends.base import (
    Batch,
    Objective,
    TrainerBackend,
    at_scored_positions,
    make_batch,
    step_is_finite,
)
from macaron_local.learn.draws import EpisodeDraws
from macaron_local.learn.episodes import Episode
from macaron_local.learn.export import export_gguf
from macaron_local.learn.guards import RowGuard, guarded_rows, with_guards
from macaron_local.learn.rewards import content_kept, first_sentence, lesson_recall, preference_reward

RewardFn = Callable[[str, Episode], float]
KL_REFERENCES = ("deployed", "base")  # what LearnConfig.kl_reference may name


@dataclass
class LearnConfig:
    # Rank 16, alpha 32: the scale (alpha / rank = 2) of the rank 8 / alpha 16 shipped until
    # stop 57. Three lessons on one night crowd rank 8: allergy + bullets + sistername served the
    # allergy on 0.125 to 0.375 of its prompts in 7 runs at rank 8, and 0.5 and 0.875 at rank 16;
    # the Spanish class beside two lessons 0.25 to 0.375 in 4 runs, and 0.625 and 0.375. One
    # lesson alone held (tldr 1.0; jobfact 0.875 and 0.75), at about a tenth more time. A deployed
    # version of a lower rank is widened, not dropped (learn/warm.py).
    rank: int = 16
    alpha: float = 32.0
    lr: float = 5e-4
    # The cap: a night runs about visits_per_episode visits per episode (learn.plan), at most
    # this many steps. At 72, three lessons on one night (81 episodes with anchors, 2.7 visits
    # each) taught a greeting beside two facts in 1 run of 3 (greeting 0.375, 0.875, 0.0); at
    # 108 (4 visits) in 2 of 2 (1.0, 1.0; 522 and 679 s). Nights of one lesson want fewer.
    # With the cap raised so that a bad knee + an address + a car ran 162 steps (6 visits each,
    # the anchor hold on; stop 53), the knee still served 0.5, in 1100 s: visits were not what
    # it lacked.
    steps: int = 108
    episodes_per_step: int = 2
    group_size: int = 2
    max_new_tokens: int = 48
    temperature: float = 0.9
    kl_beta: float = 0.1
    # What the KL term holds the policy to: "deployed", the version tonight started from (base +
    # the user's adapter: a night's trust region, so the KL does not pull earlier nights' lessons
    # back to the base), or "base". The gate's regression checks always compare with the base.
    kl_reference: str = "deployed"
    sft_weight: float = 1.0
    clip_eps: float = 0.2
    is_cap: float = 2.0
    refresh_every: int = 6
    seed: int = 0
    backend: str = "auto"  # auto | torch | mlx
    # A night's size (learn.plan): `visits_per_episode` visits to each episode trained (dealt
    # evenly, learn/draws.py), within [floor, steps]; `replay_ratio` older episodes per new one;
    # the gate reads at most `max_old_heldout` of earlier nights' held-out episodes.
    # The floor: a lesson needs about this many updates to form, however few episodes carry it.
    # A bad knee applied to advice (9 corrections, 9 anchors) served 0.25 and 0.625 at 54 steps
    # (6 visits), 0.875 at 72 and 81; six visits to tldr's 24 episodes are 72 already, and 8
    # visits (96 steps) took its benchmark to 796 s. At most `max_visits_per_episode` visits each
    # make up the floor, so a night of three corrections is not run 24 times over each.
    min_steps: int = 72
    visits_per_episode: float = 6.0
    max_visits_per_episode: float = 12.0
    # Where the cap leaves corrections fewer visits than this, each step adds SFT-only rows of
    # them, dealt evenly, so each is imitated about this often (learn/imitation.py; 0: off).
    # Nights under the cap (one lesson) add none.
    imitation_visits: float = 6.0
    replay_ratio: float = 1.0
    max_old_heldout: int = 8
    # "Answer as before" episodes on everyday questions per new episode (learn/anchors.py):
    # without them a night that taught personal facts poured them into every answer. One per
    # new episode (0.5 before): terse corrections taught answer-first replies in which the model
    # named the wrong city ("Lyon is the capital of France."). On lower case, 0.5 left 3 of 14
    # full-strength candidates with the bare experts' factual answers (two runs, one of them with
    # the question-free content measure), 1.0 with that measure left 13 of 18 (two runs).
    anchor_ratio: float = 1.0
    # Plain-text passages scored each step and held to the bare experts (learn/passages.py):
    # the gate's passage NLL limit is against the base, and chat replies alone never see plain text.
    passage_weight: float = 1.0
    passages_per_step: int = 2
    # The anchors' answers scored each step too, `anchor_holds_per_step` rows, and their tokens
    # the bare experts are sure of held to them one-sided, times `anchor_hold_weight`
    # (learn/anchor_hold.py): what the model knows, held where a night's long run let it drift.
    # Off by default (0): on five nights of three lessons (stop 51) it kept candidates' factual
    # answers (25 of 29 passed), but no lesson's share rose and a night took up to 60 s longer.
    anchor_hold_weight: float = 0.0
    anchor_holds_per_step: int = 2
    # A sample's reward also counts the share of the night's lesson words (rewards.lesson_words:
    # what the night's corrections keep adding, such as a fact) its episode's correction holds
    # that it says, times this. Off by default (0: chrF alone): at 0.5 (stop 39) allergy went
    # 0.75 then 0.375 and six other scenarios stayed within one prompt of 8 of runs without it.
    lesson_reward: float = 0.0
    # Apply each style tonight's corrections keep adding (a fixed closing line, an address at the
    # end, a bold lead, a case; not an opening label) to the night's other corrections
    # (learn/compose.py): preferences add up, and a correction that fixed one thing is not a
    # vote against the rest.
    compose_styles: bool = True
    # What earlier nights taught, held on `lesson_questions` everyday requests a night
    # (learn/lesson_guard.py): the deployed version's taught tokens in its answers, held to it
    # one-sided, `lessons_per_step` rows a step. Off by default (0): on three second nights it
    # kept bullets better (0.625 -> 0.875) but lost a greeting prompt in one of two runs, and
    # the new fact reached 0.875 instead of 1.0 in both (README, "Two nights").
    lesson_weight: float = 0.0
    lessons_per_step: int = 2
    lesson_questions: int = 16
    # Start from the deployed personal version's weights (same rank and alpha), not from zero.
    warm_start: bool = True
    # When the gate rejects, the seconds the run may spend on cheaper alternatives (learn.backoff).
    backoff_s: float = 300.0
    # Once a back-off candidate passes, the run stops after this many more in a row that do not
    # beat the best so far (0: judge every one the budget allows). The scan goes best reader of
    # tonight's held-out corrections first (learn.validation), or newest first where there is no
    # reading: checkpoints lie on one path, and the older ones taught less. In three nights that
    # judged all newest first (a ratings night's 18, tldr's 12, a second night's 14) the deployed
    # one was found within three of the first to pass, and the scans beyond it cost up to 175 s.
    backoff_patience: int = 3
    # A final that passed the gate is looked past (the back-off runs too) when another candidate
    # reads tonight's held-out corrections this many nats a token better: it overfit them
    # (learn.validation). A very large value never looks past a passing final.
    overfit_margin: float = 0.1
    # Training stops once this many checkpoints in a row read tonight's held-out corrections no
    # better than the best so far, the latest `overfit_margin` below it (learn.validation.
    # EarlyStop; 0: always the planned steps). Off by default: it saved 12 to 24 steps of 72
    # on tldr nights, but a mixedbrief night's lesson formed while that reading fell (best at
    # step 18, -0.25 at the final, which passed the gate and served 0.75); every candidate up
    # to step 36 failed it. Nights with nothing held out to read never stop early.
    early_stop_patience: int = 0
    # The share of the run, from its end, whose checkpoints are averaged with the final into the
    # first candidate the gate judges (learn.averaging; 0: none, the final is judged first).
    average_share: float = AVERAGE_SHARE
    # Where the LoRA is trained: "local" (torch/MLX here) or a remote service, "tinker" or "mint"
    # (off by default: the conversations trained on are sent there; learn/remote_run.py).
    # Keep each exported adapter's PEFT folder next to its GGUF (`<name>.peft/`) and register the
    # run's version with it: vLLM loads PEFT, not GGUF. On whenever the engine is vLLM (learn.run).
    export_peft: bool = False
    trainer: str = "local"
    remote_base_model: str = ""  # the service's name of the base, e.g. "Qwen/Qwen3.6-35B-A3B"


@dataclass
class StepLog:
    step: int
    loss: float
    policy: float
    kl: float
    sft: float
    reward_mean: float
    trainer_tokens: int
    seconds: float
    total: int = 0  # the steps this run plans (a night's size follows its new feedback)
    passages: float = 0.0  # the plain-text term (learn/passages.py), before its weight
    lessons: float = 0.0  # earlier nights' taught tokens (learn/lesson_guard.py), before its weight
    imitation: float = 0.0  # the extra SFT rows of a crowded night (learn/imitation.py), before its weight
    anchor_hold: float = 0.0  # the anchors' known tokens (learn/anchor_hold.py), before its weight


@dataclass
class Checkpoint:
    """The LoRA after `step` steps: a candidate the gate may fall back to."""

    step: int
    weights: dict[str, np.ndarray]


@dataclass
class TrainResult:
    steps: list[StepLog] = field(default_factory=list)
    checkpoints: list[Checkpoint] = field(default_factory=list)
    trainer_tokens: int = 0
    trainer_seconds: float = 0.0
    rollout_seconds: float = 0.0
    start: dict[str, np.ndarray] | None = None  # the LoRA before the first step (the warm start)
    stopped_early: bool = False  # `at_checkpoint` ended it before its planned steps
    skipped_steps: int = 0  # steps whose loss or gradient was not finite: not applied (the backend's `step`)

    @property
    def trainer_tokens_per_s(self) -> float:
        return self.trainer_tokens / self.trainer_seconds if self.trainer_seconds else 0.0


def default_reward(text: str, episode: Episode) -> float:
    """Closeness to what the user wanted; for an anchor, whether its answer's content survived."""
    if episode.content_only and episode.chosen:
        return content_kept(text, episode.chosen, episode.messages[-1]["content"])
    return preference_reward(text, episode.chosen, episode.rejected, episode.also_rejected)


def lesson_reward(lesson: frozenset[str], weight: float) -> RewardFn:
    """`default_reward` plus `weight` x the share of `lesson` words a sample says of those its
    correction holds (`rewards.lesson_recall`); an anchor is judged on its content alone, as
    before. chrF spreads its credit over every character of a correction, so whether a sample
    applies a fact moves it by a few hundredths; this rewards the words that carry it."""
    if not lesson or weight == 0:
        return default_reward

    def reward(text: str, episode: Episode) -> float:
        base = default_reward(text, episode)
        if episode.content_only:
            return base
        return base + weight * lesson_recall(text, episode.chosen, lesson)

    return reward


def completion_tokens(engine: Engine, messages: Sequence[dict[str, str]], reply: str) -> tuple[list[int], list[int]]:
    """(prompt, completion) exactly as the chat template renders them, end-of-turn included, so
    the trainer learns to stop where the user's reply stops."""
    prompt = engine.render_tokens(messages)
    full = engine.render_tokens([*messages, {"role": "assistant", "content": reply}], add_generation_prompt=False)
    if full[: len(prompt)] != prompt:  # a template that rewrites earlier turns: fall back to plain text
        return prompt, engine.tokenize(reply)
    return prompt, full[len(prompt) :]


def grpo_objective(
    batch: Batch,
    sampler: Sequence[Sequence[float]],
    rewards: Sequence[Sequence[float]],
    is_correction: Sequence[bool],
    config: LearnConfig,
    backend: TrainerBackend,
) -> Objective:
    """The step's loss as a function of the trainer's log-probabilities: clipped policy gradient
    with group advantages and truncated importance weights against the sampler (llama.cpp),
    + beta * KL to the reference + sft_weight * NLL of the corrections (their rows only)."""
    mask = np.asarray(batch.mask, dtype=np.float32)
    sampler_logp = at_scored_positions(batch, sampler)
    correction_mask = mask * np.asarray(is_correction, dtype=np.float32)[:, None]
    sampler_arr, correction_arr = backend.asarray(sampler_logp), backend.asarray(correction_mask)
    advantages = losses.group_advantages(backend.asarray(np.asarray(rewards, dtype=np.float32))).flatten()

    def objective(logp, reference, mask_arr):
        ops = ops_for(logp)
        policy = losses.policy_gradient_loss(
            logp,
            ops.stop_gradient(logp),
            advantages,
            mask_arr,
            config.clip_eps,
            sampler_logp=sampler_arr,
            is_cap=config.is_cap,
        )
        kl = losses.kl_to_reference(logp, reference, mask_arr)
        sft = losses.sft_loss(logp, correction_arr)
        return policy + config.kl_beta * kl + config.sft_weight * sft, {"policy": policy, "kl": kl, "sft": sft}

    return objective


def train(
    backend: TrainerBackend,
    engine: Engine,
    base: BaseModelInfo,
    episodes: Sequence[Episode],
    config: LearnConfig,
    workdir: Path,
    *,
    reward: RewardFn = default_reward,
    frozen: Sequence[AdapterHandle] = (),
    on_step: Callable[[StepLog], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    steps: int | None = None,
    underneath: Callable[[str], Sequence[AdapterHandle]] | None = None,
    group_of: Callable[[Episode], str] = lambda e: "",
    checkpoint_every: int = 0,
    guards: Sequence[RowGuard] = (),
    at_checkpoint: Callable[[int], bool] | None = None,
) -> TrainResult:
    """Train the backend's LoRA on `episodes` for `steps` (default `config.steps`); the engine
    samples under `frozen` (the expert) plus the current rollout adapter.

    Episodes answered by different experts (`group_of`) are trained each with its own expert
    underneath: a step draws its episodes from one group (learn/draws.py deals them: each
    episode within one visit of every other), and `underneath(group)` makes the
    backend and the engine carry that group's expert (returning the engine's frozen set).
    Every `checkpoint_every` steps the LoRA weights are kept as a fallback candidate, and
    `at_checkpoint(step)` (if given) may end training there (`_stops_early`).
    A correction or up-vote pulls toward its chosen reply; a down-vote or regenerate with no
    correction joins its group as the worst member, so the policy is pushed away from it."""
    draws = EpisodeDraws.for_night(episodes, group_of, config.seed)
    total = steps if steps is not None else config.steps
    result = TrainResult(start=backend.lora_weights())
    reference = kl_reference_weights(result.start, config)
    for guard in guards:
        guard.begin(result.start)
    rollout: AdapterHandle | None = None
    for step in range(total):
        if should_stop():
            break
        started = time.perf_counter()
        expert_group, picked = draws.next_step(config.episodes_per_step)
        if underneath is not None:
            frozen = list(underneath(expert_group))
        if step and step % config.refresh_every == 0:
            path = export_gguf(backend, base, workdir / f"rollout-{step}.gguf", keep_peft=config.export_peft)
            engine.set_adapters(list(frozen))
            if rollout is not None:
                engine.unload_adapter(rollout)
            rollout = engine.load_adapter(path)
        engine.set_adapters([*frozen, *([rollout] if rollout else [])])
        sampled = sample_step(engine, picked, expert_group, step, config, reward)
        result.rollout_seconds += time.perf_counter() - started
        _learn_step(backend, sampled, config, result, started, total, checkpoint_every, on_step, reference, guards)
        if _stops_early(result, step, at_checkpoint):
            break
    engine.set_adapters(list(frozen))
    if rollout is not None:
        engine.unload_adapter(rollout)
    return result


@dataclass
class StepRollouts:
    """One step's sampled groups, everything the trainer needs and nothing of the engine's."""

    step: int
    group: str  # the expert underneath ("" = the bare base)
    prompts: list[list[int]] = field(default_factory=list)
    completions: list[list[int]] = field(default_factory=list)
    sampler: list[list[float]] = field(default_factory=list)  # llama.cpp's log-probabilities
    rewards: list[list[float]] = field(default_factory=list)
    is_correction: list[bool] = field(default_factory=list)


def sample_step(
    engine: Engine,
    episodes: Sequence[Episode],
    group: str,
    step: int,
    config: LearnConfig,
    reward: RewardFn,
) -> StepRollouts:
    """The step's `episodes` (learn/draws.py deals them), each with `group_size` replies sampled
    by the engine under its current adapters, the correction as one more member, the sampler's
    log-probabilities and the rewards."""
    out = StepRollouts(step, group)
    for episode in episodes:
        target = member_text(episode)
        prompt, chosen = completion_tokens(engine, episode.messages, target)
        members = []
        for g in range(config.group_size):
            params = GenerationParams(
                max_tokens=config.max_new_tokens,
                temperature=config.temperature,
                seed=config.seed * 7919 + step * 31 + g,
            )
            done = engine.generate(prompt, params)
            tokens = done.tokens + ([done.stop_token] if done.stop_token is not None else [])
            members.append((tokens, done.text))
        group_members = [*members, (chosen, target)]
        imitated = episode.imitated  # an anchor gets no SFT row
        for tokens, _ in group_members:
            out.prompts.append(prompt)
            out.completions.append(tokens)
            out.sampler.append(engine.token_logprobs(prompt, tokens).tolist())
            out.is_correction.append(imitated and tokens is chosen)  # the member, not a sample
        out.rewards.append([reward(text, episode) for _, text in group_members])
    return out


def member_text(episode: Episode) -> str:
    """The reply that joins an episode's group beside the samples: the correction (or liked
    reply), else the rejected one; for an anchor, its bare answer's first sentence only.

    An anchor is judged on what that sentence says (`rewards.content_kept`), so the whole bare
    answer as a member pulled toward its form too: whenever a sample lost the content, the
    member won the group and the policy moved toward the bare expert's length. On a night of
    "twelve words at most" the anchors' everyday questions are the very kind the user shortened.
    """
    if episode.content_only and episode.chosen:
        return first_sentence(episode.chosen)
    return episode.chosen or episode.rejected or ""


def _learn_step(
    backend: TrainerBackend,
    sampled: StepRollouts,
    config: LearnConfig,
    result: TrainResult,
    started: float,
    total: int,
    checkpoint_every: int,
    on_step: Callable[[StepLog], None] | None,
    reference: dict[str, np.ndarray] | None = None,
    guards: Sequence[RowGuard] = (),
) -> None:
    """One optimizer step on `sampled`, logged (and checkpointed every `checkpoint_every`).
    `reference`: the LoRA weights the KL term holds the policy to (None: the base). `guards`:
    rows scored in the same batch and held in place (learn/guards.py: plain-text passages,
    the anchors' known tokens, earlier nights' lessons)."""
    step, rewards = sampled.step, sampled.rewards
    trained = time.perf_counter()
    rows = len(sampled.prompts)
    extras = guarded_rows(guards, step, sampled.group)
    extra_prompts = [p for _, prompts, _ in extras for p in prompts]
    extra_completions = [c for _, _, completions in extras for c in completions]
    batch = make_batch([*sampled.prompts, *extra_prompts], [*sampled.completions, *extra_completions])
    samples = batch.rows(slice(0, rows))
    objective = grpo_objective(samples, sampled.sampler, rewards, sampled.is_correction, config, backend)
    if extras:
        objective = with_guards(objective, extras, backend, batch, rows, step, sampled.group)
    # the KL reference of the samples' rows only (the guards' own are cached by each guard)
    if reference is None:
        held_to = backend.reference_logprobs(samples)
    else:
        held_to = backend.asarray(logprobs_at(backend, samples, reference))

    def against_reference(logp, _unused, mask):
        return objective(logp, held_to, mask)

    outcome = backend.train_step(batch, against_reference, with_reference=False)
    if not step_is_finite(outcome.loss, outcome.grad_norm):
        result.skipped_steps += 1
    tokens = batch.n_tokens
    result.trainer_seconds += time.perf_counter() - trained
    result.trainer_tokens += tokens
    log = StepLog(
        step=step,
        loss=outcome.loss,
        policy=outcome.parts["policy"],
        kl=outcome.parts["kl"],
        sft=outcome.parts["sft"],
        passages=outcome.parts.get("passages", 0.0),
        lessons=outcome.parts.get("lessons", 0.0),
        imitation=outcome.parts.get("imitation", 0.0),
        anchor_hold=outcome.parts.get("anchor_hold", 0.0),
        reward_mean=float(sum(map(sum, rewards)) / max(1, sum(map(len, rewards)))),
        trainer_tokens=tokens,
        seconds=time.perf_counter() - started,
        total=total,
    )
    result.steps.append(log)
    if checkpoint_every and (step + 1) % checkpoint_every == 0 and step + 1 < total:
        result.checkpoints.append(Checkpoint(step + 1, backend.lora_weights()))
    if on_step is not None:
        on_step(log)


def _stops_early(result: TrainResult, step: int, at_checkpoint: Callable[[int], bool] | None) -> bool:
    """After step index `step`: whether `at_checkpoint` asks to stop at the checkpoint just kept
    (only asked when one was). The final candidate is then those same weights, so that
    checkpoint is dropped from the fallbacks rather than judged twice."""
    kept = result.checkpoints[-1].step if result.checkpoints else None
    if at_checkpoint is None or kept != step + 1 or not at_checkpoint(kept):
        return False
    result.checkpoints.pop()
    result.stopped_early = True
    return True


def kl_reference_weights(start: dict[str, np.ndarray] | None, config: LearnConfig) -> dict[str, np.ndarray] | None:
    """The LoRA weights the KL term is taken against: tonight's starting point when the night
    continues a deployed version and `config.kl_reference` is "deployed"; None (the base, the
    backend's own reference) otherwise. A start whose B factors are all zero is the base."""
    if config.kl_reference not in KL_REFERENCES:
        raise ValueError(f'kl_reference must be "deployed" or "base" (got {config.kl_reference!r})')
    if config.kl_reference == "base" or not adapts(start):
        return None
    return start


def adapts(weights: dict[str, np.ndarray] | None) -> bool:
    """Whether LoRA `weights` change the model at all: a LoRA whose B factors are all zero (a
    fresh one) serves the base, whatever its A."""
    return bool(weights) and any(np.any(v) for name, v in weights.items() if name.endswith("lora_B"))


def set_lora_weights(backend: TrainerBackend, weights: dict[str, np.ndarray]) -> None:
    for name, values in weights.items():
        backend.set_lora_weight(name, values)


def logprobs_at(backend: TrainerBackend, batch, weights: dict[str, np.ndarray]) -> np.ndarray:
    """`batch`'s log-probabilities with the LoRA set to `weights`, as numpy (no step is taken,
    and the LoRA's own weights are put back). With a stacked expert, the expert stays under it."""
    current = backend.lora_weights()
    try:
        set_lora_weights(backend, weights)
        return backend.to_numpy(backend.logprobs(batch))
    finally:
        set_lora_weights(backend, current)


def sample_night(
    engine: Engine,
    episodes: Sequence[Episode],
    config: LearnConfig,
    *,
    steps: int,
    reward: RewardFn = default_reward,
    should_stop: Callable[[], bool] = lambda: False,
    underneath: Callable[[str], Sequence[AdapterHandle]] | None = None,
    group_of: Callable[[Episode], str] = lambda e: "",
) -> tuple[list[StepRollouts], float]:
    """The sequential plan's first phase: every step's rollouts for the night, through
    llama.cpp alone (no trainer resident), drawn exactly as `train` draws them (same groups,
    same episodes, same seeds). All are sampled under the frozen expert only, as `train`'s
    first `refresh_every` steps are. Returns the rollouts and their seconds."""
    draws = EpisodeDraws.for_night(episodes, group_of, config.seed)
    started = time.perf_counter()
    night: list[StepRollouts] = []
    for step in range(steps):
        if should_stop():
            break
        expert_group, picked = draws.next_step(config.episodes_per_step)
        engine.set_adapters(list(underneath(expert_group)) if underneath is not None else [])
        night.append(sample_step(engine, picked, expert_group, step, config, reward))
    engine.set_adapters([])
    return night, time.perf_counter() - started


def train_on_rollouts(
    backend: TrainerBackend,
    night: Sequence[StepRollouts],
    config: LearnConfig,
    *,
    on_step: Callable[[StepLog], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    underneath: Callable[[str], object] | None = None,
    checkpoint_every: int = 0,
    guards: Sequence[RowGuard] = (),
    at_checkpoint: Callable[[int], bool] | None = None,
) -> TrainResult:
    """The sequential plan's second phase: the trainer steps on rollouts sampled before it was
    loaded (the engine is closed meanwhile). They grow stale as the LoRA moves; the loss
    already corrects for that: its importance ratio is taken against the sampler's recorded
    log-probabilities (truncated at `is_cap`, clipped at `clip_eps`), not against the trainer's
    own, so an off-policy sample is reweighted the same way as the correction in every group."""
    result = TrainResult(start=backend.lora_weights())
    reference = kl_reference_weights(result.start, config)
    for guard in guards:
        guard.begin(result.start)
    for sampled in night:
        if should_stop():
            break
        started = time.perf_counter()
        if underneath is not None:
            underneath(sampled.group)  # the group's expert stacked or folded into the trainer
        _learn_step(backend, sampled, config, result, started, len(night), checkpoint_every, on_step, reference, guards)
        if _stops_early(result, sampled.step, at_checkpoint):
            break
    return result
