"""Swarm voting: answer normalization, the vote and its tie-break, the variants a model has, a real
vote through the engine, the session turn it records, and `macaron ask --vote K`."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import tomli_w
from conftest import EMBEDDED_GGUF, run_cli, write_random_adapter

from macaron_local.adapters import BaseModelInfo, LoraAdapter, LoraPair, write_adapter
from macaron_local.engine import Engine, EngineConfig, GenerationParams
from macaron_local.errors import InvalidInputError
from macaron_local.session import Session
from macaron_local.settings import Settings
from macaron_local.store import open_default_store
from macaron_local.swarm import Variant, choose, gather_variants, normalize_answer, run_swarm, vote

SHORT = GenerationParams(max_tokens=6, temperature=0.0, min_p=0.0)


# --------------------------------------------------------------------- normalization
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", "42"),
        ("First 3, then 7, so 12", "12"),
        ("It costs 1,000 dollars", "1000"),
        ("1, 2, 3", "3"),
        ("+7", "7"),
        ("42.0", "42"),
        ("3.50 metres", "3.5"),
        ("x = -5", "-5"),
        ("x = \u22125", "-5"),
        ("pages 3-5", "5"),
        ("-0", "0"),
        ("007", "7"),
        ("H2O has no answer", "h2o has no answer"),
        ("A dog has four legs.", "4"),
        ("Twenty-one", "21"),
        ("It is 5, not ten", "10"),
        ("someone often knows", "someone often knows"),
        ("\\boxed{seven}", "7"),
        ("so the result is \\boxed{12}. Check: 12 + 1 = 13", "12"),
        ("\\boxed{x = 2.50}", "2.5"),
        ("\\boxed{\\frac{6}{4}}", "3/2"),
        ("\\boxed{4/2}", "2"),
        ("first \\boxed{1} then \\boxed{Paris}", "paris"),
        ("\\boxed{\\text{a {nested} pair}} tail 99", "text a nested pair"),
        ("  Paris!  ", "paris"),
        ("The Capital,   PARIS.", "the capital paris"),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_equivalent_answers_agree() -> None:
    forms = ["The answer is 1,000.", "\\boxed{1000}", "1000.0", "+1000", "so: 1000"]
    assert {normalize_answer(f) for f in forms} == {"1000"}
    assert {normalize_answer(f) for f in ["Forty-two.", "\\boxed{42}", "42", "forty two"]} == {"42"}


# --------------------------------------------------------------------- vote
def test_majority_wins_and_split_is_most_votes_first() -> None:
    result = vote(["41", "The answer is 42", "\\boxed{42}", "paris", "42.0"])
    assert result.winner == "42"
    assert result.split == {"42": 3, "41": 1, "paris": 1}
    assert list(result.split) == ["42", "41", "paris"]  # ties below the winner: first given first
    assert result.answers == ["41", "42", "42", "paris", "42"]
    assert result.k == 5 and sum(result.split.values()) == 5
    assert result.winner_index == 1
    assert result.agreement == pytest.approx(0.6)
    assert result.summary() == 'vote: 3 of 5 for "42" (1 for "41", 1 for "paris")'


@pytest.mark.parametrize(
    ("answers", "winner"),
    [
        (["7", "8"], "7"),
        (["8", "7"], "8"),
        (["1", "2", "2", "1"], "1"),  # 2-2: the earliest variant's answer
        (["x", "1", "2", "2", "1"], "1"),  # 1 and 2 tied; variant 1 said 1 before variant 2 said 2
    ],
)
def test_tie_goes_to_the_earliest_variant(answers: list[str], winner: str) -> None:
    assert vote(answers).winner == winner


def test_unanimous_summary_and_empty_answers_count() -> None:
    assert vote(["5", "five is 5"]).summary() == 'vote: 2 of 2 for "5"'
    empty = vote(["", "", "3"])
    assert empty.winner == "" and empty.split == {"": 2, "3": 1}


def test_no_answers_or_bad_k_is_bad_input() -> None:
    with pytest.raises(InvalidInputError):
        vote([])
    with pytest.raises(InvalidInputError, match="K >= 1"):
        choose([Variant("base")], 0)
    with pytest.raises(InvalidInputError, match="only 1 adapter variant"):
        choose([Variant("base")], 2)
    assert choose([Variant("a"), Variant("b"), Variant("c")], 2) == [Variant("a"), Variant("b")]


# --------------------------------------------------------------------- variants of a model
@pytest.fixture
def tiny_home(home, tiny_model, tmp_path):
    """A user manifest `tiny` whose L0 and L2 slots have expert adapters."""
    model = tiny_model("llama", False)
    experts = {
        slot: write_random_adapter(tmp_path / f"expert-{slot}.gguf", model, rank=4, seed=seed, magnitude=1.5)
        for slot, seed in (("L0", 41), ("L2", 42))
    }
    manifest = {
        "name": "tiny",
        "architecture": "llama",
        "base": {"source": "path", "file": str(model.path)},
        "experts": {
            "L0": {"name": "Chat", "source": "path", "file": str(experts["L0"])},
            "L1": {"name": "Agent"},
            "L2": {"name": "Coding", "source": "path", "file": str(experts["L2"])},
            "L3": {"name": "UI"},
        },
    }
    home.user_manifests_dir.mkdir(parents=True, exist_ok=True)
    (home.user_manifests_dir / "tiny.toml").write_text(tomli_w.dumps(manifest))
    return home, model, experts


def test_gather_variants_order_statuses_plugins_and_duplicates(tiny_home, tmp_path):
    home, model, experts = tiny_home
    files = {n: write_random_adapter(tmp_path / f"v{n}.gguf", model, rank=2, seed=50 + n) for n in range(6)}
    with Session(home, model="tiny") as session:
        store = session.store
        old = store.register_adapter(files[0], slot="L2", base_model="tiny", rank=2)
        store.deploy_adapter(old.id)
        new = store.register_adapter(files[1], slot="L2", base_model="tiny", rank=2, parent_id=old.id)
        store.deploy_adapter(new.id)  # `old` is now retired
        rejected = store.register_adapter(files[2], slot="L0", base_model="tiny", rank=2, status="rejected")
        twin = store.register_adapter(files[3], slot="L1", base_model="tiny", rank=2)
        candidate = store.register_adapter(files[3], slot="L1", base_model="tiny", rank=2)  # same file: one voter
        store.register_adapter(files[4], slot="L2", base_model="other", rank=2)  # another base model
        store.add_plugin(
            files[5],
            name="pirate",
            slot="L0",
            base_model="tiny",
            rank=2,
            new_expert=False,
            format="gguf",
            validated=True,
            source="test",
            manifest={},
        )
        variants = gather_variants(store, session.catalog, session.manifest)
        for enough in range(1, len(variants) + 1):  # a vote of K stops at K: the same first K
            bounded = gather_variants(store, session.catalog, session.manifest, enough=enough)
            assert [v.label for v in bounded] == [v.label for v in variants[:enough]]
    labels = [v.label for v in variants]
    assert labels[:2] == ["expert L0 Chat", "expert L2 Coding"]
    assert labels[2] == f"L2 personal {new.id} (deployed)"
    assert labels[3:5] == [f"L1 personal {candidate.id} (candidate)", f"L2 personal {old.id} (retired)"]
    assert labels[5:] == ["plugin pirate", "base"]
    assert rejected.id not in " ".join(labels) and twin.id not in " ".join(labels)  # the newer twin votes
    by_label = {v.label: v for v in variants}
    # A personal version is served on its slot's expert; a candidate of a slot with no expert alone.
    assert by_label[labels[2]].paths == (experts["L2"], Path(new.path))
    assert by_label[labels[3]].paths == (Path(candidate.path),)
    assert by_label["plugin pirate"].paths[0].read_bytes() == files[5].read_bytes()
    assert by_label["base"].paths == ()


# --------------------------------------------------------------------- a real vote
def test_each_voter_answers_as_a_direct_greedy_generate(tiny_model, tmp_path):
    model = tiny_model("llama", False)
    paths = [write_random_adapter(tmp_path / f"a{i}.gguf", model, rank=4, seed=70 + i, magnitude=2.0) for i in range(4)]
    variants = [Variant(f"adapter {i}", (p,)) for i, p in enumerate(paths)] + [Variant("base")]
    messages = [{"role": "user", "content": "hello there, tiny model"}]
    config = EngineConfig(model_path=model.path, n_ctx=128, kv_f32=True)
    with Engine(config) as engine:
        outcome = run_swarm(engine, variants, messages, GenerationParams(max_tokens=6, temperature=0.9, seed=3))
        engine.set_adapters([])  # a second vote reuses nothing stale: same answers again
        again = run_swarm(engine, variants, messages, SHORT)
    direct = []
    for variant in variants:
        with Engine(config) as fresh:
            fresh.set_adapters([fresh.load_adapter(p) for p in variant.paths])
            tokens, _ = fresh.prompt_for(messages, SHORT.max_tokens)
            direct.append(fresh.generate(tokens, SHORT))
    assert [a.completion.tokens for a in outcome.answers] == [d.tokens for d in direct]  # greedy despite 0.9
    assert [a.text for a in again.answers] == [d.text for d in direct]
    assert len({d.text for d in direct}) > 1, "the variants must disagree for the vote to mean anything"
    assert outcome.result.answers == [normalize_answer(d.text) for d in direct]
    assert outcome.result.split == dict(Counter(outcome.result.answers).most_common())
    assert sum(outcome.result.split.values()) == len(variants) == outcome.result.k
    assert outcome.winning.answer == outcome.result.winner
    assert all(a.ms > 0 for a in outcome.answers) and outcome.wall_ms >= sum(a.ms for a in outcome.answers) * 0.99


def test_session_vote_records_the_turn(tiny_home, tmp_path):
    home, model, _ = tiny_home
    version = write_random_adapter(tmp_path / "personal.gguf", model, rank=2, seed=60)
    with Session(home, model="tiny", engine_config={"n_ctx": 128, "kv_f32": True}) as session:
        session.store.register_adapter(version, slot="L2", base_model="tiny", rank=2)
        outcome = session.vote("what is two plus two?", 4, params=SHORT)
        conversation = session.store.get_conversation(session.conversation_id)
        reply = session.store.get_message(outcome.message_id)
        turn = next(t for t in conversation.turns if t.message_id == outcome.message_id)
        assert session.leaf_id == outcome.message_id
        assert [m["role"] for m in session.messages] == ["user", "assistant"]
    assert [a.variant.label for a in outcome.answers][:2] == ["expert L0 Chat", "expert L2 Coding"]
    assert reply.content == outcome.winning.text
    assert turn.route_method == "vote" and turn.route_reason == outcome.result.summary()
    assert turn.expert == outcome.winning.variant.slot
    assert turn.sampling["temperature"] == 0.0
    recorded = turn.sampling["vote"]
    assert recorded["k"] == 4 and sum(recorded["votes"].values()) == 4
    assert [v["text"] for v in recorded["variants"]] == [a.text for a in outcome.answers]


def test_session_vote_refuses_more_voters_than_exist_before_storing(tiny_home):
    home, _, _ = tiny_home
    with Session(home, model="tiny") as session:
        with pytest.raises(InvalidInputError, match="only 3 adapter variant"):
            session.vote("hello", 4)
        assert not session.loaded and session.list_conversations() == []


# --------------------------------------------------------------------- the command line
def small_lora(base: BaseModelInfo, *, seed: int, rank: int = 2, magnitude: float = 0.05) -> LoraAdapter:
    """A random LoRA on the attention q/v of every layer of a real base model."""
    rng = np.random.default_rng(seed)
    pairs = {}
    for name, shape in base.tensors.items():
        if name.endswith(("attn_q.weight", "attn_v.weight")):
            out, inp = shape
            a = rng.normal(0, 1 / np.sqrt(inp), (rank, inp)).astype(np.float32)
            b = rng.normal(0, magnitude, (out, rank)).astype(np.float32)
            pairs[name] = LoraPair(a, b)
    return LoraAdapter(architecture=base.architecture, alpha=float(rank), pairs=pairs)


@pytest.fixture
def embedded_variants(home, tmp_path) -> Path:
    """MACARON_HOME with two registered random versions of the embedded model: with the base,
    three voters."""
    base = BaseModelInfo.from_gguf(EMBEDDED_GGUF)
    with open_default_store(home) as store:
        for seed, slot in ((1, "L0"), (2, "L2")):
            path = write_adapter(tmp_path / f"{slot}.gguf", small_lora(base, seed=seed))
            store.register_adapter(path, slot=slot, base_model="embedded", rank=2)
    return Path(os.environ["MACARON_HOME"])


def test_cli_vote_json_on_the_embedded_model(embedded_variants):
    result = run_cli("ask", "--vote", "3", "--json", "--max-tokens", "12", "What is 2 + 2?", home=embedded_variants)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["k"] == 3 and len(data["variants"]) == 3
    assert [v["label"].split()[0] for v in data["variants"]] == ["L2", "L0", "base"]  # newest first, base last
    assert sum(data["votes"].values()) == 3
    assert data["votes"] == dict(Counter(normalize_answer(v["text"]) for v in data["variants"]).most_common())
    assert data["answer"] == normalize_answer(data["text"]) and data["votes"][data["answer"]] == max(
        data["votes"].values()
    )
    with open_default_store(Settings.load(embedded_variants)) as store:
        conversation = store.get_conversation(store.list_conversations()[0].id)
    assert conversation.turns[0].route_method == "vote"
    assert conversation.messages[-1].content == data["text"]


def test_cli_vote_plain_prints_answer_and_split(embedded_variants):
    result = run_cli("ask", "--vote", "2", "--max-tokens", "8", "Name a colour.", home=embedded_variants)
    assert result.returncode == 0, result.stderr
    *answer, split = result.stdout.rstrip("\n").split("\n")
    assert split.startswith("vote: ") and " of 2 for " in split
    winner = normalize_answer("\n".join(answer))
    assert f'for "{winner[:30]}' in split  # the reply shown is the winner's


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--vote", "0"], "error: a vote needs K >= 1 variants (got 0)"),
        (["--vote", "-2"], "error: a vote needs K >= 1 variants (got -2)"),
        (["--vote", "4"], "error: only 3 adapter variant(s) can vote"),
        (["--vote", "2", "--temperature", "0.7"], "error: --vote answers greedily; drop --temperature"),
        (["--vote", "2", "--expert", "L2"], "error: --vote asks every variant"),
    ],
)
def test_cli_bad_vote_is_one_line_and_exit_2(embedded_variants, args, message):
    result = run_cli("ask", *args, "What is 2 + 2?", home=embedded_variants)
    assert result.returncode == 2
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1
    assert result.stdout == ""
