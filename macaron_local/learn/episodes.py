"""Episodes: what the learner trains on, read from the experience store.

One episode per rated reply: the prompt the model answered (as the chat now shows and feeds it)
and what the user said about the reply. A correction is the strongest signal (chosen = the
edit, rejected = the original), a rating is a one-sided label (KTO-style: +1 chosen, -1
rejected), a regenerate is a weak negative. All feedback on one reply folds into one episode,
so a reply rated and then corrected is not learned from twice with conflicting labels.

Ratings of sibling replies pair up: when the user liked one answer to a question and disliked
(or regenerated) another answer to the same question in the same conversation, the disliked
one's episode takes the liked one as its chosen reply. A one-sided rating only says "more like
this" or "not this"; a pair says which way to move, as a correction does, so a user who only
rates and regenerates still teaches a direction. Pairs stay inside one conversation, so the
gate's held-out conversations never lend a reply to a trained one.

Sibling dislikes with no liked sibling join into one episode: a user who turned down three
answers to one question taught one thing ("none of these"), and samples are pushed away from
the nearest of them. Apart, each was an episode of its own, trained in turn: a night of
dislikes alone cost three times the steps for the same signal (the quicktake ratings night, 36
episodes, 108 steps and over 900 s).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from macaron_local.store import Conversation, Feedback, FeedbackItem, Store

DEFAULT_SLOT = "L0"
#: A regenerate only says "not this one" and may just be a wish for variety: half a -1 rating.
REGENERATE_WEIGHT = 0.5


@dataclass
class Episode:
    """A prompt and the user's verdict on the reply the `slot` expert gave to it.

    `messages` are the chat messages up to the one the reply answered (usually the user's
    turn), system prompt first; `chosen`/`rejected` are replies to it, either may be None (not
    both). `feedback_ids` lists every feedback row folded in, so a learning run can record them
    and `forget` can find the run later. A `content_only` episode (an anchor, learn/anchors.py)
    is judged on what its chosen reply says, not how: no sample is rewarded for imitating its
    form, and it is never imitated token for token (no SFT row). `corrected`: the chosen reply
    is the user's own text (a correction), not a reply the model sampled (an up-vote, the liked
    side of a pair): only those measure what a candidate learned beyond its own habits
    (learn/validation.py). `also_rejected`: the disliked siblings joined into this episode
    (`join_dislikes`); the reward pushes a sample away from the nearest of them.
    """

    messages: list[dict[str, str]]
    chosen: str | None
    rejected: str | None
    slot: str = DEFAULT_SLOT
    feedback_ids: list[int] = field(default_factory=list)
    weight: float = 1.0
    conversation_id: str = ""
    message_id: str = ""
    content_only: bool = False
    corrected: bool = False
    also_rejected: tuple[str, ...] = ()  # sibling replies to the same question also turned down

    @property
    def has_verdict(self) -> bool:
        """Whether the episode can be trained on at all: it carries a chosen or a rejected reply
        (a rating without either, or an empty correction, teaches nothing)."""
        return bool(self.chosen or self.rejected)

    @property
    def imitated(self) -> bool:
        """Whether training imitates the chosen reply token for token (its SFT row): a chosen
        reply that is not an anchor's (the loop's group member, learn/imitation.py's rows)."""
        return bool(self.chosen) and not self.content_only

    @property
    def all_rejected(self) -> tuple[str, ...]:
        """Every reply the user turned down for this prompt: `rejected`, then `also_rejected`."""
        return ((self.rejected,) if self.rejected is not None else ()) + self.also_rejected


def episodes_from_store(store: Store, since_id: int = 0) -> list[Episode]:
    """Episodes for every reply with feedback newer than `since_id`, oldest new feedback first.

    A reply with new feedback is rebuilt from *all* its feedback, old rows included: the latest
    correction wins even when it was learned from before, and a new rating does not undo it.
    """
    items = store.feedback_rows(since_id)
    conversations: dict[str, Conversation] = {}
    by_reply: dict[str, FeedbackItem] = {}  # reply id -> its first new row (it carries the path)
    for item in items:
        by_reply.setdefault(item.feedback.message_id, item)
    episodes = []
    for item in by_reply.values():
        cid = item.feedback.conversation_id
        if cid not in conversations:
            conversations[cid] = store.get_conversation(cid)
        episodes.append(_episode(item, conversations[cid]))
    return join_dislikes(pair_siblings(episodes))


def _one_sided_siblings(episodes: list[Episode]) -> list[list[int]]:
    """Indexes of one-sided episodes (a rating or a regenerate) grouped by conversation, expert
    and prompt: replies to the same question, in order."""
    siblings: dict[tuple, list[int]] = {}
    for index, episode in enumerate(episodes):
        if (episode.chosen is None) != (episode.rejected is None):
            key = (episode.conversation_id, episode.slot, repr(episode.messages))
            siblings.setdefault(key, []).append(index)
    return list(siblings.values())


def pair_siblings(episodes: list[Episode]) -> list[Episode]:
    """Join one-sided verdicts on sibling replies (same conversation, same question) into pairs:
    each disliked reply gets the latest liked sibling as its chosen reply, and that liked
    episode's feedback is folded in (it is learned as part of the pair, not again alone)."""
    absorbed: set[int] = set()
    paired: dict[int, Episode] = {}
    for members in _one_sided_siblings(episodes):
        liked = [i for i in members if episodes[i].chosen is not None]
        disliked = [i for i in members if episodes[i].rejected is not None]
        if not liked or not disliked:
            continue
        best = episodes[liked[-1]]  # the latest liked reply is what the user settled on
        for i in disliked:
            episode = episodes[i]
            ids = sorted({*episode.feedback_ids, *best.feedback_ids})
            paired[i] = replace(episode, chosen=best.chosen, feedback_ids=ids, weight=1.0)
        absorbed.add(liked[-1])
    return [paired.get(i, e) for i, e in enumerate(episodes) if i not in absorbed]


def join_dislikes(episodes: list[Episode]) -> list[Episode]:
    """Fold disliked sibling replies that have no liked sibling (after `pair_siblings`, any
    one-sided siblings left with a rejected reply) into the first one's episode: its `rejected`
    stays, the others become `also_rejected`, their feedback is folded in, and its weight is the
    strongest of theirs (a -1 rating outweighs a regenerate)."""
    joined: dict[int, Episode] = {}
    absorbed: set[int] = set()
    for members in _one_sided_siblings(episodes):
        disliked = [i for i in members if episodes[i].rejected is not None]
        if len(disliked) < 2:
            continue
        first, rest = episodes[disliked[0]], [episodes[i] for i in disliked[1:]]
        joined[disliked[0]] = replace(
            first,
            also_rejected=tuple(e.rejected for e in rest if e.rejected is not None),
            feedback_ids=sorted({i for e in (first, *rest) for i in e.feedback_ids}),
            weight=max(e.weight for e in (first, *rest)),
        )
        absorbed.update(disliked[1:])
    return [joined.get(i, e) for i, e in enumerate(episodes) if i not in absorbed]


def _episode(item: FeedbackItem, conversation: Conversation) -> Episode:
    reply = item.path[-1]
    rows = [f for f in conversation.feedback if f.message_id == reply.id]  # oldest first
    chosen, rejected, weight, typed = _verdict(rows, reply.content)
    corrected = latest_corrections(conversation.feedback)
    messages = [{"role": m.role, "content": corrected.get(m.id, m.content)} for m in item.path[:-1]]
    if item.system_prompt:
        messages.insert(0, {"role": "system", "content": item.system_prompt})
    experts = {t.message_id: t.expert for t in conversation.turns}
    return Episode(
        messages=messages,
        chosen=chosen,
        rejected=rejected,
        slot=experts.get(reply.id) or DEFAULT_SLOT,
        feedback_ids=[f.id for f in rows],
        weight=weight,
        conversation_id=conversation.id,
        message_id=reply.id,
        corrected=typed,
    )


def _verdict(rows: list[Feedback], reply: str) -> tuple[str | None, str | None, float, bool]:
    """(chosen, rejected, weight, corrected) from one reply's feedback: the latest correction,
    else the latest rating, else a regenerate. `corrected`: chosen is the user's own text."""
    corrections = [f.text for f in rows if f.kind == "correction" and f.text]
    if corrections:
        if corrections[-1] == reply:  # saved unchanged: an endorsement, not a pair
            return reply, None, 1.0, False
        return corrections[-1], reply, 1.0, True
    ratings = [f.value for f in rows if f.kind == "rating"]
    if ratings:
        return (reply, None, 1.0, False) if ratings[-1] > 0 else (None, reply, 1.0, False)
    return None, reply, REGENERATE_WEIGHT, False


def latest_corrections(feedback: Iterable[Feedback]) -> dict[str, str]:
    """message id -> its latest corrected text: the overlay the chat applies before it shows a
    conversation or feeds it to the model (the session uses this), so prompts match."""
    return {f.message_id: f.text for f in feedback if f.kind == "correction" and f.text}
