"""`macaron logs ...` and `macaron forget` as a user runs them, against a real store file."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from conftest import run_cli

from macaron_local.cli import main
from macaron_local.settings import Settings
from macaron_local.store import Store, open_default_store

TURN = {
    "model": "embedded",
    "expert": "L2",
    "route_method": "keywords",
    "route_reason": "matched 'python'",
    "adapters": ["L2-coding.gguf"],
    "sampling": {"temperature": 0.0},
    "prompt_tokens": 20,
    "completion_tokens": 5,
    "ttft_ms": 30.0,
    "total_ms": 90.0,
    "finish_reason": "stop",
}


def root(settings: Settings) -> Path:
    return settings.data_dir.parent


@pytest.fixture
def seeded(home: Settings) -> dict[str, str]:
    """Two conversations: one with a rated, corrected reply that a learning run used."""
    with open_default_store(home) as store:
        older = store.new_conversation("embedded", "Be brief.")
        hello = store.add_message(older, "user", "Say hello", None)
        store.add_reply(older, hello, "Hello!", {**TURN, "expert": "L0", "route_method": "default"})
        cid = store.new_conversation("embedded", "You are helpful.")
        question = store.add_message(cid, "user", "Reverse a list in python", None)
        answer, _ = store.add_reply(cid, question, "Use reversed(xs).", TURN)
        rating = store.add_feedback(answer, "rating", 1, "clear")
        corrected = store.add_feedback(answer, "correction", text="Use xs[::-1] for a copy.")
        run = store.record_learning_run(
            slot="L2", status="done", feedback_ids=[rating], adapter_version="L2-personal-v4"
        )
    return {"older": older, "cid": cid, "answer": answer, "corrected": corrected, "run": run}


def one_error_line(done, code: int, needle: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == code, (done.stdout, done.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], done.stderr


def test_logs_list_json_is_a_list_newest_first(home: Settings, seeded: dict[str, str]) -> None:
    done = run_cli("logs", "list", "--json", home=root(home))
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert isinstance(rows, list) and [r["id"] for r in rows] == [seeded["cid"], seeded["older"]]
    assert set(rows[0]) == {"id", "title", "model", "updated_at", "messages"}
    assert rows[0]["messages"] == 2 and rows[0]["title"] == "Reverse a list in python"
    limited = run_cli("logs", "list", "--json", "--limit", "1", home=root(home))
    assert [r["id"] for r in json.loads(limited.stdout)] == [seeded["cid"]]
    text = run_cli("logs", "list", home=root(home))
    assert seeded["cid"] in text.stdout and "2 msgs" in text.stdout


def test_logs_show_prints_the_current_branch_with_experts_and_feedback(
    home: Settings, seeded: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    shared = len(os.path.commonprefix([seeded["cid"], seeded["older"]]))
    assert main(["logs", "show", seeded["cid"][: max(shared + 1, 4)]]) == 0  # a unique prefix is enough
    shown = capsys.readouterr().out
    assert "Reverse a list in python" in shown and "system: You are helpful." in shown
    assert "### user\nReverse a list in python" in shown
    assert "### assistant [L2 Coding | keywords] [+1] [corrected]\nUse reversed(xs).\n" in shown
    assert "  corrected to: Use xs[::-1] for a copy." in shown
    assert "  comment: clear" in shown


def test_logs_show_json_has_the_whole_tree(
    home: Settings, seeded: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["logs", "show", "--json", seeded["cid"]]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["id"] == seeded["cid"] and data["current_leaf_id"] == seeded["answer"]
    assert len(data["messages"]) == 2 and len(data["turns"]) == 1 and len(data["feedback"]) == 2
    assert data["turns"][0]["expert"] == "L2" and data["turns"][0]["adapters"] == ["L2-coding.gguf"]


def test_logs_search_finds_messages_and_survives_hostile_queries(home: Settings, seeded: dict[str, str]) -> None:
    done = run_cli("logs", "search", "--json", "reversed", home=root(home))
    assert done.returncode == 0, done.stderr
    (hit,) = json.loads(done.stdout)
    assert hit["conversation_id"] == seeded["cid"] and hit["message_id"] == seeded["answer"]
    for query in ('"unbalanced', "AND OR", "*", "NEAR("):
        hostile = run_cli("logs", "search", query, home=root(home))
        assert hostile.returncode == 0 and hostile.stderr == "", (query, hostile.stderr)


def test_export_import_export_round_trips_through_the_cli(
    home: Settings, seeded: dict[str, str], tmp_path: Path
) -> None:
    exported = run_cli("logs", "export", home=root(home))
    assert exported.returncode == 0, exported.stderr
    assert len(exported.stdout.splitlines()) == 2
    out = tmp_path / "backup.jsonl"
    to_file = run_cli("logs", "export", "--output", str(out), home=root(home))
    assert to_file.returncode == 0 and "exported 2 conversations" in to_file.stderr
    assert out.read_text(encoding="utf-8") == exported.stdout
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    other = tmp_path / "other-home"
    imported = run_cli("logs", "import", str(out), home=other)
    assert imported.returncode == 0 and "imported 2 conversations" in imported.stdout, imported.stderr
    again = run_cli("logs", "export", home=other)
    assert again.stdout == exported.stdout
    twice = run_cli("logs", "import", str(out), home=other)
    assert "imported 0 conversations" in twice.stdout and "skipped 2 already here" in twice.stdout
    one = run_cli("logs", "export", seeded["older"], home=root(home))
    assert [json.loads(line)["conversation"]["id"] for line in one.stdout.splitlines()] == [seeded["older"]]


def test_forget_deletes_and_reports_tainted_runs(home: Settings, seeded: dict[str, str]) -> None:
    done = run_cli("forget", seeded["cid"], home=root(home))
    assert done.returncode == 0, done.stderr
    assert f"forgot conversation {seeded['cid']}: 2 messages, 2 feedback entries" in done.stdout
    assert seeded["run"] in done.stdout and "L2-personal-v4" in done.stdout
    with open_default_store(home) as store:
        assert [c.id for c in store.list_conversations()] == [seeded["older"]]
        assert store.learning_runs()[0].tainted
    quiet = run_cli("forget", seeded["older"], home=root(home))
    assert "no learning run had learned from it" in quiet.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["logs", "show", "nope"], "no conversation with id nope"),
        (["logs", "show", "0"], "no conversation with id 0"),
        (["logs", "export", "nope"], "no conversation with id nope"),
        (["forget", "nope"], "no conversation with id nope"),
        (["logs", "import", "/does/not/exist.jsonl"], "cannot read /does/not/exist.jsonl"),
        (["logs", "list", "--limit", "0"], "--limit must be at least 1"),
    ],
)
def test_bad_ids_and_files_get_one_line_and_exit_2(home: Settings, seeded, args: list[str], needle: str) -> None:
    one_error_line(run_cli(*args, home=root(home)), 2, needle)


def test_a_bad_import_file_names_the_line_and_imports_nothing(home: Settings, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    good = '{"type":"macaron-local/conversation","version":1,"conversation":{"id":"c1","title":null,'
    good += '"model":null,"system_prompt":null,"created_at":"t","updated_at":"t","current_leaf_id":null}}\n'
    bad.write_bytes(good.encode() + b"\n{\xff\xfe}\n")
    one_error_line(run_cli("logs", "import", str(bad), home=root(home)), 2, "line 3: not valid UTF-8")
    bad.write_bytes(good.encode() + b"{oops\n")
    one_error_line(run_cli("logs", "import", str(bad), home=root(home)), 2, "line 2: not valid JSON")
    with open_default_store(home) as store:
        assert store.list_conversations() == []


def test_a_broken_store_is_one_line_not_a_traceback(home: Settings) -> None:
    (home.data_dir / "macaron.db").mkdir()
    one_error_line(run_cli("logs", "list", home=root(home)), 1, "it is a directory")


def test_the_store_module_is_what_the_cli_uses(home: Settings) -> None:
    with open_default_store(home) as store:
        assert isinstance(store, Store) and store.db_path == home.data_dir / "macaron.db"
