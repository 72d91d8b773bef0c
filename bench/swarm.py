"""Swarm benchmark: K adapter variants voting vs one model sampled K times, on a verifiable task set.

The task set is 30 short questions with one numeric answer (arithmetic and counting facts),
checked with the same `normalize_answer` the vote uses. The embedded model (SmolLM2-135M)
answers in sentences, so the check reads the last number, as the vote does.

There are no real experts for the embedded model, so the variants are built honestly as what
they are: `--variants - 1` random small LoRAs (rank 4 on every linear layer, `--magnitude`
scale) registered in a throwaway registry as candidate versions of `embedded`, gathered with
`swarm.gather_variants` (newest first, the base last), and asked one by one, greedily, with
the same `answer_with` and `vote` that `macaron ask --vote K` runs. The reference, in the same
run and process: the base alone sampled K times at `--temperature` (seeded), majority-voted
with the same `vote`.

Each question is asked once of all variants (and sampled the largest K times); the figure for
K uses the first K voters (samples), which is what a vote with K does, and its time is the sum
of those voters' measured times (adapter switch included). Per K it reports:
- `accuracy`: the vote's answer is right; `mean_single_accuracy`: the voters' own mean;
- `coverage`: at least one voter was right (what a perfect judge could reach);
- `agreement`: the winner's share of the votes, averaged;
- `time_s` and `s_per_question` (wall), `cpu_s_per_question` and `cpu_cost_vs_k1` (process
  CPU time, which the other work on a shared machine disturbs far less than wall time), and
  `tokens_generated` and `ms_per_generated_token` (voters stop at different lengths, so cost
  per token is what compares fairly), and `prompt_tokens_evaluated` per question (prompt tokens not
  taken from a cached prefix): a variant cannot reuse another variant's KV (it was computed
  under other adapters), only its own from the previous question (the shared chat-template
  prefix); samples of one model reuse the whole prompt.

One llama.cpp thread by default: with two, a thread that loses its core to other work stalls
its partner at every barrier, and a shared 2-core machine then measures the scheduler; one
thread slows down only in proportion, so the cost-vs-K shape stays readable.

Usage: python bench/swarm.py [--json] [--questions N] [--variants V] [--magnitude M] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from common import embedded_model, random_lora

from macaron_local.adapters import BaseModelInfo, write_adapter
from macaron_local.catalog import Catalog
from macaron_local.engine import Completion, Engine, EngineConfig, GenerationParams
from macaron_local.settings import Settings
from macaron_local.store import open_default_store
from macaron_local.swarm import Variant, answer_with, gather_variants, normalize_answer, vote

KS = (1, 3, 5, 9)
FORMAT = "{question} Answer with a number."

#: (question, answer): one number each, easy to check, hard enough for a 135M model to miss.
TASKS: list[tuple[str, int]] = [
    ("What is 7 + 5?", 12),
    ("What is 9 times 3?", 27),
    ("How many legs does a spider have?", 8),
    ("What is 15 minus 8?", 7),
    ("How many days are in a week?", 7),
    ("What is 100 divided by 4?", 25),
    ("How many sides does a triangle have?", 3),
    ("What is 6 * 7?", 42),
    ("What is 10 + 10?", 20),
    ("How many months are in a year?", 12),
    ("What is 8 + 6?", 14),
    ("What is 5 times 5?", 25),
    ("How many hours are in a day?", 24),
    ("What is 20 minus 3?", 17),
    ("How many legs does a dog have?", 4),
    ("What is 3 + 4?", 7),
    ("How many minutes are in an hour?", 60),
    ("What is 12 divided by 3?", 4),
    ("How many sides does a square have?", 4),
    ("What is 2 times 8?", 16),
    ("What is 11 + 11?", 22),
    ("How many continents are there?", 7),
    ("What is 50 + 50?", 100),
    ("What is 9 minus 4?", 5),
    ("How many wheels does a tricycle have?", 3),
    ("What is 4 * 4?", 16),
    ("How many seconds are in a minute?", 60),
    ("What is 30 divided by 5?", 6),
    ("How many players does a soccer team have on the field?", 11),
    ("What is 1 + 1?", 2),
]


def registered_variants(home: Path, model: Path, count: int, magnitude: float) -> list[Variant]:
    """`count` random versions registered as candidates of `embedded` in a throwaway registry,
    gathered the way `macaron ask --vote` gathers them (so the base comes last)."""
    settings = Settings.load(home)
    settings.ensure_dirs()
    base = BaseModelInfo.from_gguf(model)
    with open_default_store(settings) as store:
        for i in range(count):
            variant = random_lora(base, 4, seed=100 + i, magnitude=magnitude, alpha=4.0)
            path = write_adapter(home / f"variant-{i}.gguf", variant)
            store.register_adapter(path, slot="L0", base_model="embedded", rank=4)
        catalog = Catalog(settings)
        return gather_variants(store, catalog, catalog.get("embedded"))


@dataclass
class Voter:
    """One voter's answer to one question, its wall and CPU time, and the prompt tokens it
    evaluated (not taken from a cached prefix)."""

    text: str
    ms: float
    cpu_ms: float
    prompt_evaluated: int
    generated: int


def timed(answer: Callable[[], Completion]) -> Voter:
    """Run one voter. CPU time is the process's (llama.cpp's threads included): on a machine
    shared with other work it moves far less than wall time."""
    wall, cpu = time.perf_counter(), time.process_time()
    done = answer()
    ms, cpu_ms = (time.perf_counter() - wall) * 1000, (time.process_time() - cpu) * 1000
    return Voter(done.text, ms, cpu_ms, done.prompt_tokens - done.reused_prompt_tokens, len(done.tokens))


@dataclass
class Question:
    answer: str
    swarm: list[Voter] = field(default_factory=list)
    sampled: list[Voter] = field(default_factory=list)


def summarize(questions: list[Question], which: str, k: int) -> dict[str, float]:
    """The figures for votes of the first `k` voters (`which`: "swarm" or "sampled")."""
    right, single, covered, agreement, seconds, cpu, evaluated, generated = [], [], [], [], 0.0, 0.0, 0, 0
    for q in questions:
        voters = getattr(q, which)[:k]
        result = vote([v.text for v in voters])
        right.append(result.winner == q.answer)
        single.append(statistics.fmean(a == q.answer for a in result.answers))
        covered.append(q.answer in result.answers)
        agreement.append(result.agreement)
        seconds += sum(v.ms for v in voters) / 1000
        cpu += sum(v.cpu_ms for v in voters) / 1000
        evaluated += sum(v.prompt_evaluated for v in voters)
        generated += sum(v.generated for v in voters)
    n = len(questions)
    return {
        "accuracy": round(statistics.fmean(right), 3),
        "mean_single_accuracy": round(statistics.fmean(single), 3),
        "coverage": round(statistics.fmean(covered), 3),
        "agreement": round(statistics.fmean(agreement), 3),
        "time_s": round(seconds, 2),
        "s_per_question": round(seconds / n, 3),
        "cpu_s_per_question": round(cpu / n, 3),
        "prompt_tokens_evaluated": round(evaluated / n, 1),
        "tokens_generated": round(generated / n, 1),
        "ms_per_generated_token": round(seconds * 1000 / max(generated, 1), 2),
    }


def ask(
    engine: Engine,
    variants: list[Variant],
    messages: list[dict[str, str]],
    expected: str,
    params: GenerationParams,
    sampling: GenerationParams,
    seeds: list[int],
) -> Question:
    """One question: each variant greedily (what run_swarm does, timed per voter), then the base
    sampled once per seed."""
    question = Question(answer=expected)
    prompt, _ = engine.prompt_for(messages, params.max_tokens)
    for variant in variants:
        question.swarm.append(timed(partial(answer_with, engine, variant, prompt, params)))
    engine.set_adapters([])
    for seed in seeds:
        question.sampled.append(timed(partial(engine.generate, prompt, replace(sampling, seed=seed))))
    return question


def run(args: argparse.Namespace) -> dict:
    model = embedded_model()
    tasks = TASKS[: args.questions]
    params = GenerationParams(max_tokens=args.max_tokens, temperature=0.0)
    sampling = GenerationParams(max_tokens=args.max_tokens, temperature=args.temperature)
    with tempfile.TemporaryDirectory(prefix="macaron-swarm-bench-") as tmp:
        variants = registered_variants(Path(tmp), model, args.variants - 1, args.magnitude)
        # One saved KV state per variant, so each keeps its own prefix between questions.
        config = EngineConfig(model_path=model, n_ctx=1024, n_threads=args.threads, max_saved_states=len(variants) + 1)
        questions: list[Question] = []
        started = time.perf_counter()
        with Engine(config) as engine:
            for index, (text, expected) in enumerate(tasks):
                messages = [{"role": "user", "content": FORMAT.format(question=text)}]
                seeds = [1000 * index + s for s in range(max(KS))]
                question = ask(engine, variants, messages, str(expected), params, sampling, seeds)
                questions.append(question)
                line = vote([v.text for v in question.swarm]).summary()
                print(f"{index + 1}/{len(tasks)} {text} ({expected}) -> {line}", file=sys.stderr)
        wall = time.perf_counter() - started
    single = [
        round(statistics.fmean(normalize_answer(q.swarm[i].text) == q.answer for q in questions), 3)
        for i in range(len(variants))
    ]
    per_token = [
        round(sum(q.swarm[i].ms for q in questions) / max(1, sum(q.swarm[i].generated for q in questions)), 2)
        for i in range(len(variants))
    ]
    per_k = [
        {"k": k, "swarm": summarize(questions, "swarm", k), "sampled": summarize(questions, "sampled", k)}
        for k in KS
        if k <= len(variants)
    ]
    for which in ("swarm", "sampled"):
        one = per_k[0][which]["cpu_s_per_question"]
        for row in per_k:
            row[which]["cpu_cost_vs_k1"] = round(row[which]["cpu_s_per_question"] / one, 2)
    return {
        "model": model.name,
        "questions": len(tasks),
        "variants": [v.label.split(" (")[0] for v in variants],
        "variant_accuracy": single,
        "base_greedy_accuracy": single[-1],
        "variant_ms_per_generated_token": per_token,
        "magnitude": args.magnitude,
        "max_tokens": args.max_tokens,
        "sample_temperature": args.temperature,
        "threads": args.threads,
        "per_k": per_k,
        "wall_s": round(wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--questions", type=int, default=len(TASKS), help="use the first N tasks")
    parser.add_argument("--variants", type=int, default=max(KS), help="voters, the base included")
    parser.add_argument("--magnitude", type=float, default=0.02, help="scale of the random LoRAs' B")
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--temperature", type=float, default=0.7, help="for the sampled reference")
    parser.add_argument(
        "--threads", type=int, default=1, help="llama.cpp threads (1: robust to other work on the machine)"
    )
    args = parser.parse_args(argv)
    report = run(args)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(f"variant accuracy: {report['variant_accuracy']} (base last)")
        for row in report["per_k"]:
            for which in ("swarm", "sampled"):
                print(f"K={row['k']} {which:8} {row[which]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
