"""Swarm voting: one greedy answer from each of K adapter variants, majority-voted.

Many LoRA variants of one base (the experts, every personal version the nightly learner kept,
plugins) disagree in different places; a majority over their *final answers* is more reliable
than any one of them, and cheaper to trust than one model sampled K times, because each voter
is deterministic (temperature 0) and the answers differ by what the variants learned, not by
sampling noise.

Three parts, each usable alone:
- `normalize_answer` turns a reply into the thing that is voted on (a boxed answer, else the
  last number, in digits or words, else the normalized text), so "The answer is 1,000." and
  "\\boxed{1000}" agree, and so do "A dog has four legs." and "4";
- `vote` counts normalized answers with a documented, deterministic tie-break;
- `gather_variants` lists the adapter sets available for a model, and `run_swarm` has each of
  the first K answer through one engine.

Decisions the issue left open:
- Tie-break: among the answers with the most votes, the winner is the one given by the
  *earliest* variant in the list. Variants are listed strongest-first (below), so a tie goes to
  the side of the variant we trust most, and the same inputs always give the same winner.
- An empty reply normalizes to "" and counts as an answer like any other, so the split always
  sums to K and a swarm that mostly says nothing shows it.
- Which variants, in order: the experts alone (slot order); then registry versions for this
  base model that are not `rejected` (the deployed ones first, in slot order, then the rest
  newest first), each stacked on its slot's expert as a normal turn would serve it; then
  plugins (imported versions, tagged `plugin:<name>`; each alone on the base, which is what a
  PEFT plugin was trained against), by name; and last the base model alone, which is always
  available, so K=1 always works. Rejected
  versions are left out because the learner judged them worse than what they would have
  replaced, or their GGUF failed parity (the file is not what was trained): a voter known to be
  worse than its sibling only adds noise. Candidates (never judged, e.g. imported or plugin
  versions) and retired ones (passed the gate once) vote. Two variants with the same adapter
  files are one voter: identical greedy answers would be counted twice.
- Fewer variants than K is an error (exit 2) that names how many there are: silently voting
  with fewer voters would show a split that is not what was asked for.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path

from macaron_local.catalog import SLOTS, Catalog, Manifest
from macaron_local.engine import Completion, Engine, GenerationParams
from macaron_local.engine.template import Message
from macaron_local.errors import InvalidInputError, ModelError
from macaron_local.hashing import sha256_file
from macaron_local.store import AdapterVersion, Store

# A number not glued to a word ("H2O", "mp3") or to a previous decimal point. Thousands
# separators only in groups of three, so "1, 2, 3" is three numbers and "1,000" is one.
_NUMBER = re.compile(r"(?<![\w.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])[-+]?\.\d+")
# English number words up to ninety-nine: "A dog has four legs" and "4" are the same answer.
_UNITS = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"
_ONES = [*_UNITS.split(), "seventeen", "eighteen", "nineteen"]
_DECADES = "twenty thirty forty fifty sixty seventy eighty ninety"
_TENS = {word: 10 * i for i, word in enumerate(_DECADES.split(), start=2)}
_NUMBER_WORD = re.compile(
    rf"\b(?:({'|'.join(_TENS)})(?:[- ]({'|'.join(_ONES[1:10])}))?|({'|'.join(_ONES)}))\b", re.IGNORECASE
)
_BOXED = "\\boxed{"
_FRAC = re.compile(r"\\[dt]?frac\{\s*([-+]?\d+)\s*\}\{\s*(\d+)\s*\}")
_WHOLE_FRACTION = re.compile(r"\s*([-+]?\d+)\s*/\s*(\d+)\s*")


# --------------------------------------------------------------------- normalization
def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced; an unclosed one runs to the end)."""
    start = text.rfind(_BOXED)
    if start < 0:
        return None
    depth, i = 1, start + len(_BOXED)
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return text[i:]


def normalize_number(token: str) -> str:
    """'1,000.50' -> '1000.5', '+7' -> '7', '42.0' -> '42', '-0' -> '0', '007' -> '7'."""
    try:
        value = Decimal(token.replace(",", "").lstrip("+"))
    except InvalidOperation:
        return token
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def normalize_fraction(numerator: int, denominator: int) -> str:
    """A boxed fraction, reduced: '2/4' -> '1/2', '4/2' -> '2' (so it agrees with a plain 2)."""
    value = Fraction(numerator, denominator)
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def normalize_text(text: str) -> str:
    """Case-folded, with punctuation and runs of whitespace collapsed to single spaces."""
    return re.sub(r"[\W_]+", " ", text.casefold()).strip()


def normalize_answer(text: str) -> str:
    """What a reply votes for: the last `\\boxed{}` answer if any (a reduced fraction if it is
    one, its last number if it holds one), else the last number in the text (digits or an
    English number word), else the normalized text."""
    text = text.replace("\u2212", "-")  # a typographic minus is still a minus
    boxed = last_boxed(text)
    if boxed is not None:
        text = _FRAC.sub(r"\1/\2", boxed)
        fraction = _WHOLE_FRACTION.fullmatch(text)
        if fraction and int(fraction[2]) != 0:
            return normalize_fraction(int(fraction[1]), int(fraction[2]))
    last = last_number(text)
    return last if last is not None else normalize_text(text)


def last_number(text: str) -> str | None:
    """The last number in `text`, normalized, written in digits or as an English word up to
    ninety-nine ("A dog has four legs" and "4" agree)."""
    found: list[tuple[int, str]] = [(m.end(), normalize_number(m[0])) for m in _NUMBER.finditer(text)]
    for m in _NUMBER_WORD.finditer(text):
        tens, unit, ones = (g.lower() if g else g for g in m.groups())
        value = _TENS[tens] + (_ONES.index(unit) if unit else 0) if tens else _ONES.index(ones)
        found.append((m.end(), str(value)))
    return max(found)[1] if found else None


# --------------------------------------------------------------------- voting
@dataclass(frozen=True)
class VoteResult:
    """The outcome of one vote. `answers[i]` is variant i's normalized answer; `split` maps each
    answer to its votes, most votes first (ties in order of first appearance)."""

    winner: str
    split: dict[str, int]
    answers: list[str]

    @property
    def k(self) -> int:
        return len(self.answers)

    @property
    def winner_index(self) -> int:
        """The earliest variant that gave the winning answer (whose reply is shown)."""
        return self.answers.index(self.winner)

    @property
    def agreement(self) -> float:
        """The winner's share of the votes."""
        return self.split[self.winner] / self.k

    def summary(self, width: int = 40) -> str:
        """`vote: 7 of 9 for "42" (2 for "41")`."""
        others = [f'{n} for "{_clip(a, width)}"' for a, n in self.split.items() if a != self.winner]
        line = f'vote: {self.split[self.winner]} of {self.k} for "{_clip(self.winner, width)}"'
        return f"{line} ({', '.join(others)})" if others else line


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def vote(answers: Sequence[str]) -> VoteResult:
    """Majority vote over raw replies, in variant order. Ties go to the answer given by the
    earliest variant among the tied ones."""
    if not answers:
        raise InvalidInputError("a vote needs at least one answer")
    normalized = [normalize_answer(a) for a in answers]
    counts = Counter(normalized)
    first = {a: i for i, a in reversed(list(enumerate(normalized)))}
    ranked = sorted(counts, key=lambda a: (-counts[a], first[a]))
    return VoteResult(winner=ranked[0], split={a: counts[a] for a in ranked}, answers=normalized)


# --------------------------------------------------------------------- variants
@dataclass(frozen=True)
class Variant:
    """One voter: a label, the adapter files stacked for it (empty: the base alone), and the
    expert slot whose turn it serves (None for the base and plugins)."""

    label: str
    paths: tuple[Path, ...] = ()
    slot: str | None = None
    identity: tuple[str, ...] = field(default=(), compare=False)  # sha256 of each file, sorted


def gather_variants(store: Store, catalog: Catalog, manifest: Manifest, enough: int | None = None) -> list[Variant]:
    """Every distinct adapter set that can vote for `manifest`, strongest first (module doc).

    With `enough`, stops once that many are found: the registry may hold a million versions,
    and it is read newest first one page at a time, so a vote of K reads about K rows."""
    experts: dict[str, Path] = {}
    for slot in SLOTS:
        path = catalog.expert_path(manifest, slot)
        if path is not None:
            if not path.is_file():
                raise ModelError(f"expert {slot} adapter {path} is missing; run `macaron models pull {manifest.name}`")
            experts[slot] = path
    digests = {slot: sha256_file(path) for slot, path in experts.items()}
    distinct: list[Variant] = []
    seen: set[tuple[str, ...]] = set()

    def add(variant: Variant) -> None:
        if variant.identity not in seen:
            seen.add(variant.identity)
            distinct.append(variant)

    def full() -> bool:
        return enough is not None and len(distinct) >= enough

    for slot, path in experts.items():
        add(Variant(f"expert {slot} {manifest.experts[slot].name}", (path,), slot, (digests[slot],)))

    def personal(version: AdapterVersion) -> Variant:
        under = experts.get(version.slot)
        paths = (under, Path(version.path)) if under else (Path(version.path),)
        identity = tuple(sorted([digests[version.slot], version.sha256] if under else [version.sha256]))
        return Variant(f"{version.slot} personal {version.id} ({version.status})", paths, version.slot, identity)

    plugin_names = {p.version_id: p.name for p in store.plugins() if p.base_model == manifest.name}
    deployed = [v for slot in SLOTS if (v := store.deployed_adapter(slot, manifest.name)) is not None]
    for version in deployed:
        if version.id not in plugin_names:
            add(personal(version))
    skip = {v.id for v in deployed} | set(plugin_names)
    cursor: str | None = None
    while not full():  # the rest, newest first, a page at a time
        page = store.find_adapters(base_model=manifest.name, before=cursor)
        if not page:
            break
        cursor = page[-1].id
        for version in page:
            if version.id not in skip and version.status != "rejected" and not full():
                add(personal(version))
    plugins = sorted(plugin_names.items(), key=lambda item: (item[1], item[0]))
    for version_id, name in plugins:
        if full():
            break
        version = store.adapter_version(version_id)
        if version.status != "rejected":
            add(Variant(f"plugin {name}", (Path(version.path),), None, (version.sha256,)))
    if not full():
        add(Variant("base", (), None, ()))
    return distinct[:enough] if enough is not None else distinct


def choose(variants: Sequence[Variant], k: int) -> list[Variant]:
    """The first `k` variants; an error that says how many exist when there are fewer."""
    if k < 1:
        raise InvalidInputError(f"a vote needs K >= 1 variants (got {k})")
    if len(variants) < k:
        names = ", ".join(v.label for v in variants[:5]) + (", …" if len(variants) > 5 else "")
        raise InvalidInputError(
            f"only {len(variants)} adapter variant(s) can vote ({names}); ask for K = {len(variants)} or fewer"
        )
    return list(variants[:k])


# --------------------------------------------------------------------- running a vote
@dataclass(frozen=True)
class VariantAnswer:
    """One variant's reply and what it voted for."""

    variant: Variant
    text: str
    answer: str
    completion: Completion = field(compare=False, repr=False)
    ms: float = 0.0  # this voter's wall time, adapter switch included


@dataclass(frozen=True)
class SwarmResult:
    """Every variant's answer and the vote over them."""

    answers: list[VariantAnswer]
    result: VoteResult
    wall_ms: float
    message_id: str | None = None  # the stored reply, when a session recorded the vote

    @property
    def winning(self) -> VariantAnswer:
        """The reply of the earliest variant that gave the winning answer."""
        return self.answers[self.result.winner_index]


def greedy(params: GenerationParams | None) -> GenerationParams:
    """A copy of `params` at temperature 0: a voter's answer must not depend on a seed."""
    base = params or GenerationParams()
    return GenerationParams(
        max_tokens=base.max_tokens,
        temperature=0.0,
        top_k=base.top_k,
        top_p=base.top_p,
        min_p=base.min_p,
        repeat_penalty=base.repeat_penalty,
    )


def answer_with(engine: Engine, variant: Variant, prompt: Sequence[int], params: GenerationParams) -> Completion:
    """`variant`'s greedy completion of `prompt` (its adapters loaded once, then activated)."""
    engine.set_adapters([engine.load_adapter(path) for path in variant.paths])
    return engine.generate(prompt, params)


def run_swarm(
    engine: Engine,
    variants: Sequence[Variant],
    messages: Sequence[Message],
    params: GenerationParams | None = None,
) -> SwarmResult:
    """Have each variant answer `messages` greedily through `engine`, then vote.

    The prompt is rendered once. Each variant still prefills it under its own adapters: KV
    computed under one adapter set is not valid under another, and the engine's KV switch
    policy (a state saved per adapter set, or a reset) keeps it honest. What is reused is
    each set's own earlier prefix, e.g. the system prompt on the next question.
    """
    if not variants:
        raise InvalidInputError("a vote needs at least one variant")
    params = greedy(params)
    prompt, _ = engine.prompt_for(messages, params.max_tokens)
    started = time.perf_counter()
    replies = []
    for variant in variants:
        begun = time.perf_counter()
        done = answer_with(engine, variant, prompt, params)
        replies.append((variant, done, (time.perf_counter() - begun) * 1000))
    result = vote([done.text for _, done, _ in replies])
    answers = [
        VariantAnswer(variant, done.text, answer, done, ms)
        for (variant, done, ms), answer in zip(replies, result.answers, strict=True)
    ]
    return SwarmResult(answers, result, (time.perf_counter() - started) * 1000)
