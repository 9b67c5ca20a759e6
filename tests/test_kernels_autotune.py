"""`--weights auto` a user can trust (kernels/autotune.py, kernels/plan.py): a kernel is a candidate only if every
row of every forward the engine may run is bitwise the row alone (widths of one sequence, batches of mixed widths,
every thread count the guard may choose), and the check fails on kernels planted to depend on the width or on the
thread count; one plan per machine and shapes at a time (a file lock), and a plan timed under load is provisional
until a quiet start re-tunes it."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from draftwise.kernels import autotune
from draftwise.kernels.linear import LINEARS, LinearImpl
from draftwise.kernels.plan import KernelPlan
from draftwise.kernels.probe import probe
from draftwise.kv_cache import KVCache
from draftwise.models.quant import build_linears
from draftwise.paths import default_cache_dir
from tests.tiny_models import tiny_decoder

MAX_NUM_SEQS = 8
K_MAX = 8


class _RowByRow(LinearImpl):
    """Exact by construction: every row is its own 1-row product (a planted kernel's honest base)."""

    name = "row_by_row"
    dtype = "float32"
    row_exact = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):  # weight [N, K], bias [N]
        super().__init__()
        self._weight_shape(weight)
        self.register_buffer("weight", weight.detach().float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous())

    @classmethod
    def nbytes(cls, N: int, K: int, bias: bool = False) -> int:
        return 4 * N * (K + bias)

    def exact(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        flat = x.reshape(-1, x.shape[-1]).float()  # [M, K]
        rows = [(r[None] * self.weight).sum(-1) for r in flat]  # one fixed reduction per row: [N] each
        out = torch.stack(rows) if rows else flat.new_zeros(0, self.out_features)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        return self.exact(x)


def _nudge(out: torch.Tensor) -> torch.Tensor:
    """The last bit of every output moved: what a different GEMM algorithm does to a row."""
    return torch.nextafter(out, torch.full_like(out, math.inf))


class _WidthDependent(_RowByRow):
    """Planted: exact up to 32 rows, another 'algorithm' above (oneDNN's bf16 GEMM on AMX did this at 33 rows)."""

    name = "planted_width"

    def forward(self, x):
        out = self.exact(x)
        return _nudge(out) if x.reshape(-1, x.shape[-1]).shape[0] > 32 else out


class _ThreadDependent(_RowByRow):
    """Planted: exact at one thread, a split reduction at more."""

    name = "planted_threads"

    def forward(self, x):
        out = self.exact(x)
        return _nudge(out) if torch.get_num_threads() > 1 else out


PLANTED = {c.name: c for c in (_WidthDependent, _ThreadDependent)}


@pytest.fixture
def planted(monkeypatch):
    for name, cls in {**PLANTED, "row_by_row": _RowByRow}.items():
        monkeypatch.setitem(LINEARS, name, cls)
    return PLANTED


# ---- the linear-level check ---------------------------------------------------------------------------------

def test_rows_exact_fails_on_planted_width_and_thread_dependence(planted):
    w = torch.randn(24, 32)
    widths, threads = range(1, autotune.EXACT_STEP_ROWS + 1), [1, 2]
    assert autotune.rows_exact(_RowByRow(w), 32, widths, threads) is None
    assert autotune.rows_exact(_WidthDependent(w), 32, widths, threads) == "row 0 of 33 at 1 thread"
    assert autotune.rows_exact(_ThreadDependent(w), 32, widths, threads) == "row 0 of 1 at 2 threads"
    assert autotune.rows_exact(_ThreadDependent(w), 32, widths, [1]) is None  # why every thread count is checked


def test_measure_marks_planted_kernels_and_choose_never_takes_them_even_when_fastest(planted):
    shapes = [autotune.ProjShape("a", 24, 32, 2), autotune.ProjShape("head", 40, 32, 1)]
    names = ["row_by_row", *planted]
    table = autotune.measure(shapes, names, rows=(1, 9), prefill_rows=16, samples=1, cold=False, progress=False,
                             registry={n: LINEARS[n] for n in names}, exact_threads=[1, 2])
    exact = table["row_exact"]
    assert exact["row_by_row"] == {"step": True, "prefill": True, "why": {}}
    assert exact["planted_width"]["step"] is False and exact["planted_width"]["prefill"] is False
    assert "of 33 at 1 thread" in exact["planted_width"]["why"]["step"]
    assert exact["planted_threads"]["step"] is False and "at 2 threads" in exact["planted_threads"]["why"]["step"]
    fast = {n: ({r: v / 100 for r, v in c.items()} if n in planted else c) for n, c in table["ms"].items()}
    choice = autotune.choose({**table, "ms": fast})
    assert choice["step"] == "row_by_row" and choice["prefill"] == "row_by_row" and choice["row_exact"]
    assert "not row-exact at the step widths" in autotune.format_table(table, choice)


# ---- the engine-level check: what the linear-level one must predict --------------------------------------------

def batch_mismatch(model, threads=(1, 2), max_num_seqs: int = MAX_NUM_SEQS, k_max: int = K_MAX) -> str | None:
    """Run 1..max_num_seqs sequences of mixed widths (1..k_max + 1 tokens each, as verification batches do) at each
    thread count; None when every sequence's logits equal that sequence run alone at 1 thread, else which did not."""
    c = model.config
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, c.vocab_size, (3 + i,), generator=g) for i in range(max_num_seqs)]
    steps = [torch.randint(0, c.vocab_size, (1 + (3 * i) % (k_max + 1),), generator=g) for i in range(max_num_seqs)]
    cache = KVCache(c.num_layers, max_num_seqs, c.num_kv_heads, 64, c.head_dim, model.dtype, "cpu")
    before = torch.get_num_threads()

    def run(seqs: list[int]) -> torch.Tensor:  # -> logits [len(seqs), width, V]
        width = max(len(steps[i]) for i in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.int64)
        pos = torch.zeros(len(seqs), width, dtype=torch.int64)
        for row, i in enumerate(seqs):
            cache.truncate(i, len(prompts[i]))
            ids[row, :len(steps[i])] = steps[i]
            pos[row] = len(prompts[i]) + torch.arange(width)
        return model(ids, pos, cache, torch.tensor(seqs), num_tokens=[len(steps[i]) for i in seqs])

    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            for i, p in enumerate(prompts):
                model(p[None], torch.arange(len(p))[None], cache, torch.tensor([i]), num_tokens=[len(p)])
            alone = {i: run([i])[0, :len(steps[i])] for i in range(max_num_seqs)}
            for t in threads:
                torch.set_num_threads(t)
                for b in range(1, max_num_seqs + 1):
                    seqs = [(b + j) % max_num_seqs for j in range(b)]
                    out = run(seqs)
                    for row, i in enumerate(seqs):
                        if not torch.equal(out[row, :len(steps[i])], alone[i]):
                            return f"sequence {i} ({len(steps[i])} tokens) in a batch of {b} at {t} threads"
    finally:
        torch.set_num_threads(before)
    return None


def _built(name: str, seed: int = 0):
    dtype = LINEARS[name].dtype
    model = tiny_decoder("qwen2", seed=seed, vocab_size=64, dtype=getattr(torch, dtype))
    build_linears(model, KernelPlan(name, name, dtype, "cpu", "ours", "pinned"))
    return model


def test_every_candidate_auto_may_choose_keeps_batched_rows_exact_and_planted_ones_are_refused(planted):
    """Every kernel the load-time tuner times here, checked on the tiny model's shapes: those found row-exact (the
    only ones `auto` may choose) give every sequence of a mixed-width batch its own logits at 1 and 2 threads; the
    planted kernels are found not row-exact AND this engine-level check catches them, so it is not vacuous."""
    shapes = autotune.shapes_from_config(tiny_decoder("qwen2", vocab_size=64).config)
    names = [*autotune.load_candidates(probe(bandwidth=False)), "row_by_row", *planted]
    table = autotune.measure(shapes, names, rows=(1, 9), prefill_rows=16, samples=1, cold=False, progress=False,
                             registry={n: LINEARS[n] for n in names}, exact_threads=[1, 2])
    allowed = [n for n in names if table["row_exact"][n]["step"]]
    assert "row_by_row" in allowed and not set(planted) & set(allowed)
    if "q4x8" in names:
        assert "q4x8" in allowed
    for name in allowed:
        assert batch_mismatch(_built(name)) is None, name
    assert batch_mismatch(_built("planted_width")) is not None
    assert batch_mismatch(_built("planted_threads")) is not None


# ---- one plan at a time, quiet or provisional --------------------------------------------------------------------

def _fake_measure(calls):
    ms = {"fp32": {1: 2.0, 9: 2.0, 128: 10}, "q4x8": {1: 1.0, 9: 1.0, 128: 30}}
    exact = {n: {"step": True, "prefill": True, "why": {}} for n in ms}
    return lambda shapes, **kw: calls.append(kw) or {"rows": [1, 9, 128], "prefill_rows": 128, "ms": ms,
                                                     "row_exact": exact, "spread": {}}


def test_a_plan_timed_under_load_is_provisional_until_a_quiet_start_retunes_it(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTWISE_CACHE_DIR", str(tmp_path))
    shapes = autotune.decoder_shapes(64, 128, 2, 1, 32, 2, 256)
    calls, load = [], {"before": 1.2, "during": 1.0}
    monkeypatch.setattr(autotune, "measure", _fake_measure(calls))
    monkeypatch.setattr(autotune, "busy_now", lambda: load["before"])
    monkeypatch.setattr(autotune, "busy_meter", lambda: lambda: load["during"])
    busy = autotune.autotune(shapes, progress=False)
    assert busy["provisional"] and not busy["cached"] and len(calls) == 1
    again = autotune.autotune(shapes, progress=False)  # still busy: the provisional plan is used, not re-timed
    assert again["provisional"] and again["cached"] and len(calls) == 1
    load.update(before=0.1, during=0.2)
    quiet = autotune.autotune(shapes, progress=False)  # the next quiet start measures again and keeps that
    assert not quiet["provisional"] and not quiet["cached"] and len(calls) == 2
    assert quiet["busy_before"] == 0.1 and quiet["busy_cores"] == 0.2 and quiet["measured_at"]
    load.update(before=1.5, during=1.5)
    kept = autotune.autotune(shapes, progress=False)  # a quiet plan is never replaced by a busy start
    assert kept["cached"] and not kept["provisional"] and len(calls) == 2
    autotune.autotune(shapes, progress=False, refresh=True)  # `draftwise kernels --refresh`: always measures
    assert len(calls) == 3
    load.update(before=0.0, during=0.9)  # load that arrives during the timing counts too
    assert autotune.autotune(shapes, progress=False, refresh=True)["provisional"]


def test_provisional_plans_say_so_in_the_plan_and_its_load_line(monkeypatch, tmp_path):
    from draftwise.kernels.plan import resolve_plan

    monkeypatch.setenv("DRAFTWISE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(autotune, "measure", _fake_measure([]))
    monkeypatch.setattr(autotune, "busy_now", lambda: 1.0)
    monkeypatch.setattr(autotune, "busy_meter", lambda: lambda: 1.0)
    cfg = tiny_decoder("qwen2", vocab_size=64).config
    plan = resolve_plan("auto", "auto", cfg, tune=lambda s: autotune.autotune(s, progress=False))
    assert plan.provisional and plan.source == "tuned" and plan.step == "q4x8"
    d = plan.to_dict()
    assert d["provisional"] and d["tuning"]["busy_before"] == 1.0 and d["tuning"]["measured_at"]
    assert "PROVISIONAL" in plan.describe() and "1.0 other cores busy" in plan.describe()


def test_the_tuning_lock_makes_a_second_process_wait(tmp_path):
    """flock is per open file: while this process holds an entry's lock, a second process waits and says who it
    waits for; it goes on once the lock is released."""
    path = tmp_path / "kernels" / "autotune" / "key.json"
    code = ("import sys; from pathlib import Path; from draftwise.kernels import autotune as a\n"
            "a.LOCK_REPORT_S = 0.2\n"
            "with a.tuning_lock(Path(sys.argv[1])): print('got it')")
    with autotune.tuning_lock(path):
        child = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        said = child.stderr.readline()  # blocks until the child reports waiting (EOF if it never waited)
        assert "waiting" in said and f"pid {os.getpid()}" in said
        assert child.poll() is None  # still waiting while the lock is held
    out, _ = child.communicate(timeout=120)
    assert child.returncode == 0 and out.strip() == "got it"


def _cache_with_built_kernels(root: Path) -> Path:
    """An empty autotune cache beside the already built C++ library (no 40 s rebuild per process)."""
    from draftwise.kernels import q4x8

    (root / "kernels").mkdir(parents=True)
    try:
        q4x8.build()
    except Exception:  # noqa: BLE001 - no compiler: the processes run without q4x8, the test still holds
        return root
    for entry in (Path(default_cache_dir()) / "kernels").iterdir():
        if entry.name != "autotune":
            (root / "kernels" / entry.name).symlink_to(entry)
    return root


def test_two_processes_loading_at_once_under_load_report_the_same_provisional_plan(tmp_path, tiny_hf_dir):
    cache = _cache_with_built_kernels(tmp_path / "cache")
    env = {**os.environ, "DRAFTWISE_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    code = ("import json, sys; from draftwise.api import load_model\n"
            "print(json.dumps(load_model(sys.argv[1])[2]['plan']))")
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        loaders = [subprocess.Popen([sys.executable, "-c", code, str(tiny_hf_dir)], env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
        outs = [p.communicate(timeout=600) for p in loaders]
    finally:
        burner.kill()
        burner.wait()
    for p, (out, err) in zip(loaders, outs):
        assert p.returncode == 0, err[-2000:]
    plans = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert {(p["step"], p["prefill"]) for p in plans} == {(plans[0]["step"], plans[0]["prefill"])}
    assert all(p["provisional"] for p in plans)
    assert sorted(p["source"] for p in plans) == ["cached", "tuned"]  # one timed, the other waited and used it
    assert len(list((cache / "kernels" / "autotune").glob("*.json"))) == 1
