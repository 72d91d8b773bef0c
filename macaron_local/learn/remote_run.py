"""A night trained by a remote trainer (`[learn] trainer = "tinker"` or `"mint"`).

The same night as the sequential plan (learn/run.py), with the trainer elsewhere:
1. rollouts for every step through the engine here (`sample_night`), as they would be sampled
   for a local trainer;
2. each step's rollouts sent to the service (`forward_backward` with importance sampling, then
   `optim_step`): this is where the user's conversations leave the machine;
3. the adapter downloaded as a PEFT folder, converted to a GGUF candidate here, its effect on a
   few held-out replies compared with the service's own log-probabilities (parity), and the
   candidate gated like every other one before anything is deployed.
The service trains on the bare base: a personal adapter learned remotely does not see the
expert underneath it during training (it is served stacked on it, as always).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from macaron_local import secrets
from macaron_local.adapters import read_adapter, write_adapter
from macaron_local.errors import InvalidInputError
from macaron_local.learn.anchors import answer_anchors
from macaron_local.learn.backends.tinker_backend import (
    LEAVES_THE_MACHINE,
    TinkerTrainer,
    datum_arrays,
    peft_to_candidate,
)
from macaron_local.learn.export import ParityReport, parity_from_effects
from macaron_local.learn.loop import LearnConfig, StepLog, TrainResult, completion_tokens, lesson_reward, sample_night
from macaron_local.learn.losses import group_advantages
from macaron_local.learn.plan import NightPlan
from macaron_local.learn.workdir import run_workdir

if TYPE_CHECKING:
    from macaron_local.learn.run import Night

REMOTE_TRAINERS = ("tinker", "mint")


def consent_line(config: LearnConfig) -> str:
    return LEAVES_THE_MACHINE.format(service=config.trainer)


def advantages_of(rewards: list[list[float]]) -> list[list[float]]:
    return [np.asarray(group_advantages(np.asarray(group, dtype=np.float64))).tolist() for group in rewards]


def service_logprobs(trainer: TinkerTrainer, samples) -> list[np.ndarray]:
    """The trained policy's log-probabilities of each sample's reply, computed by the service."""
    types = trainer.sdk.types
    datums = []
    for prompt, completion in samples:
        arrays = datum_arrays(prompt, completion, [0.0] * len(completion), 0.0)
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(arrays["model_input"].tolist()),
                loss_fn_inputs={"target_tokens": arrays["target_tokens"]},
            )
        )
    output = trainer.client.forward(datums, "cross_entropy").result()
    return [
        np.asarray(out["logprobs"].to_numpy(), dtype=np.float64)[len(prompt) - 1 :]
        for out, (prompt, _) in zip(output.loss_fn_outputs, samples, strict=True)
    ]


def learn_personal_remote(night: Night, plan: NightPlan, on_notice: Callable[[str], None] | None = None):
    """`plan` trained by the remote service, then gated here like every other night."""
    from macaron_local.learn.run import (
        PARITY_REL_TOLERANCE,
        PARITY_TOLERANCE,
        Experts,
        Trained,
        _gate_and_record,
        _interrupted,
        _night_engine,
    )

    store, catalog, manifest, config = night.store, night.catalog, night.manifest, night.config
    on_step, should_stop, base = night.on_step, night.should_stop, night.base

    if not config.remote_base_model:
        raise InvalidInputError("[learn] remote_base_model must name the service's base (e.g. Qwen/Qwen3.6-35B-A3B)")
    if on_notice is not None:
        on_notice(consent_line(config))
    # The service first: a missing SDK, key or base fails here, before an hour of rollouts.
    trainer = TinkerTrainer(
        config.remote_base_model, rank=config.rank, lr=config.lr, seed=config.seed,
        sdk=config.trainer, api_key=secrets.get_tinker_key(),
    )  # fmt: skip
    with (
        run_workdir(store.db_path.parent / "learn-work") as workdir,
        _night_engine(catalog, manifest) as engine,
    ):
        experts = Experts(engine, catalog, manifest, base)
        plan.anchors = answer_anchors(engine, plan.anchors, experts.stack(None))
        rollouts_by_step, rollout_s = sample_night(
            engine, plan.train, config, steps=plan.steps, should_stop=should_stop,
            underneath=experts.underneath, group_of=experts.group,
            reward=lesson_reward(plan.lesson, config.lesson_reward),
        )  # fmt: skip
        if len(rollouts_by_step) < plan.steps:
            return _interrupted(store, plan, TrainResult())
        samples = [completion_tokens(engine, e.messages, e.chosen) for e in plan.held_new if e.chosen][:4]
        result = TrainResult(rollout_seconds=rollout_s)
        training = time.perf_counter()
        for rollouts in rollouts_by_step:
            if should_stop():
                return _interrupted(store, plan, result)
            began = time.perf_counter()
            loss = trainer.step(rollouts, advantages_of(rollouts.rewards))
            tokens = sum(len(p) + len(c) for p, c in zip(rollouts.prompts, rollouts.completions, strict=True))
            log = StepLog(
                rollouts.step, loss, loss, 0.0, 0.0, float(np.mean(rollouts.rewards)), tokens,
                time.perf_counter() - began, plan.steps,
            )  # fmt: skip
            result.steps.append(log)
            result.trainer_tokens += tokens
            if on_step is not None:
                on_step(log)
        result.trainer_seconds = time.perf_counter() - training
        peft = trainer.export(f"macaron-night-{plan.night}", workdir / "remote-peft")
        if config.export_peft:  # kept next to the candidate, as vLLM loads it (learn.export)
            peft = peft.rename(workdir / "candidate-final.peft")
        final_file = peft_to_candidate(peft, base, workdir / "candidate-final.gguf")
        experts.underneath("")  # parity compares the adapter alone, on the bare base
        effects = []
        for (prompt, completion), tuned in zip(samples, service_logprobs(trainer, samples), strict=True):
            engine.set_adapters([])
            effects.append(tuned - engine.token_logprobs(prompt, completion))
        note = f"remote trainer {config.trainer} on {config.remote_base_model}"
        trained = Trained(result, {}, time.perf_counter() - night.started, note)

        def prepare(candidate) -> tuple:
            file = final_file
            if candidate.scale != 1.0:  # the half-strength back-off: B scaled, written anew
                adapter = read_adapter(final_file)
                for pair in adapter.pairs.values():
                    pair.b = pair.b * np.float32(candidate.scale)
                file = write_adapter(workdir / f"candidate-{candidate.name}.gguf", adapter, dtype="F16")
            report: ParityReport = parity_from_effects(
                engine, file, samples, [e * candidate.scale for e in effects], PARITY_TOLERANCE, PARITY_REL_TOLERANCE
            )
            return file, report

        extra = {"trainer": config.trainer, "left_the_machine": consent_line(config)}
        return _gate_and_record(night, engine, experts, plan, trained, prepare, None, extra)
