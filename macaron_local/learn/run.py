"""One learning run, per expert slot: train -> export -> parity -> gate -> register -> deploy or reject.

The gate compares the candidate with the version deployed now (or the bare expert) on:
- held-out feedback: conversations kept out of training; greedy replies through the engine are
  scored by how much closer they are to the user's chosen reply than to the rejected one;
- the regression set: passage NLL may not rise by more than 2% relative, and no fewer factual
  questions may be answered right.
Only a candidate that wins on held-out feedback, passes both regression checks and passes the
parity check is deployed. Every run is recorded, with its data, losses, evaluations, decision,
reason and wall time, in the store and (for its adapter) in the registry.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from macaron_local.adapters.validate import BaseModelInfo
from macaron_local.catalog import Catalog, Manifest
from macaron_local.engine import AdapterHandle, Engine, EngineConfig, GenerationParams
from macaron_local.learn.backends.gguf_weights import frozen_deltas
from macaron_local.learn.episodes import Episode, episodes_from_store
from macaron_local.learn.export import export_gguf, parity_check
from macaron_local.learn.loop import LearnConfig, StepLog, completion_tokens, train
from macaron_local.learn.regression import score as regression_score
from macaron_local.learn.rewards import preference_reward
from macaron_local.learn.workdir import run_workdir
from macaron_local.store import Store

MAX_NLL_INCREASE = 0.02
#: The adapter's effect may differ by this much (nats, any token) between llama.cpp's quantized
#: base and the trainer's dequantized copy. Measured: 0.41 on the embedded Q4_1 model after the
#: tldr scenario, where the adapter moves the first token by many nats; float32 bases agree to
#: about 1e-6. A broken export (wrong rows, a missing pair) differs by the whole effect.
PARITY_TOLERANCE = 1.0
GATE_REPLY = GenerationParams(max_tokens=64, temperature=0.0, repeat_penalty=1.1)


@dataclass
class SlotReport:
    slot: str
    decision: str  # deployed | rejected | skipped
    reason: str
    version_id: str | None = None
    run_id: str | None = None
    metrics: dict = field(default_factory=dict)


def split_by_conversation(episodes: list[Episode], share: float = 0.25, seed: int = 0) -> tuple[list, list]:
    """Hold out whole conversations (never a reply whose siblings were trained on)."""
    conversations = sorted({e.conversation_id for e in episodes})
    random.Random(seed).shuffle(conversations)
    n_held = max(1, round(len(conversations) * share)) if len(conversations) >= 4 else 0
    held = set(conversations[:n_held])
    return [e for e in episodes if e.conversation_id not in held], [e for e in episodes if e.conversation_id in held]


def heldout_reward(engine: Engine, adapters: list[AdapterHandle], episodes: list[Episode]) -> float:
    engine.set_adapters(adapters)
    rewards = []
    for episode in episodes:
        reply = engine.generate(engine.render_tokens(episode.messages), GATE_REPLY).text
        rewards.append(preference_reward(reply, episode.chosen, episode.rejected))
    return statistics.fmean(rewards) if rewards else 0.0


def learn_slot(
    store: Store,
    catalog: Catalog,
    manifest: Manifest,
    slot: str,
    episodes: list[Episode],
    config: LearnConfig,
    on_step: Callable[[StepLog], None] | None = None,
    backend_factory: Callable[[float], object] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> SlotReport:
    """Train, export, check and gate one slot. `should_stop` is polled between training steps
    (the daemon stops when a chat starts or the machine goes on battery): an interrupted run is
    recorded as such, and nothing half-trained is judged or kept."""
    started = time.perf_counter()
    train_set, held_out = split_by_conversation(episodes, seed=config.seed)
    if not held_out or not any(e.chosen for e in train_set):
        return SlotReport(slot, "skipped", f"{len(episodes)} episode(s) are too few to train and hold some out")
    base_path = catalog.base_path(manifest)
    base = BaseModelInfo.from_gguf(base_path)
    deployed = store.deployed_adapter(slot, manifest.name)
    feedback_ids = sorted({i for e in episodes for i in e.feedback_ids})
    if backend_factory is None:
        from macaron_local.learn.backends import make_backend

        def backend_factory(lr: float):
            return make_backend(config.backend, lr)

    with (
        run_workdir(store.db_path.parent / "learn-work") as workdir,
        Engine(EngineConfig(model_path=base_path, n_ctx=2048, kv_switch="reset")) as engine,
    ):
        expert_path = catalog.expert_path(manifest, slot)
        frozen = [engine.load_adapter(expert_path)] if expert_path else []
        current = [*frozen, engine.load_adapter(deployed.path)] if deployed else list(frozen)

        backend = backend_factory(config.lr)
        backend.load(base_path, checkpoint=catalog.trainer_checkpoint(manifest))
        if expert_path:  # train on top of the frozen expert, exactly as the two are served stacked
            backend.fold_in(frozen_deltas(expert_path, base, backend.linear_weight_names()))
        backend.add_lora(rank=config.rank, alpha=config.alpha, seed=config.seed)
        result = train(
            backend, engine, base, train_set, config, workdir, frozen=frozen, on_step=on_step, should_stop=should_stop
        )
        if len(result.steps) < config.steps:
            reason = (
                f"interrupted after {len(result.steps)} of {config.steps} steps; its feedback waits for the next run"
            )
            run_id = store.record_learning_run(
                slot=slot,
                status="interrupted",
                feedback_ids=[],  # not consumed: the next run still counts it as new
                decision="skipped",
                reason=reason,
                metrics={"steps": len(result.steps), "pending_feedback_ids": feedback_ids},
            )
            return SlotReport(slot, "skipped", reason, None, run_id, {"steps": len(result.steps)})
        candidate_file = export_gguf(backend, base, workdir / "candidate.gguf", task_name=f"{slot} personal")

        samples = [completion_tokens(engine, e.messages, e.chosen) for e in held_out if e.chosen][:4]
        engine.set_adapters(frozen)
        parity = parity_check(engine, candidate_file, backend, samples, PARITY_TOLERANCE)
        candidate = [*frozen, engine.load_adapter(candidate_file)]
        reward_before = heldout_reward(engine, current, held_out)
        reward_after = heldout_reward(engine, candidate, held_out)
        regression_before = regression_score(engine, current)
        regression_after = regression_score(engine, candidate)
        nll_delta = regression_after.passage_nll / regression_before.passage_nll - 1
        metrics = {
            "train_episodes": len(train_set),
            "heldout_episodes": len(held_out),
            "steps": len(result.steps),
            "losses": [round(s.loss, 4) for s in result.steps],
            "final_kl": round(result.steps[-1].kl, 4) if result.steps else None,
            "heldout_reward_before": round(reward_before, 4),
            "heldout_reward_after": round(reward_after, 4),
            "regression_nll_delta": round(nll_delta, 4),
            "regression_qa_before": regression_before.qa_right,
            "regression_qa_after": regression_after.qa_right,
            "parity_max_abs_diff": round(parity.max_abs_diff, 5),
            "parity_mean_abs_diff": round(parity.mean_abs_diff, 5),
            "trainer_tokens_per_s": round(result.trainer_tokens_per_s, 1),
        }
        reasons = []
        if not parity.ok:
            reasons.append(parity.summary())
        if reward_after <= reward_before:
            reasons.append(f"held-out feedback did not improve ({reward_before:.3f} -> {reward_after:.3f})")
        if nll_delta > MAX_NLL_INCREASE:
            reasons.append(f"passage NLL rose {nll_delta:+.1%} (limit +{MAX_NLL_INCREASE:.0%})")
        if regression_after.qa_right < regression_before.qa_right:
            reasons.append(f"factual answers dropped {regression_before.qa_right} -> {regression_after.qa_right}")
        decision = "rejected" if reasons else "deployed"
        reason = "; ".join(reasons) or (
            f"held-out feedback {reward_before:.3f} -> {reward_after:.3f}, passage NLL {nll_delta:+.1%}, "
            f"factual answers {regression_before.qa_right} -> {regression_after.qa_right}"
        )
        metrics["wall_s"] = round(time.perf_counter() - started, 1)
        run_id = store.record_learning_run(
            slot=slot, status="done", feedback_ids=feedback_ids, decision=decision, reason=reason, metrics=metrics
        )
        version = store.register_adapter(
            candidate_file,
            slot=slot,
            base_model=manifest.name,
            rank=config.rank,
            parent_id=deployed.id if deployed else None,
            learning_run_id=run_id,
            feedback_ids=feedback_ids,
            evaluations=metrics,
            status="candidate" if decision == "deployed" else "rejected",
        )
        if decision == "deployed":
            store.deploy_adapter(version.id)
        store.set_learning_run_adapter(run_id, version.id)
    return SlotReport(slot, decision, reason, version.id, run_id, metrics)


def learn_once(
    store: Store,
    catalog: Catalog,
    manifest: Manifest,
    config: LearnConfig | None = None,
    slots: list[str] | None = None,
    on_step: Callable[[StepLog], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> list[SlotReport]:
    """One run over every slot that has feedback (until `should_stop` says otherwise)."""
    config = config or LearnConfig()
    by_slot: dict[str, list[Episode]] = {}
    for episode in episodes_from_store(store):
        by_slot.setdefault(episode.slot, []).append(episode)
    reports = []
    for slot, episodes in sorted(by_slot.items()):
        if slots is not None and slot not in slots:
            continue
        if should_stop():
            break
        reports.append(learn_slot(store, catalog, manifest, slot, episodes, config, on_step, should_stop=should_stop))
    return reports
