"""Episodes from a real store: each kind of feedback, merging on one reply, corrected history,
branches, the expert slot, and `since_id`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from macaron_local.learn.episodes import Episode, episodes_from_store
from macaron_local.store import Store, open_store

SYSTEM = "You are helpful."


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    with open_store(tmp_path / "m.db") as opened:
        yield opened


def turn(expert: str | None) -> dict:
    return {"model": "embedded", "expert": expert}


def chat(store: Store, *exchanges: tuple[str, str], expert: str | None = "L2", system: str = SYSTEM) -> list[str]:
    """A conversation of (user, reply) exchanges; returns the reply ids."""
    cid = store.new_conversation("embedded", system)
    parent, replies = None, []
    for user, reply in exchanges:
        question = store.add_message(cid, "user", user, parent)
        parent, _ = store.add_reply(cid, question, reply, turn(expert))
        replies.append(parent)
    return replies


def only(episodes: list[Episode]) -> Episode:
    assert len(episodes) == 1, episodes
    return episodes[0]


def test_a_correction_gives_a_pair_with_the_prompt_and_the_expert(store: Store) -> None:
    (reply,) = chat(store, ("Reverse a list in python?", "Use reversed()."))
    fid = store.add_feedback(reply, "correction", text="Use xs[::-1] or reversed(xs).")
    episode = only(episodes_from_store(store))
    assert episode.messages == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Reverse a list in python?"},
    ]
    assert (episode.chosen, episode.rejected) == ("Use xs[::-1] or reversed(xs).", "Use reversed().")
    assert (episode.slot, episode.feedback_ids, episode.weight) == ("L2", [fid], 1.0)
    assert episode.message_id == reply


@pytest.mark.parametrize(
    ("kind", "value", "chosen", "rejected", "weight"),
    [
        ("rating", 1, "Paris.", None, 1.0),
        ("rating", -1, None, "Paris.", 1.0),
        ("regenerate", None, None, "Paris.", 0.5),
    ],
)
def test_ratings_and_regenerates_are_one_sided(
    store: Store, kind: str, value: int | None, chosen: str | None, rejected: str | None, weight: float
) -> None:
    (reply,) = chat(store, ("Capital of France?", "Paris."), expert=None)
    store.add_feedback(reply, kind, value=value)
    episode = only(episodes_from_store(store))
    assert (episode.chosen, episode.rejected, episode.weight) == (chosen, rejected, weight)
    assert episode.slot == "L0"  # no expert recorded: the default


def test_feedback_on_one_reply_merges_and_the_latest_correction_wins(store: Store) -> None:
    original = "Hello there, how may I assist you today?"
    (reply,) = chat(store, ("Hi", original))
    ids = [
        store.add_feedback(reply, "rating", value=-1),
        store.add_feedback(reply, "correction", text="Hi!"),
        store.add_feedback(reply, "rating", value=1),
        store.add_feedback(reply, "correction", text="Hey!"),
    ]
    episode = only(episodes_from_store(store))
    assert (episode.chosen, episode.rejected, episode.weight) == ("Hey!", original, 1.0)
    assert episode.feedback_ids == ids


def test_the_latest_rating_wins_over_an_earlier_one_and_over_a_regenerate(store: Store) -> None:
    (reply,) = chat(store, ("Joke?", "Why did the chicken..."))
    store.add_feedback(reply, "regenerate")
    store.add_feedback(reply, "rating", value=1)
    store.add_feedback(reply, "rating", value=-1)
    episode = only(episodes_from_store(store))
    assert (episode.chosen, episode.rejected, episode.weight) == (None, "Why did the chicken...", 1.0)


def test_earlier_corrections_appear_in_the_prompt_as_the_corrected_text(store: Store) -> None:
    first, second = chat(store, ("My name is Ada.", "Nice to meet you, Bob."), ("What is my name?", "Bob."))
    store.add_feedback(first, "correction", text="Nice to meet you, Ada.")
    store.add_feedback(first, "correction", text="Nice to meet you, Ada!")  # the latest is what the chat shows
    store.add_feedback(second, "correction", text="Ada.")
    episodes = episodes_from_store(store)
    assert [e.message_id for e in episodes] == [first, second]
    assert episodes[1].messages == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Nice to meet you, Ada!"},
        {"role": "user", "content": "What is my name?"},
    ]
    assert (episodes[1].chosen, episodes[1].rejected) == ("Ada.", "Bob.")


def test_a_regenerated_reply_and_its_sibling_are_separate_episodes_on_their_own_branch(store: Store) -> None:
    (old,) = chat(store, ("Name a colour.", "Blue."), expert="L0")
    cid = store.get_message(old).conversation_id
    question = store.get_message(old).parent_id
    store.add_feedback(old, "regenerate")
    new, _ = store.add_reply(cid, question, "Green.", turn("L1"))
    store.add_feedback(new, "rating", value=1)
    first, second = episodes_from_store(store)
    assert (first.rejected, first.slot, first.weight) == ("Blue.", "L0", 0.5)
    assert (second.chosen, second.slot) == ("Green.", "L1")
    assert first.messages == second.messages  # the same prompt: siblings answer the same question


def test_no_system_prompt_means_no_system_message(store: Store) -> None:
    (reply,) = chat(store, ("Hi", "Hello."), system="")
    store.add_feedback(reply, "rating", value=1)
    assert only(episodes_from_store(store)).messages == [{"role": "user", "content": "Hi"}]


def test_a_correction_saved_unchanged_is_an_endorsement(store: Store) -> None:
    (reply,) = chat(store, ("Hi", "Hello."))
    store.add_feedback(reply, "correction", text="Hello.")
    episode = only(episodes_from_store(store))
    assert (episode.chosen, episode.rejected) == ("Hello.", None)


def test_since_id_selects_replies_with_new_feedback_and_folds_in_their_old_rows(store: Store) -> None:
    a, b = chat(store, ("One?", "1"), ("Two?", "3"))
    (c,) = chat(store, ("Three?", "3"), expert="L1")
    fa = store.add_feedback(a, "rating", value=1)
    fb = store.add_feedback(b, "correction", text="2")
    cursor = max(fa, fb)
    assert episodes_from_store(store, since_id=cursor) == []
    fb2 = store.add_feedback(b, "rating", value=-1)
    fc = store.add_feedback(c, "rating", value=1)
    episodes = episodes_from_store(store, since_id=cursor)
    assert [e.message_id for e in episodes] == [b, c]
    assert (episodes[0].chosen, episodes[0].rejected, episodes[0].feedback_ids) == ("2", "3", [fb, fb2])
    assert (episodes[1].feedback_ids, episodes[1].slot) == ([fc], "L1")


def test_an_empty_store_has_no_episodes(store: Store) -> None:
    chat(store, ("Hi", "Hello."))
    assert episodes_from_store(store) == []


def answers(store: Store, question: str, *replies: str) -> list[int]:
    """One question in one conversation, answered by each of `replies` in turn (regenerations)."""
    (first,) = chat(store, (question, replies[0]), expert="L0")
    cid, parent = store.get_message(first).conversation_id, store.get_message(first).parent_id
    return [first, *(store.add_reply(cid, parent, reply, turn("L0"))[0] for reply in replies[1:])]


def test_a_disliked_reply_and_a_liked_sibling_make_one_pair(store: Store) -> None:
    old, new = answers(store, "Name a colour.", "Blue, the colour of the sky and the sea.", "Green.")
    down = store.add_feedback(old, "rating", value=-1)
    regen = store.add_feedback(old, "regenerate")
    up = store.add_feedback(new, "rating", value=1)
    pair = only(episodes_from_store(store))
    assert (pair.chosen, pair.rejected) == ("Green.", "Blue, the colour of the sky and the sea.")
    assert pair.feedback_ids == sorted([down, regen, up]) and pair.message_id == old


def test_every_disliked_sibling_pairs_with_the_latest_liked_one(store: Store) -> None:
    first, second, third, fourth = answers(store, "Name a colour.", "Blue.", "Red.", "Teal.", "Grey.")
    store.add_feedback(first, "regenerate")
    store.add_feedback(second, "rating", value=1)
    store.add_feedback(third, "rating", value=1)
    store.add_feedback(fourth, "rating", value=-1)
    episodes = episodes_from_store(store)
    pairs = [(e.chosen, e.rejected) for e in episodes]
    assert pairs == [("Teal.", "Blue."), ("Red.", None), ("Teal.", "Grey.")]


def test_ratings_in_different_conversations_stay_one_sided(store: Store) -> None:
    (liked,) = chat(store, ("Name a colour.", "Green."), expert="L0")
    (disliked,) = chat(store, ("Name a colour.", "Blue."), expert="L0")
    store.add_feedback(liked, "rating", value=1)
    store.add_feedback(disliked, "rating", value=-1)
    assert [(e.chosen, e.rejected) for e in episodes_from_store(store)] == [("Green.", None), (None, "Blue.")]


def test_only_the_users_own_words_count_as_corrected(store: Store) -> None:
    """`corrected` marks the held-out replies the learner's reading may use: a correction, not
    an up-vote, an endorsement or the liked side of a pair (replies the model sampled itself)."""
    (typed,) = chat(store, ("Capital of France?", "Paris."))
    (liked,) = chat(store, ("Capital of Italy?", "Rome."))
    (endorsed,) = chat(store, ("Capital of Spain?", "Madrid."))
    store.add_feedback(typed, "correction", text="Paris, on the Seine.")
    store.add_feedback(liked, "rating", value=1)
    store.add_feedback(endorsed, "correction", text="Madrid.")
    unsure, lima = answers(store, "Capital of Peru?", "I am not sure.", "Lima.")
    store.add_feedback(unsure, "rating", value=-1)
    store.add_feedback(lima, "rating", value=1)
    by_chosen = {e.chosen: e.corrected for e in episodes_from_store(store)}
    assert by_chosen == {"Paris, on the Seine.": True, "Rome.": False, "Madrid.": False, "Lima.": False}


def test_disliked_siblings_with_no_liked_one_join_into_one_episode(store: Store) -> None:
    """A user who turned down every answer to a question taught one thing: not any of these."""
    first, second, third = answers(store, "Name a colour.", "Blue.", "Red.", "Teal.")
    ids = [
        store.add_feedback(first, "regenerate"),
        store.add_feedback(second, "rating", value=-1),
        store.add_feedback(third, "regenerate"),
    ]
    joined = only(episodes_from_store(store))
    assert (joined.chosen, joined.rejected, joined.also_rejected) == (None, "Blue.", ("Red.", "Teal."))
    assert joined.all_rejected == ("Blue.", "Red.", "Teal.")
    assert joined.feedback_ids == sorted(ids) and joined.message_id == first
    assert joined.weight == 1.0  # the -1 rating, not a regenerate's half


def test_dislikes_of_different_questions_or_conversations_stay_apart(store: Store) -> None:
    (colour, animal) = chat(store, ("Name a colour.", "Blue."), ("Name an animal.", "Cat."), expert="L0")
    (elsewhere,) = chat(store, ("Name a colour.", "Red."), expert="L0")
    for reply in (colour, animal, elsewhere):
        store.add_feedback(reply, "rating", value=-1)
    episodes = episodes_from_store(store)
    assert [(e.rejected, e.also_rejected) for e in episodes] == [("Blue.", ()), ("Cat.", ()), ("Red.", ())]
