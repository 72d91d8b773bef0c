"""The protocol's pure parts: profiles, reasoning and tool-call markup, views, route order."""

from __future__ import annotations

import pytest

from macaron_local.engine.template import CHATML, ChatTemplate, continue_final_message
from macaron_local.errors import InvalidInputError
from macaron_local.protocol.features import ends_in_tool_call, family_for, parse_tool_calls, split_reasoning
from macaron_local.protocol.profile import PREFILL, load_profile, shipped_profile
from macaron_local.protocol.route import RouteHop, parse_label, route_messages
from macaron_local.protocol.views import Step, own_view, summary_view, tasks_of, transcript_view
from macaron_local.router import route

LORA_MD = """# Experts
## L0
adapter_name: chat
### Description
Talk.
Boundary: small talk stays here.
## L1
adapter_name: agent
### Description
Act.
### Notes
not part of the description
## L2
adapter_name: code
### Description
Code.
## L3
adapter_name: ui
### Description
Screens.
"""


ROUTE_MD = "{{MODEL_NAME}} routes.\n\n{{LORA_DESCRIPTIONS}}\n\nOne of: {{ROUTE_LABELS}}\nmodel_id="


def write_profile(folder, route_text=ROUTE_MD):
    intro = "I am {{MODEL_NAME}} on {{BASE_MODEL}}."
    files = {"route": route_text, "lora": LORA_MD, "intro": intro, "summary": "Sum up."}
    for name, text in files.items():
        (folder / f"{name}.md").write_text(text, encoding="utf-8")
    return [folder / f"{name}.md" for name in files]


def test_profile_files_give_the_route_instruction_with_the_prefill_stem_removed(tmp_path):
    profile = load_profile(*write_profile(tmp_path), default_label="L2", model_name="Tall", base_model="Qwen")
    assert profile.route_instruction == (
        "Tall routes.\n\nL0 = Talk. Boundary: small talk stays here.\nL1 = Act.\nL2 = Code.\nL3 = Screens.\n\n"
        "One of: L0 L1 L2 L3"
    )
    assert (profile.intro, profile.summary_instruction) == ("I am Tall on Qwen.", "Sum up.")
    assert profile.default_label == "L2"


@pytest.mark.parametrize(
    ("route_text", "lora", "label", "needle"),
    [
        ("no placeholders", LORA_MD, "L2", "must contain"),
        (None, LORA_MD.replace("## L3", "## L2"), "L2", "described twice"),
        (None, LORA_MD.replace("adapter_name: code\n", ""), "L2", "adapter_name"),
        (None, "nothing here", "L2", "no expert sections"),
        (None, LORA_MD, "L9", "default label"),
    ],
)
def test_bad_profiles_are_clear_errors(tmp_path, route_text, lora, label, needle):
    paths = write_profile(tmp_path, route_text) if route_text else write_profile(tmp_path)
    paths[1].write_text(lora, encoding="utf-8")
    with pytest.raises(InvalidInputError, match=needle):
        load_profile(*paths, default_label=label, model_name="m")


def test_the_embedded_profile_ships_in_the_package_and_is_complete():
    profile = shipped_profile("embedded")
    assert profile.labels == ("L0", "L1", "L2", "L3") and profile.default_label == "L0"
    assert "{{" not in profile.route_instruction and not profile.route_instruction.endswith(PREFILL)
    assert profile.intro and profile.summary_instruction and "{summary}" in profile.handoff
    with pytest.raises(InvalidInputError, match="no routing profile"):
        shipped_profile("nope")


def test_route_message_layout_and_continuation():
    profile = shipped_profile("embedded")
    messages = route_messages(profile, "  hello  ")
    assert messages == [
        {"role": "user", "content": f"hello\n\n{profile.route_instruction}"},
        {"role": "assistant", "content": "model_id="},
    ]
    text = ChatTemplate(CHATML).render(messages, add_generation_prompt=False)
    assert continue_final_message(text, "model_id=").endswith("<|im_start|>assistant\nmodel_id=")


def test_labels_parse_only_when_complete():
    labels = ("L0", "L1", "L2", "L3")
    assert parse_label(" L2\n", labels) == "L2" and parse_label("l3", labels) == "L3"
    assert [parse_label(raw, labels) for raw in ("L", "L7", "L2 x")] == [None, None, None]


def test_route_order_explicit_then_pending_then_the_hop_and_keywords_only_as_fallback():
    calls = []

    def hop(text):
        calls.append(text)
        return RouteHop("L3", "L3", True, 5.0, 100)

    assert route("fix the python bug", explicit="L1", hop=hop).method == "explicit"
    assert route("42", pending_slot="L2", hop=hop).method == "pending" and calls == []
    decided = route("fix the python bug", hop=hop)  # keywords would say L2: the hop decides
    assert (decided.slot, decided.method, decided.raw, decided.ms) == ("L3", "model", "L3", 5.0)
    fallback = route("fix the python bug", hop=hop, mode="keywords")
    assert (fallback.slot, fallback.method) == ("L2", "keywords") and len(calls) == 1
    assert route("hello there", mode="keywords", default="L2").slot == "L2"
    odd = route("x", hop=lambda t: RouteHop("L2", "L", False, 1.0, 10))
    assert (odd.slot, odd.method, odd.raw) == ("L2", "default", "L")
    with pytest.raises(InvalidInputError, match="routing must be"):
        route("x", mode="dice")


def test_reasoning_is_split_from_the_reply():
    assert split_reasoning("<think>\nplan it\n</think>\n\nThe answer.") == ("plan it", "The answer.")
    assert split_reasoning("plan it</think>The answer.") == ("plan it", "The answer.")  # prompt opened <think>
    assert split_reasoning("No block.") == ("", "No block.")


def test_qwen3_coder_and_hermes_tool_calls():
    coder = (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    [call] = parse_tool_calls(coder, "qwen3_coder")
    assert (call.name, call.arguments) == ("get_weather", {"city": "Paris", "days": 3})
    assert ends_in_tool_call(coder, "qwen3_coder") and not ends_in_tool_call(coder + "\nDone.", "qwen3_coder")
    hermes = 'Sure.\n<tool_call>\n{"name": "ls", "arguments": {"path": "/tmp"}}\n</tool_call>'
    assert [(c.name, c.arguments) for c in parse_tool_calls(hermes, "hermes")] == [("ls", {"path": "/tmp"})]
    assert not ends_in_tool_call("<tool_call>not json</tool_call>", "hermes")
    assert family_for("qwen35moe") == "qwen3_coder" and family_for("llama") == "hermes"


def conversation() -> list[Step]:
    """A(L0) -> B(L2, with a tool call and its result) -> C(L0)."""
    return [
        Step("user", "A?"),
        Step("assistant", A_REPLY, expert="L0", summary="Answered A."),
        Step("user", "B?"),
        Step("assistant", "<tool_call>{}</tool_call>", expert="L2", tool_call=True),
        Step("tool", "result " * 20),
        Step("assistant", "B!", expert="L2", summary="Did B with a tool."),
        Step("user", "C?"),
    ]


A_REPLY = "A! " + "Here is everything about A, at length. " * 4


def test_each_expert_sees_its_own_tasks_verbatim_and_others_as_summaries():
    profile = shipped_profile("embedded")
    steps = conversation()
    system = {"role": "system", "content": f"Be kind.\n\n{profile.intro}"}
    assert own_view(steps, "L0", "Be kind.", profile) == [
        system,
        {"role": "user", "content": "A?"},
        {"role": "assistant", "content": A_REPLY},
        {"role": "user", "content": "B?"},
        {"role": "assistant", "content": profile.handoff_text("Did B with a tool.")},
        {"role": "user", "content": "C?"},
    ]
    l2 = own_view(steps, "L2", "Be kind.", profile)
    assert l2[2] == {"role": "assistant", "content": profile.handoff_text("Answered A.")}
    assert [m["content"] for m in l2[3:7]] == ["B?", "<tool_call>{}</tool_call>", "result " * 20, "B!"]
    assert len(transcript_view(steps, "Be kind.", profile)) == 1 + len(steps)
    tasks = tasks_of(steps)
    assert [(t.owner, t.closed) for t in tasks] == [("L0", True), ("L2", True), (None, False)]
    summary = summary_view(tasks[1], "Be kind.", profile)
    assert summary[-1] == {"role": "user", "content": profile.summary_instruction} and summary[1]["content"] == "B?"


def test_an_experts_view_only_grows_at_its_end():
    """A(L0) -> B(L2) -> C(L0): L0's rendered view at C starts with its view at A plus its reply."""
    profile = shipped_profile("embedded")
    template = ChatTemplate(CHATML)
    steps = conversation()
    at_a = template.render(own_view(steps[:1], "L0", "", profile)) + A_REPLY
    at_c = template.render(own_view(steps, "L0", "", profile))
    assert at_c.startswith(at_a)
    without_summary = [Step(s.role, s.content, s.expert, None, s.tool_call) for s in steps]
    assert own_view(without_summary, "L0", "", profile)[4]["content"] == "B!"  # summaries off: the reply


def test_a_task_shorter_than_its_hand_off_is_shown_verbatim():
    """A summary is there to save tokens: a short task (a small model's two-word answer) is
    cheaper as itself, and the choice is made from stored text, so the view stays stable."""
    profile = shipped_profile("embedded")
    short = [
        Step("user", "Hi?"),
        Step("assistant", "Hello!", expert="L2", summary="Greeted the user back in a friendly way."),
        Step("user", "Next?"),
    ]
    assert own_view(short, "L0", "", profile)[1:3] == [
        {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Hello!"},
    ]
    long = [short[0], Step("assistant", "Hello! " * 40, expert="L2", summary=short[1].summary), short[2]]
    assert own_view(long, "L0", "", profile)[2]["content"] == profile.handoff_text(short[1].summary)


def test_summaries_can_be_turned_off_per_model(tmp_path):
    from macaron_local.catalog import Manifest
    from macaron_local.protocol.runner import Protocol

    path = tmp_path / "m.toml"
    base = 'name = "m"\narchitecture = "qwen35moe"\n[base]\nsource = "path"\nfile = "x.gguf"\n'
    path.write_text(base + '[protocol]\nsummaries = false\ndefault_label = "L2"\n')
    protocol = Protocol(Manifest.from_toml(path))
    assert not protocol.options.summaries and protocol.family == "qwen3_coder"
    assert protocol.closing_task(conversation()[:2]) is None  # a final answer, but no summary hop
    path.write_text(base)
    assert Protocol(Manifest.from_toml(path)).closing_task(conversation()[:2]).owner == "L0"
    path.write_text(base + '[protocol]\ndefault_label = "L9"\n')
    with pytest.raises(InvalidInputError, match="default_label"):
        Protocol(Manifest.from_toml(path))


def test_the_summary_and_route_hop_fields_survive_export_and_import(tmp_path):
    import io
    import json

    from macaron_local.store import open_store

    store = open_store(tmp_path / "a.db")
    cid = store.new_conversation("m", "")
    question = store.add_message(cid, "user", "Hi")
    turn = {"model": "m", "expert": "L0", "route_method": "model", "route_raw": "L0", "route_ms": 12.5}
    reply, _ = store.add_reply(cid, question, "Hello", turn)
    store.set_turn_summary(reply, "Greeted the user.", 30.0)
    out = io.StringIO()
    store.export_jsonl(out)
    [record] = [json.loads(line) for line in out.getvalue().splitlines()]
    [exported] = record["turns"]
    assert (exported["summary"], exported["summary_ms"], exported["route_raw"]) == ("Greeted the user.", 30.0, "L0")
    other = open_store(tmp_path / "b.db")
    other.import_jsonl(io.StringIO(out.getvalue()))
    again = io.StringIO()
    other.export_jsonl(again)
    assert again.getvalue() == out.getvalue()
    with pytest.raises(InvalidInputError, match="no turn"):
        store.set_turn_summary(question, "x", None)


def test_a_summary_is_one_line_of_at_most_two_sentences():
    from macaron_local.protocol.summary import clip_summary

    assert clip_summary("<think>hm</think>\nI wrote a loop.\nIt prints 1 to 3. Then I said bye. More.") == (
        "I wrote a loop. It prints 1 to 3."
    )
    assert clip_summary("Answered the question about version 3.11 of Python") == (
        "Answered the question about version 3.11 of Python"
    )
