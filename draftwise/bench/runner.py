"""The runner: turns workloads × conditions into an interleaved plan of batches and executes it, journaled.

Owns the protocol's mechanics (docs/ARCHITECTURE.md, metric definitions; the seed's test plan): identical items,
sampling, output limits and concurrency for every condition; `warmup` requests then `requests` measured
per condition and group; conditions interleaved batch by batch, in an order rotated each batch, so machine
drift hits all conditions alike. Each finished batch is appended to `journal.jsonl` (one line per request,
flushed and fsynced together); on restart, complete batches are skipped and a torn last batch is dropped and
rerun, so a killed run resumes with no request lost or repeated. A run refuses to resume into a directory
whose protocol differs. Knows nothing of statistics or report formats; clients do the timing.
"""
from __future__ import annotations

import json
import os
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from draftwise.bench.clients import Call, Condition
from draftwise.bench.workloads import Item, Workload, select
from draftwise.config import ConfigError

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
            warm = [w.items[i % len(w.items)] for i in range(warmup)]
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
                        item_seed(sampling.seed, it.item_id), list(it.stop)))
    return out


# ---- journal --------------------------------------------------------------------------------------
class Journal:
    """Per-request records, appended a whole batch at a time; reading drops a torn last batch."""

    def __init__(self, out_dir: Path):
        self.path = Path(out_dir) / JOURNAL
        self.records: list[dict] = []

    def load(self, batch_sizes: dict[str, int]) -> set[str]:
        """Read existing records; keep only complete batches (rewriting the file if a batch was torn)."""
        if not self.path.exists():
            return set()
        recs, torn = [], False
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                recs.append(json.loads(line))
            except json.JSONDecodeError:
                torn = True  # a write cut by the kill; its batch is incomplete and reruns
        by_batch: dict[str, list[dict]] = {}
        for r in recs:
            by_batch.setdefault(r["batch"], []).append(r)
        done = {b for b, rs in by_batch.items() if len(rs) == batch_sizes.get(b, -1)}
        self.records = [r for r in recs if r["batch"] in done]
        if torn or len(self.records) != len(recs):
            self._rewrite()
        return done

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records), encoding="utf-8")
        os.replace(tmp, self.path)

    def append(self, records: list[dict]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
        self.records.extend(records)


def check_protocol(out_dir: Path, protocol: dict, fresh: bool) -> None:
    """Write protocol.json, or refuse to resume a run whose protocol differs (never mix changed settings)."""
    path = Path(out_dir) / PROTOCOL
    if fresh:
        for name in (JOURNAL, PROTOCOL):
            (Path(out_dir) / name).unlink(missing_ok=True)
    if path.exists():
        old = json.loads(path.read_text())
        if old != protocol:
            diff = sorted(k for k in set(old) | set(protocol) if old.get(k) != protocol.get(k))
            raise ConfigError(f"{out_dir} holds a run with a different protocol (differs in {diff}); "
                              "use another --out, or --fresh to discard it")
        return
    path.write_text(json.dumps(protocol, indent=1))


# ---- execution -------------------------------------------------------------------------------------
def run(client, plan: list[Batch], workloads: dict[str, Workload], sampling: Sampling, out_dir: Path,
        progress: bool = True, on_batch=None) -> list[dict]:
    """Execute the plan, skipping journaled batches; returns every record (old and new)."""
    journal = Journal(out_dir)
    done = journal.load({b.key: len(b.items) for b in plan})
    todo = [b for b in plan if b.key not in done]
    bar = _bar(sum(len(b.items) for b in plan), sum(len(b.items) for b in plan if b.key in done), progress)
    if todo:
        client.prepare(list({b.condition.id: b.condition for b in plan}.values()))
    for batch in todo:
        if bar is not None:
            bar.set_postfix_str(f"{batch.segment} {batch.condition.id} {batch.phase}", refresh=False)
        records = run_batch(client, batch, workloads[batch.workload], sampling)
        journal.append(records)
        if bar is not None:
            bar.update(len(records))
        if on_batch is not None:
            on_batch(batch)
    if bar is not None:
        bar.close()
    return journal.records


def run_batch(client, batch: Batch, workload: Workload, sampling: Sampling) -> list[dict]:
    calls = calls_for(batch, workload, sampling)
    t0 = time.perf_counter()
    results, extra = client.run_batch(batch.condition, batch.items, calls)
    wall = time.perf_counter() - t0
    memory = client.memory()
    records = []
    for it, call, res in zip(batch.items, calls, results):
        rec = {"batch": batch.key, "phase": batch.phase, "segment": batch.segment, "workload": batch.workload,
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
    return {"workloads": [w.name for w in workloads], "conditions": [asdict(c) for c in conditions],
            "warmup": warmup, "requests": requests, "concurrency": concurrency,
            "sampling": asdict(sampling), "target": target}
