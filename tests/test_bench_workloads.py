"""Workloads: the built-in sets, every user JSONL format, and bad files naming the line."""
import json

import pytest

from draftwise.bench.workloads import (REPETITION_THRESHOLD, WorkloadError, load_workload, read_jsonl,
                                       repetition_share)


def write(tmp_path, lines, name="w.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return p


def test_builtin_workloads():
    chat = load_workload("chat")
    assert len(chat.items) == 30 and chat.max_tokens == 128 and all(i.messages for i in chat.items)
    lengths = [len(i.messages[0]["content"].split()) for i in chat.items]
    assert max(lengths) <= 2 * min(lengths)  # "similar length"
    longform = load_workload("longform")
    assert longform.max_tokens == 1024 and longform.concurrency == (1, 4) and len(longform.items) == 30
    code = load_workload("code")
    assert code.groups == ["repeated", "novel"]
    rep = [i for i in code.items if i.group == "repeated"]
    novel = [i for i in code.items if i.group == "novel"]
    assert len(rep) == 30 and len(novel) >= 150 and all(i.meta["task_id"].startswith("HumanEval/") for i in novel)


def test_code_groups_separated_by_the_documented_criterion():
    code = load_workload("code")
    for it in code.items:
        share = repetition_share(it.prompt)
        assert (share >= REPETITION_THRESHOLD) == (it.group == "repeated"), (it.item_id, share)
    assert repetition_share("a = 1\nb = 2\nc = 3\n") == 1.0
    assert repetition_share("def f(x):\n    return x + 1\n") == 0.0
    assert repetition_share('def f():\n    """a = 1\n    b = 2\n    """\n    return 1\n') == 0.0  # docstrings ignored


def test_user_formats(tmp_path):
    p = write(tmp_path, [
        {"prompt": "def add(a, b):", "max_tokens": 16, "stop": "\n\n"},
        {"id": "m1", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]},
        {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Now shorter."]},
        "",
    ])
    items = read_jsonl(p, "user")
    assert [i.item_id for i in items] == ["w-1", "m1", "81"]
    assert items[0].prompt == "def add(a, b):" and items[0].max_tokens == 16 and items[0].stop == ["\n\n"]
    assert items[1].messages[0]["role"] == "system"
    assert items[2].messages == [{"role": "user", "content": "Write a poem."}] and items[2].turns is None
    all_turns = read_jsonl(p, "user", turns="all")
    assert all_turns[2].turns == ["Write a poem.", "Now shorter."] and all_turns[2].messages is None
    w = load_workload(str(p))
    assert w.name == "w" and len(w.items) == 3


@pytest.mark.parametrize("bad, message", [
    ('{"prompt": "ok"', "not valid JSON"),
    ('["a list"]', "expected a JSON object"),
    ('{"text": "x"}', 'needs exactly one of "prompt", "messages" or "turns"'),
    ('{"prompt": "x", "messages": []}', "needs exactly one of"),
    ('{"prompt": ""}', '"prompt" must be a non-empty string'),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "messages[0] must be"),
    ('{"turns": []}', '"turns" must be a non-empty list'),
    ('{"prompt": "x", "max_tokens": 0}', '"max_tokens" must be an integer >= 1'),
    ('{"id": "a", "prompt": "x"}', "duplicate id"),
])
def test_bad_lines_name_file_and_line(tmp_path, bad, message):
    p = write(tmp_path, ['{"id": "a", "prompt": "fine"}', "", bad])
    with pytest.raises(WorkloadError) as e:
        read_jsonl(p, "user")
    assert f"{p} line 3" in str(e.value) and message in str(e.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(WorkloadError, match="neither one of"):
        load_workload(str(tmp_path / "nope.jsonl"))
    with pytest.raises(WorkloadError, match="no prompts"):
        read_jsonl(write(tmp_path, [""]), "user")


def test_structured_workload_and_validity(tmp_path):
    from draftwise.bench.clients import Condition
    from draftwise.bench.lab import conditions_from
    from draftwise.bench.quality import validity

    w = load_workload("structured")
    assert len(w.items) == 30 and all(i.messages and "json" in i.structured_outputs for i in w.items)
    assert len({i.item_id for i in w.items}) == 30
    tools = [i for i in w.items if i.item_id.endswith("-tool")]
    assert 8 <= len(tools) <= 22  # both extraction and tool-call prompts
    item = next(i for i in w.items if i.item_id == "weather-tool")
    good = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius", "days": 3}})
    bad = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "kelvin", "days": 3}})
    recs = [{"phase": "measured", "condition": c, "item_id": item.item_id, "text": t, "finish_reason": f}
            for c, t, f in [("none", good, "stop"), ("grammar-k4", good, "stop"), ("grammar-k4", bad, "stop"),
                            ("grammar-k4", good[:20], "length")]]
    v = validity(recs, {item.item_id: item.structured_outputs})
    assert v["none"]["rate"] == 1.0 and v["grammar-k4"]["valid"] == 1 and v["grammar-k4"]["n"] == 3
    assert [x["finish_reason"] for x in v["grammar-k4"]["invalid_items"]] == ["stop", "length"]
    conds = conditions_from(["none", "grammar+draft_model", "grammar+ngram"], [4], "draft-0.5b")
    assert conds[1].spec_config() == {"method": "grammar", "num_speculative_tokens": 4,
                                      "then": {"method": "draft_model", "model": "draft-0.5b"}}
    assert conds[2].spec_config()["then"] == {"method": "ngram"} and conds[2].id == "grammar+ngram-k4"
    with pytest.raises(WorkloadError, match="line 1"):
        read_jsonl(write(tmp_path, [{"prompt": "p", "schema": {"type": "objekt"}}]), "user")
    assert Condition("grammar", 2).spec_config() == {"method": "grammar", "num_speculative_tokens": 2}


def test_structured_compact_is_the_structured_prompts_without_free_whitespace():
    from draftwise.structured.constraint import parse_structured_outputs

    loose, compact = load_workload("structured"), load_workload("structured-compact")
    assert [i.item_id for i in compact.items] == [i.item_id for i in loose.items]
    for a, b in zip(loose.items, compact.items):
        assert b.messages == a.messages and b.structured_outputs["json"] == a.structured_outputs["json"]
        assert parse_structured_outputs(b.structured_outputs).compact_json
        assert not parse_structured_outputs(a.structured_outputs).compact_json


def test_agentic_workload_repeats_within_and_across_conversations_and_warms_up_apart():
    from draftwise.bench.runner import build_plan
    from draftwise.bench.clients import Condition

    w = load_workload("agentic")
    assert len(w.items) == 30 and w.groups == ["agentic"]  # one segment of 30 paired prompts
    kinds = [i.item_id.split("-")[1] for i in w.items]
    assert all(kinds.count(k) == 10 for k in ("code", "tools", "sql")) and kinds[:3] == ["code", "tools", "sql"]
    for it in w.items:  # two turns: the earlier answer is in the prompt, the next one re-emits most of it
        roles = [m["role"] for m in it.messages]
        assert roles == ["system", "user", "assistant", "user"]
    prompts = {it.messages[0]["content"] for it in w.items}
    assert len(prompts) == 3  # one file, one tool set, one schema: shared across the group's conversations
    warm_ids = {i.item_id for i in w.warmup}
    assert len(w.warmup) == 5 and not warm_ids & {i.item_id for i in w.items}
    plan = build_plan([w], [Condition("none", 0)], 5, 30)
    assert {b.items[0].item_id for b in plan if b.phase == "warmup"} == warm_ids


def test_longprompt_is_one_growing_self_written_module_per_size():
    import ast

    from draftwise.bench.workloads import LONGPROMPT_TOKENS, longprompt_text

    w = load_workload("longprompt")
    assert [it.group for it in w.items] == list(LONGPROMPT_TOKENS) and w.warmup and w.max_tokens == 16
    sizes = [len(it.prompt) for it in w.items]
    assert sizes == sorted(sizes) and sizes[-1] > 12 * sizes[0]
    assert longprompt_text(2048, seed=3) == longprompt_text(2048, seed=3) != longprompt_text(2048, seed=4)
    for it in w.items:
        ast.parse(it.prompt)  # real Python source
