"""Rewards for sampled replies: how close a sample comes to what the user wanted.

A correction says what the user wanted, so a sample earns reward for resembling the correction
and loses it for resembling the reply the user rejected. Similarities are pure-Python string
measures (no model: a learned judge could be gamed by the policy it grades). Checkable rules of
a scenario ("answers in French", "no emoji") are regular expressions.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

CHRF_ORDER = 6
CHRF_BETA = 2.0
#: The share of an anchor's content words a sample must keep to count as unchanged.
CONTENT_ENOUGH = 0.75
#: A lesson word is in at least this share of tonight's corrections, and in at least
#: `LESSON_MIN_CORRECTIONS` of them: what the user keeps adding, not what one reply was about.
LESSON_SHARE = 0.5
LESSON_MIN_CORRECTIONS = 3
#: ... and a word in this many corrections is one, whatever share of the night they are. Three
#: lessons on one night (36 corrections, a dozen each) put no word in half of them, so the share
#: alone found none there: a bad knee, a doctor's name and a car, or an allergy and a sister's
#: name, each in 10 to 12 of them, and the choice never saw whether a fact was applied. Up to a
#: dozen corrections the share asks for six or fewer anyway, so such a night finds what it did.
LESSON_ENOUGH_CORRECTIONS = 6
#: An opening lesson mark (`lesson_opening`) is this character, then the opening: no lesson
#: word has it (words are \w+), and it reads as "starts with", as in a regular expression.
OPENING_MARK = "^"
#: The longest opening looked for; a format's marks are short ('{"answer": "' is 12).
OPENING_CHARS = 24
_OPENING = re.compile(r"[^\w\s]")
#: A correction at most this share of the rejected reply's words cut it: the user wants it shorter.
CUT_SHARE = 0.75
#: What giving back all of a cut costs a sample, on chrF's [-1, 1] scale (`length_given_back`).
LENGTH_WEIGHT = 0.5
#: Words that carry no content of their own; what is left of a sentence is what it says.
_STOP_WORDS = (
    "the and are was were for with that this from not but you your his her its our their they them "
    "has have had can will would could should may might also about into than then there these "
    "those which who what when where why how all any some such very just one"
)
STOP_WORDS = frozenset(_STOP_WORDS.split())
_REGEX_FLAGS = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL, "x": re.VERBOSE, "a": re.ASCII}


def _f_score(precision: float, recall: float, beta: float = 1.0) -> float:
    """F_beta = (1 + beta^2) P R / (beta^2 P + R); 0 when both are 0."""
    denominator = beta * beta * precision + recall
    return (1 + beta * beta) * precision * recall / denominator if denominator > 0 else 0.0


def token_f1(a: str, b: str) -> float:
    """Bag-of-words F1 between `a` and `b` (lowercased \\w+ tokens, repeats counted, as in SQuAD):
    overlap = |bag(a) & bag(b)|, P = overlap / |a|, R = overlap / |b|. Two empty texts: 1."""
    ta, tb = Counter(re.findall(r"\w+", a.lower())), Counter(re.findall(r"\w+", b.lower()))
    if not ta or not tb:
        return float(ta == tb)
    overlap = sum((ta & tb).values())
    return _f_score(overlap / sum(ta.values()), overlap / sum(tb.values()))


def chrf(hypothesis: str, reference: str, order: int = CHRF_ORDER, beta: float = CHRF_BETA) -> float:
    """chrF (Popović 2015), in [0, 1]: character n-gram F-score, n = 1..order, whitespace removed.

        P_n, R_n = matched n-grams / n-grams of the hypothesis, of the reference
        chrP, chrR = mean of P_n, R_n over the orders either text is long enough for
        chrF = (1 + beta^2) chrP chrR / (beta^2 chrP + chrR)

    beta = 2 weighs recall twice as much as precision: saying what the user wanted counts more
    than saying only that. Characters rather than words give partial credit for inflections
    and typos. Identical texts score 1; two empty texts score 1.
    """
    hyp, ref = "".join(hypothesis.split()), "".join(reference.split())
    if not hyp or not ref:
        return float(hyp == ref)
    precisions, recalls = [], []
    for n in range(1, order + 1):
        h = Counter(hyp[i : i + n] for i in range(len(hyp) - n + 1))
        r = Counter(ref[i : i + n] for i in range(len(ref) - n + 1))
        if not h and not r:
            break
        matched = sum((h & r).values())
        precisions.append(matched / sum(h.values()) if h else 0.0)
        recalls.append(matched / sum(r.values()) if r else 0.0)
    return _f_score(sum(precisions) / len(precisions), sum(recalls) / len(recalls), beta)


def first_sentence(text: str) -> str:
    """The text up to its first sentence end (. ! ? followed by a space or a line break)."""
    return re.split(r"(?<=[.!?])\s", text.strip(), maxsplit=1)[0]


def content_words(text: str) -> set[str]:
    """The words of `text` that say something: casefolded, three letters or more, no stop
    words, each cut to its first five letters so "capitals" matches "capital"."""
    words = re.findall(r"\w+", text.casefold())
    return {w[:5] for w in words if len(w) >= 3 and w not in STOP_WORDS}


def content_kept(sample: str, answer: str, question: str = "", enough: float = CONTENT_ENOUGH) -> float:
    """How much of what `answer`'s first sentence says `sample` still says, in [0, 1]: the share
    of its content words the sample contains, divided by `enough`, capped at 1. Words of the
    `question` do not count: restating the question says nothing. Counted, they let "Lyon is
    the capital of France." keep 2 of the 3 words of "The capital of France is Paris." (0.89),
    so the anchors hardly opposed the short, answer-first replies a night of terse corrections
    teaches, in which the embedded model names the wrong city (seen on lower case: a candidate
    answered "Lyon", "Hamlet", "Japan is a country in East Asia." and lost 3 factual answers).

    This judges an anchor (learn/anchors.py): a question the user never asked about, whose bare
    answer should survive the night's learning in substance, not in form. Only the answer's
    words count, so what a sample adds ("Hi Sam, ...", "TL;DR: ...") costs nothing; case is
    folded, so a lower-case style costs nothing; the first sentence alone is the reference, so a
    shorter answer costs nothing. The cap makes every sample that keeps enough of the content
    equal, so GRPO sees no preference among them; only a sample that lost it ("Lisbon is the
    capital of Portugal." asked about Italy) is pushed down.
    """
    wanted = content_words(first_sentence(answer)) - content_words(question)
    if not wanted:
        return 1.0
    kept = len(wanted & content_words(sample)) / len(wanted)
    return min(1.0, kept / enough)


def _lesson_support(corrections: int) -> float:
    """How many of a night's `corrections` must carry a mark for it to be a lesson: at least
    `LESSON_SHARE` of them or `LESSON_ENOUGH_CORRECTIONS`, and never under `LESSON_MIN_CORRECTIONS`
    (`lesson_words` and `lesson_opening` alike)."""
    return max(LESSON_MIN_CORRECTIONS, min(LESSON_SHARE * corrections, LESSON_ENOUGH_CORRECTIONS))


def lesson_words(corrections: Sequence[str], rejected: Sequence[str]) -> frozenset[str]:
    """The content words (`content_words`) the user keeps adding: in at least `LESSON_SHARE` of
    the `corrections` or in `LESSON_ENOUGH_CORRECTIONS` of them (and at least
    `LESSON_MIN_CORRECTIONS`), and in fewer than `LESSON_SHARE` of the `rejected` replies, so
    not what the model said anyway.

    A personal fact or a named prefix shows up as such words ("peanu", "aller"; "lena";
    "short" for "In short:"); a format, a case or a length shows up as none, and then nothing
    here counts. Cut at five letters, "allergy" and "allergic" are one word.
    """
    if len(corrections) < LESSON_MIN_CORRECTIONS:
        return frozenset()
    added = Counter(w for text in corrections for w in content_words(text))
    said = Counter(w for text in rejected for w in content_words(text))
    wanted = _lesson_support(len(corrections))
    return frozenset(w for w, n in added.items() if n >= wanted and said[w] < LESSON_SHARE * max(len(rejected), 1))


def lesson_opening(corrections: Sequence[str], rejected: Sequence[str]) -> frozenset[str]:
    """The ways tonight's corrections keep opening a reply, as lesson marks (`OPENING_MARK` and the
    opening: "^- [ ]", "^TL;DR:", '^{"answer": "'); none for most nights.

    A format or a label shows up as no lesson words: its marks are not words ("- [ ]"), or too
    short to count ("TL;DR"). Without them the gate read a checklist night as unchanged: on
    the night after a move to Oslo (stop 59) the average candidate began all 3 held-out replies
    with "- [ ]" and served the checklist on 8 of 8 unseen prompts, while the reward moved
    +0.40, -0.33 and +0.50 on them (the content and the length differ from the corrections), and
    it was rejected within noise.

    An opening is a start that at least as many corrections share as a lesson word needs
    (`_lesson_support`), as long as it stays theirs, cut back to whole words, with a mark in it
    that is not a letter, a digit or a space (so "Your " or "You are ", which a fact's
    corrections may share, is not a format), and that fewer than `LESSON_SHARE` of the
    `rejected` replies began with already.
    Two formats taught on one night give two.
    """
    texts = [text.lstrip() for text in corrections]
    if len(texts) < LESSON_MIN_CORRECTIONS:
        return frozenset()
    wanted = _lesson_support(len(texts))
    counts = Counter(text[:length] for text in texts for length in range(1, min(len(text), OPENING_CHARS) + 1))
    # A start is whole when no longer start keeps every correction it opens: "- [ ] " (12 of 12),
    # not "- [" (the same 12) nor "- [ ] S" (2).
    whole = {
        start
        for start, count in counts.items()
        if count >= wanted
        and not any(
            counts[start + c] == count
            for c in {t[len(start)] for t in texts if t.startswith(start) and len(t) > len(start)}
        )
    }
    # The first whole start of each: "Hi Sam, " (12), not also "Hi Sam, you" (6) within it.
    first = {start for start in whole if not any(start.startswith(other) and other != start for other in whole)}
    marks = set()
    for start in first:
        opening = _whole_words(start, texts)
        began = sum(1 for text in rejected if text.lstrip().startswith(opening))
        if _OPENING.search(opening) and not (rejected and began >= LESSON_SHARE * len(rejected)):
            marks.add(OPENING_MARK + opening)
    return frozenset(marks)


def _whole_words(start: str, texts: Sequence[str]) -> str:
    """`start` without a word it cuts short in any correction it begins ("Step 1: Rin" -> "Step 1:"),
    and without the space that follows it."""
    cuts_a_word = any(t.startswith(start) and t[len(start) : len(start) + 1].isalnum() for t in texts)
    if start and start[-1].isalnum() and cuts_a_word:
        start = re.sub(r"\w+\Z", "", start)
    return start.rstrip()


def lesson_recall(sample: str, chosen: str | None, lesson: frozenset[str]) -> float:
    """The share of the lesson marks of `chosen` (the user's correction) that `sample` says too,
    in [0, 1]; 0 when the correction has none (nothing to apply, so nothing to tell apart).
    A mark is a lesson word (`lesson_words`) or an opening (`lesson_opening`), which a sample
    says by beginning with it.

    chrF spreads its credit over every character of a correction, so a fact's two words move
    it by a few hundredths, within the noise of three held-out replies: on an allergy night the
    step-42 candidate named the allergy in 7 of 8 unseen prompts and the final in 3, and their
    rewards were 0.27 and 0.19 on 3 episodes. This counts only the words that carry the lesson.
    """
    openings = {mark for mark in lesson if mark.startswith(OPENING_MARK)}
    words = lesson - openings
    wanted_words = words & content_words(chosen or "")
    wanted_openings = {mark for mark in openings if (chosen or "").lstrip().startswith(mark[len(OPENING_MARK) :])}
    wanted = len(wanted_words) + len(wanted_openings)
    if not wanted:
        return 0.0
    said = len(wanted_words & content_words(sample))
    said += sum(1 for mark in wanted_openings if sample.lstrip().startswith(mark[len(OPENING_MARK) :]))
    return said / wanted


def word_count(text: str) -> int:
    """Words as a reader counts them: runs of non-space characters."""
    return len(text.split())


def length_given_back(sample: str, chosen: str | None, rejected: str | None) -> float:
    """How much of the user's cut `sample` gives back, in [0, 1]: 0 at or under the correction's
    word count, 1 at or over the rejected reply's. 0 when the correction did not cut the reply
    (more than `CUT_SHARE` of its words) or either side is missing.

    chrF weighs recall over precision (beta 2), so a sample that says the correction and twenty
    words more scores nearly as well as the correction itself: on a night of "twelve words at
    most" corrections the adapter learned shorter answers, not short ones (served 3 of 8 within
    twelve words, twice). How long the user made a reply is part of what they wanted.

    Measured as the share of the sample the user would cut again (1 - wanted / words), over the
    share they cut (1 - wanted / rejected words), so the first words past the correction's length
    cost the most: a limit is broken by the first word over it. Counted linearly in words, a
    10-word correction of a 40-word reply charged a 15-word sample a sixth of the cut, too little
    against chrF's spread between samples (stop 41: served replies of 13 to 19 words); this
    charges it 0.44.
    """
    if chosen is None or rejected is None:
        return 0.0
    wanted, cut_from, words = word_count(chosen), word_count(rejected), word_count(sample)
    if not cut_from or wanted > CUT_SHARE * cut_from:  # nothing to cut, or hardly cut
        return 0.0
    if words <= wanted:
        return 0.0
    return min(1.0, (1.0 - wanted / words) / (1.0 - wanted / cut_from))


def preference_reward(
    sample: str, chosen: str | None, rejected: str | None, also_rejected: Sequence[str] = ()
) -> float:
    """chrF(sample, chosen) - chrF(sample, rejected) - `LENGTH_WEIGHT` x `length_given_back`, in
    [-1 - LENGTH_WEIGHT, 1]: closer to the correction than to the reply it replaced, and no
    longer than the user cut it.

    With only one side (a rating), only that side counts: chrF to a liked reply, or minus chrF
    to a disliked one. The offset this leaves does not matter: GRPO compares samples of one
    prompt with each other (`group_advantages`). With several disliked replies (`also_rejected`,
    siblings the user also turned down), the nearest counts: a sample that moved away from one
    by becoming another is no better.
    """
    if chosen is None and rejected is None:
        raise ValueError("a preference reward needs a chosen or a rejected reply")
    toward = chrf(sample, chosen) if chosen is not None else 0.0
    turned_down = [r for r in (rejected, *also_rejected) if r is not None]
    away = max((chrf(sample, r) for r in turned_down), default=0.0)
    return toward - away - LENGTH_WEIGHT * length_given_back(sample, chosen, rejected)


def regex_reward(sample: str, pattern: str, flags: str = "") -> float:
    """1.0 when `pattern` matches anywhere in `sample` (re.search), else 0.0.

    `flags` are letters, as in `(?ims)`: i ignore case, m multiline, s dot matches newline,
    x verbose, a ASCII.
    """
    value = 0
    for letter in flags:
        if letter not in _REGEX_FLAGS:
            raise ValueError(f"unknown regex flag {letter!r}; use some of {''.join(_REGEX_FLAGS)}")
        value |= _REGEX_FLAGS[letter]
    return 1.0 if re.search(pattern, sample, value) else 0.0
