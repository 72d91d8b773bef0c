"""Render a conversation with the model's own chat template (from its GGUF), and fit it to the context.

The trainer must score exactly the token sequence the engine generates from, so there is one
renderer: the Jinja template stored in the GGUF (`tokenizer.chat_template`), executed in a
sandbox the way Hugging Face tokenizers do. Models without a template fall back to ChatML.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from macaron_local.errors import InvalidInputError, MacaronError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Message = dict[str, str]


class ContextOverflowError(MacaronError):
    """Even with every earlier turn dropped, the prompt does not fit the model's context."""


def _raise(message: str) -> None:
    raise TemplateError(message)


@dataclass
class ChatTemplate:
    """A compiled chat template plus the special-token strings it may reference."""

    source: str
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self._compiled = env.from_string(self.source)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True, **variables: object) -> str:
        """The prompt text for `messages`; with `add_generation_prompt` it ends where the reply starts.

        `variables` reach the template as they do through Hugging Face's `apply_chat_template`
        (e.g. `enable_thinking=False` for Qwen3-family templates; others ignore it)."""
        try:
            return self._compiled.render(
                **variables,
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            raise InvalidInputError(f"the chat template rejected the conversation: {exc}") from None


def continue_final_message(text: str, final_content: str) -> str:
    """Cut a rendering right after the last message's content, so the model continues that
    message instead of starting a new one (what `continue_final_message` does in Hugging Face
    tokenizers and vLLM): the template's end-of-turn markup after it is dropped."""
    index = text.rfind(final_content)
    if not final_content or index < 0:
        raise InvalidInputError("the chat template did not render the message to continue")
    return text[: index + len(final_content)]


def fit_messages(
    messages: Sequence[Message],
    count_tokens: Callable[[Sequence[Message]], int],
    budget: int,
) -> tuple[list[Message], int]:
    """Drop the oldest turns until the rendered prompt fits `budget` tokens.

    System messages are never dropped, and neither is the last message (the one being
    answered). Returns the kept messages and how many were dropped; raises
    ContextOverflowError when even the shortest form does not fit.
    """
    messages = list(messages)
    if count_tokens(messages) <= budget:
        return messages, 0
    system = [m for m in messages[:-1] if m.get("role") == "system"]
    history = [m for m in messages[:-1] if m.get("role") != "system"]
    last = messages[-1]
    # Binary search for the fewest dropped history messages that fit.
    lo, hi = 1, len(history)
    if count_tokens([*system, last]) > budget:
        raise ContextOverflowError(
            f"the message is too long for the model's context ({budget} tokens available); "
            "shorten it or raise n_ctx in the settings"
        )
    while lo < hi:
        mid = (lo + hi) // 2
        if count_tokens([*system, *history[mid:], last]) <= budget:
            hi = mid
        else:
            lo = mid + 1
    # Start the kept history on a user turn so the model never sees a dangling reply.
    while lo < len(history) and history[lo].get("role") != "user":
        lo += 1
    return [*system, *history[lo:], last], lo
