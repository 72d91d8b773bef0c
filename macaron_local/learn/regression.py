"""The regression set a preference should not touch, and how a candidate is scored on it.

(a) Passage NLL: mean negative log-likelihood per token of plain-text passages, scored without
the chat template, so it measures the language model itself rather than chat behaviour. (b)
Short factual questions whose greedy answers are judged case-insensitively by key terms. Both run
through the engine, on the quantized model and adapters the user would actually get.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import numpy as np

from macaron_local.engine import AdapterHandle, Engine, GenerationParams

ANSWER_TOKENS = 32


def load_regression_set() -> dict[str, Any]:
    return json.loads(resources.files("macaron_local.learn").joinpath("data/regression.json").read_text("utf-8"))


#: How much of a lost answer's reply a run records: enough to see what replaced the answer.
LOST_REPLY_CHARS = 80


@dataclass(frozen=True)
class Answer:
    """One factual question as served: the greedy reply and whether it holds a key term."""

    question: str
    reply: str
    right: bool


@dataclass(frozen=True)
class RegressionScore:
    passage_nll: float
    qa_right: int
    qa_total: int
    #: Each question's served answer, in the set's order (empty where a score was built by hand).
    answers: tuple[Answer, ...] = ()


def lost_answers(candidate: RegressionScore, reference: RegressionScore) -> list[dict[str, str]]:
    """The questions `reference` answered right and `candidate` did not, with the start of the
    candidate's reply: what a rejection for "factual answers dropped" lets a reader check
    (a lesson's fact or format poured into everyday answers, or an answer merely garbled)."""
    right_before = {a.question for a in reference.answers if a.right}
    return [
        {"question": a.question, "reply": a.reply.strip()[:LOST_REPLY_CHARS]}
        for a in candidate.answers
        if not a.right and a.question in right_before
    ]


def passage_nll(engine: Engine, passages: list[str]) -> float:
    """Token-weighted mean NLL; the first token of each passage (no context) is not scored."""
    total, count = 0.0, 0
    for passage in passages:
        tokens = engine.tokenize(passage, add_bos=True, special=False)
        logprobs = engine.token_logprobs(tokens[:1], tokens[1:])
        total += float(-np.sum(logprobs))
        count += len(logprobs)
    return total / max(count, 1)


def answer_is_right(answer: str, terms: list[str]) -> bool:
    lowered = answer.lower()
    return any(term.lower() in lowered for term in terms)


def score(
    engine: Engine,
    adapters: list[AdapterHandle] | Callable[[str], list[AdapterHandle]],
    system_prompt: str = "",
    params: GenerationParams | None = None,
) -> RegressionScore:
    """Score the engine under `adapters` (the adapter set is left active).

    Served the way the chat serves a turn: the question after the chat's system prompt, in the
    chat template, answered with the chat's sampling (`params`, greedy by default). `adapters`
    may be a function of the expert slot: each question then gets the stack of the expert the
    router sends it to, as a chat turn would (the passages, plain text, use L0's).
    """
    from macaron_local.router import route

    data = load_regression_set()
    stack = adapters if callable(adapters) else (lambda slot: adapters)
    params = replace(params or GenerationParams(), max_tokens=ANSWER_TOKENS)
    engine.set_adapters(stack("L0"))
    nll = passage_nll(engine, data["passages"])
    answers = []
    for item in data["questions"]:
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": item["question"]}
        ]
        engine.set_adapters(stack(route(item["question"]).slot))
        reply = engine.generate(engine.render_tokens(messages), params).text
        answers.append(Answer(item["question"], reply, answer_is_right(reply, item["answer_terms"])))
    return RegressionScore(nll, sum(a.right for a in answers), len(answers), tuple(answers))
