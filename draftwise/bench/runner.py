"""The runner: turns workloads × conditions into an interleaved plan of batches and executes it, journaled.

Owns the protocol's mechanics (docs/ARCHITECTURE.md, metric definitions; the seed's test plan): identical items,
sampling, output limits and concurrency for every condition; `warmup` requests then `requests` measured
per condition and group; conditions interleaved batch by batch, in an order rotated each batch, so machine
drift hits all conditions alike. Each finished batch is appended to `journal.jsonl` (one line per request,
flushed and fsynced together); on restart, complete batches are skipped and a torn last batch is dropped and
rerun, so a killed run resumes with no request lost or repeated.

The resume rule: protocol.json holds every protocol field (each workload's content hash — items, prompts /
messages / turns, output limits — conditions, sampling, warm-up, requests, concurrency, the client's identity)
and its key; a run refuses to resume into a directory whose protocol differs (another --out, or --fresh,
which discards the old journal: hours of measurements are never thrown away implicitly). Every record carries
the key; a batch counts as done only when its records are exactly the planned (condition, item, repeat) set.
An unreadable, partial or foreign line (valid JSON that is not a record of this protocol's plan) is dropped
with a JournalWarning and its batch reruns; the journal is then rewritten durably (temp file, fsync, rename,
fsync of the folder). Knows nothing of statistics or report formats; clients do the timing.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import warnings
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftwise.bench.clients import Call, Condition
from draftwise.bench.workloads import Item, Workload, select
from draftwise.config import ConfigError
from draftwise.models.catalog import write_text_durably

JOURNAL = "journal.jsonl"
PROTOCOL = "protocol.json"


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int | None = None  # None: each workload's own limit


@dataclass
class Batch:
    key: str
    phase: str  # "warmup" | "measured"
    workload: str
    group: str
    concurrency: int
    condition: Condition
    items: list[Item] = field(default_factory=list)

    @property
    def segment(self) -> str:
        return segment_id(self.workload, self.group, self.concurrency)

    def expected(self) -> set[tuple[str, str, int]]:
        """The (condition, item, repeat) of every record this batch must hold to count as done."""
        return {(self.condition.id, it.item_id, rep) for it, rep in zip(self.items, repeats(self.items))}


def repeats(items: list[Item]) -> list[int]:
    """For each item, how often the same item came earlier in the list (warm-up batches may repeat items)."""
    seen: dict[str, int] = {}
    out = []
    for it in items:
        out.append(seen.get(it.item_id, 0))
        seen[it.item_id] = out[-1] + 1
    return out


def segment_id(workload: str, group: str, concurrency: int) -> str:
    name = workload if group == workload else f"{workload}/{group}"
    return f"{name}@c{concurrency}"


def _chunks(xs: list, n: int) -> list[list]:
    return [xs[i:i + n] for i in range(0, len(xs), n)]


def build_plan(workloads: list[Workload], conditions: list[Condition], warmup: int, requests: int,
               concurrency: list[int] | None = None) -> list[Batch]:
    """Every batch of the run in execution order: per workload and concurrency, warm-up then measured."""
    plan: list[Batch] = []
    for w in workloads:
        for c in concurrency or list(w.concurrency):
            pool = w.warmup or w.items  # a workload's own warm-up prompts, else its first
            warm = [pool[i % len(pool)] for i in range(warmup)]
            plan += _interleave(w, "warmup", "warmup", c, warm, conditions)
            for group, items in select(w, requests).items():
                plan += _interleave(w, "measured", group, c, items, conditions)
    return plan


def _interleave(w: Workload, phase: str, group: str, conc: int, items: list[Item], conditions) -> list[Batch]:
    out = []
    for b, chunk in enumerate(_chunks(items, conc)):
        rot = b % len(conditions)
        for cond in conditions[rot:] + conditions[:rot]:
            key = f"{w.name}|c{conc}|{phase}|{group}|b{b}|{cond.id}"
            out.append(Batch(key, phase, w.name, group if phase == "measured" else w.name, conc, cond, chunk))
    return out


def item_seed(base: int, item_id: str) -> int:
    """The same seed for an item under every condition (paired), different across items."""
    return (base + zlib.crc32(item_id.encode())) % (2**31)


def calls_for(batch: Batch, workload: Workload, sampling: Sampling) -> list[Call]:
    out = []
    for it in batch.items:
        limit = it.max_tokens or sampling.max_tokens or workload.max_tokens
        out.append(Call(it.prompt, it.messages, limit, sampling.temperature, sampling.top_p,
                        item_seed(sampling.seed, it.item_id), list(it.stop), it.structured_outputs))
    return out


# ---- journal --------------------------------------------------------------------------------------
class JournalWarning(UserWarning):
    """A journal line was dropped on resume (torn, unreadable or not a record of this run's protocol)."""


class Journal:
    """Per-request records, appended a whole batch at a time; reading keeps only complete batches of this plan."""

    def __init__(self, out_dir: Path, protocol_key: str | None = None):
        self.path = Path(out_dir) / JOURNAL
        self.protocol_key = protocol_key
        self.records: list[dict] = []

    def load(self, plan: list[Batch]) -> set[str]:
        """Read existing records; keep only batches whose records are exactly the planned set (rewriting the
        file durably when anything was dropped). Returns the keys of the done batches."""
        if not self.path.exists():
            return set()
        expected = {b.key: b.expected() for b in plan}
        by_batch: dict[str, dict[tuple, dict]] = {}
        dropped: list[str] = []
        bad_batches: set[str] = set()
        text = self.path.read_bytes().decode("utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            rec = _parse_record(line)
            key = rec.get("batch") if rec is not None else None
            ident = _record_id(rec) if rec is not None else None
            if (not isinstance(key, str) or ident is None or rec.get("protocol") != self.protocol_key
                    or ident not in expected.get(key, ())):
                dropped.append(f"line {lineno}")  # torn by a kill, unreadable, or not a record of this plan
                if isinstance(key, str):
                    bad_batches.add(key)
                continue
            if ident in by_batch.setdefault(key, {}):
                dropped.append(f"line {lineno} (a duplicate)")
                bad_batches.add(key)
                continue
            by_batch[key][ident] = rec
        done = {b for b, recs in by_batch.items() if b not in bad_batches and set(recs) == expected[b]}
        self.records = [r for b, recs in by_batch.items() if b in done for r in recs.values()]  # file order
        n_read = sum(len(recs) for recs in by_batch.values())
        if dropped or len(self.records) != n_read:
            shown = ", ".join(dropped[:5]) + (", ..." if len(dropped) > 5 else "")
            what = [f"{len(dropped)} line(s) that are torn, unreadable or not records of this run's plan ({shown})"]
            what = what if dropped else []
            if len(self.records) != n_read:
                what.append(f"{n_read - len(self.records)} record(s) of incomplete batches")
            warnings.warn(f"{self.path}: dropped {' and '.join(what)}; those batches rerun", JournalWarning,
                          stacklevel=2)
            self._rewrite()
        return done

    def _rewrite(self) -> None:
        write_text_durably(self.path, "".join(json.dumps(r) + "\n" for r in self.records))

    def append(self, records: list[dict]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
        self.records.extend(records)


def _parse_record(line: str) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) else None


def _record_id(rec: dict) -> tuple | None:
    ident = (rec.get("condition"), rec.get("item_id"), rec.get("repeat"))
    return ident if all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in ident) else None


def protocol_key(protocol: dict) -> str:
    """A short hash of the canonical protocol: stamped on every journal record."""
    return hashlib.sha256(json.dumps(protocol, sort_keys=True).encode()).hexdigest()[:16]


def check_protocol(out_dir: Path, protocol: dict, fresh: bool) -> str:
    """Write protocol.json, or refuse to resume a run whose protocol differs (never mix changed settings);
    returns the protocol's key."""
    path = Path(out_dir) / PROTOCOL
    key = protocol_key(protocol)
    if fresh:
        for name in (JOURNAL, PROTOCOL):
            (Path(out_dir) / name).unlink(missing_ok=True)
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except ValueError:
            old = {}
        old = old if isinstance(old, dict) else {}
        if old.get("protocol") != protocol or old.get("key") != key:
            before = old.get("protocol") if isinstance(old.get("protocol"), dict) else old
            diff = sorted(k for k in set(before) | set(protocol) if before.get(k) != protocol.get(k))
            raise ConfigError(f"{out_dir} holds a run with a different protocol (differs in {diff}; a workload's "
                              "items, turns or limits count); use another --out, or --fresh to discard it")
        return key
    write_text_durably(path, json.dumps({"key": key, "protocol": protocol}, indent=1))
    return key


# ---- execution -------------------------------------------------------------------------------------
def run(client, plan: list[Batch], workloads: dict[str, Workload], sampling: Sampling, out_dir: Path,
        progress: bool = True, on_batch=None, protocol_key: str | None = None) -> list[dict]:
    """Execute the plan, skipping journaled batches of the same protocol; returns every record (old and new)."""
    journal = Journal(out_dir, protocol_key)
    done = journal.load(plan)
    todo = [b for b in plan if b.key not in done]
    bar = _bar(sum(len(b.items) for b in plan), sum(len(b.items) for b in plan if b.key in done), progress)
    if todo:
        client.prepare(list({b.condition.id: b.condition for b in plan}.values()))
    for batch in todo:
        if bar is not None:
            bar.set_postfix_str(f"{batch.segment} {batch.condition.id} {batch.phase}", refresh=False)
        records = run_batch(client, batch, workloads[batch.workload], sampling, protocol_key)
        journal.append(records)
        if bar is not None:
            bar.update(len(records))
        if on_batch is not None:
            on_batch(batch)
    if bar is not None:
        bar.close()
    return journal.records


def run_batch(client, batch: Batch, workload: Workload, sampling: Sampling,
              protocol_key: str | None = None) -> list[dict]:
    calls = calls_for(batch, workload, sampling)
    t0 = time.perf_counter()
    results, extra = client.run_batch(batch.condition, batch.items, calls)
    wall = time.perf_counter() - t0
    memory = client.memory()
    records = []
    for it, rep, call, res in zip(batch.items, repeats(batch.items), calls, results):
        rec = {"protocol": protocol_key, "batch": batch.key, "repeat": rep, "phase": batch.phase, "segment": batch.segment, "workload": batch.workload,
               "group": batch.group, "concurrency": batch.concurrency, "condition": batch.condition.id,
               "item_id": it.item_id, "task_id": it.meta.get("task_id"), "seed": call.seed,
               "max_tokens": call.max_tokens, "batch_wall_s": wall, "batch_size": len(batch.items),
               "time": time.time(), "memory": memory, **extra, **res.to_dict()}
        rec["tpot_s"] = tpot(res.e2e_s, res.ttft_s, res.num_output_tokens)
        rec["tok_s"] = res.num_output_tokens / res.e2e_s if res.e2e_s and res.num_output_tokens else None
        records.append(rec)
    return records


def tpot(e2e_s, ttft_s, n_out) -> float | None:
    """(E2E − TTFT) / (output tokens − 1), docs/ARCHITECTURE.md; undefined for a single token."""
    if e2e_s is None or ttft_s is None or not n_out or n_out < 2:
        return None
    return (e2e_s - ttft_s) / (n_out - 1)


def _bar(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="bench", unit="req", file=sys.stderr, dynamic_ncols=True)


def protocol_dict(workloads: list[Workload], conditions: list[Condition], warmup: int, requests: int,
                  concurrency: list[int] | None, sampling: Sampling, target: dict) -> dict:
    """Everything that must be equal for two runs' records to be comparable (stored in protocol.json)."""
    return {"workloads": [{"name": w.name, "content_sha256": workload_digest(w)} for w in workloads],
            "conditions": [asdict(c) for c in conditions],
            "warmup": warmup, "requests": requests, "concurrency": concurrency,
            "sampling": asdict(sampling), "target": target}


def workload_digest(w: Workload) -> str:
    """sha256 of a workload's content: every item (id, group, prompt / messages / turns, limits, stop), its
    output limit and concurrency — editing the JSONL or switching --turns changes it."""
    content = {"items": [asdict(it) for it in w.items], "max_tokens": w.max_tokens,
               "concurrency": list(w.concurrency)}
    return hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
