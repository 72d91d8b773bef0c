"""The chat template comes from the GGUF; context overflow drops the oldest turns, never the system prompt."""

from __future__ import annotations

import pytest

from macaron_local.engine import ChatTemplate, ContextOverflowError, fit_messages
from macaron_local.engine.template import CHATML


def words(messages):
    return sum(len(m["content"].split()) + 2 for m in messages)


def convo(n_turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "be brief"}]
    for i in range(n_turns):
        messages += [
            {"role": "user", "content": f"question {i} " + "x " * 10},
            {"role": "assistant", "content": f"answer {i} " + "y " * 10},
        ]
    return [*messages, {"role": "user", "content": "last question"}]


def test_fits_unchanged_when_small():
    messages = convo(2)
    kept, dropped = fit_messages(messages, words, 10_000)
    assert kept == messages and dropped == 0


def test_drops_oldest_turns_keeps_system_and_last():
    messages = convo(10)
    kept, dropped = fit_messages(messages, words, 60)
    assert kept[0]["role"] == "system" and kept[-1]["content"] == "last question"
    assert words(kept) <= 60 and dropped > 0
    assert kept[1]["role"] == "user"  # never starts on a dangling reply
    assert kept[1:-1] == messages[1 + dropped : -1]  # a suffix of the history, in order


def test_overflow_error_when_even_the_last_message_does_not_fit():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "w " * 500}]
    with pytest.raises(ContextOverflowError, match="too long"):
        fit_messages(messages, words, 100)


def test_template_renders_generation_prompt_and_rejects_errors():
    template = ChatTemplate(CHATML)
    text = template.render([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n")
    strict = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(Exception, match="roles must alternate"):
        strict.render([{"role": "user", "content": "hi"}])
