"""Is a reply still language? How surprised the bare experts are by it, per character.

The gate's held-out reward cannot tell a lesson from noise on its own: half of it is distance
from the reply the user rejected, and that reply is the deployed model's own greedy answer, so
any change scores as progress. Twelve gibberish "corrections" taught the embedded model to
answer "q%zfjr@k q#gijnwc wcyvbxhghm ..." to every how-to question; the reward rose 0.34 and
the regression set (passages, factual questions) saw nothing, since the noise stayed on
questions like the corrected ones.

What separates noise from any lesson a user means is predictability. Random letters carry about
ln 26 = 3.3 nats a character whatever model reads them; language, in any style, is far more
predictable. Measured on the embedded 135M model with the chat's system prompt (nats per
non-space character): its own replies 0.2 to 0.3, a human-written answer 0.7 to 0.8, the same
in lower case or with a "TL;DR:" first line 0.7 to 0.8, pirate talk 1.2, French 2.1, leetspeak
3.6, the gibberish above 4.2. The held-out replies of eight scenarios' deployed candidates (a
prefix, a heading, a list, lower case, one sentence, a greeting by name) read 0.2 to 1.8, the
highest a short "Hi Sam, eat an extra bowl of pasta."; two gibberish nights' 4.1 to 4.3. Per
character rather than per token, so that text the tokenizer splits finely (another language,
symbols) is not charged for its tokenization.

Two places use it: the gate (a candidate may not have more noisy held-out replies than the
deployed version) and the night's data (`noisy_corrections`: a correction that is noise is
never trained on, since a short night on gibberish drifts the replies without yet writing
gibberish, and the reward counts that drift as progress).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from macaron_local.engine import Completion, Engine
from macaron_local.errors import MacaronError
from macaron_local.learn.episodes import Episode

#: Above this a reply reads as noise to the bare experts (random letters: about 3.3 and more).
NOISE_NATS_PER_CHAR = 3.0
#: Shorter replies (a name, a greeting and a clause) are not judged: a few surprising tokens
#: (a name the bare experts never heard) dominate them. Noise fills a whole 64-token reply.
MIN_JUDGED_CHARS = 40


def surprise(engine: Engine, prompt_tokens: Sequence[int], reply: Completion) -> float | None:
    """Nats per non-space character of `reply` under the engine's active adapters, given the
    prompt it answered; None for a reply too short to judge."""
    chars = len("".join(reply.text.split()))
    if chars < MIN_JUDGED_CHARS or not reply.tokens:
        return None
    return float(-engine.token_logprobs(prompt_tokens, reply.tokens).sum()) / chars


def noise_count(surprises: Sequence[float | None]) -> int:
    """How many judged replies read as noise."""
    return sum(1 for value in surprises if value is not None and value > NOISE_NATS_PER_CHAR)


def noisy_corrections(engine: Engine, stack: Callable[[str], list], episodes: Sequence[Episode]) -> list[Episode]:
    """The episodes whose chosen reply (a correction, or a liked reply) reads as noise to the
    bare experts (`stack`: slot -> their adapters), given the prompt it answers. Such text is
    not learned from: a night of gibberish corrections that stopped short of answering in
    gibberish still drifted the replies away from the rejected ones, which the gate's reward
    counts as progress (`tests/test_learn_poisoned.py` deployed one in stop 32)."""
    noisy = []
    for episode in episodes:
        if episode.chosen is None or episode.content_only:
            continue
        engine.set_adapters(stack(episode.slot))
        prompt = engine.render_tokens(episode.messages)
        reply = Completion(text=episode.chosen, tokens=engine.tokenize(episode.chosen, special=False))
        try:
            value = surprise(engine, prompt, reply)
        except MacaronError:  # longer than the context: not judged (noise is not what fills it)
            continue
        if value is not None and value > NOISE_NATS_PER_CHAR:
            noisy.append(episode)
    engine.set_adapters([])
    return noisy
