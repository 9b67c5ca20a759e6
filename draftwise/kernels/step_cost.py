"""The cost of one step as the engine runs it: seconds of a decoder forward over B rows of `width` tokens each
(the engine's padded verification: B sequences x [pending token, guesses...]), for B in 1..8 and width in 1..16.

Owns `StepCost` (the grid: measured cells, interpolation between them, the online correction), `measure_grid` (the
load-time timing on a scratch cache), the JSON cache of measured grids per machine, model and plan
(${DRAFTWISE_CACHE_DIR}/kernels/step_cost/<key>.json, as the autotuner's) and `format_grid` (`draftwise kernels`).

Load time: MEASURED_BATCHES x MEASURED_WIDTHS cells (a draft's grid, logits "last", also B = 1 at PROMPT_WIDTHS: what
its catch-up of a prompt costs; `catch_up` reads it) (20 forwards a round, ROUNDS rounds or more while they fit
BUDGET_S, interleaved; each cell keeps its fastest round, then the least of itself and every larger cell: load only
adds time) after CONTEXT tokens per row (slot 0 prefilled once, the other rows map its
blocks). Other cells are piecewise-linear between measured ones (in width, then in B; extrapolated past the last).
A grid timed while other processes kept cores busy is `provisional`: used and cached, measured again at the next
start that finds the machine quiet.

Online: the engine reports every decode step's seconds for its (B, width) cell (`observe`); no extra forwards.
    cost(B, w) = base(B, w) * scale * resid(B, w)
`scale` (a load factor shared by every cell) moves SCALE_EWMA of the way to each step's ratio measured / predicted,
so cells the engine never visits follow the load too; `resid` (per measured cell, clamped to RESID_RANGE) takes
CELL_EWMA of what the scale leaves unexplained, shared among the measured cells around the observed one by their
interpolation weights, so a width that got dearer (fewer threads under load make wide steps dearer than narrow
ones) makes its neighbours dearer too, before the engine ever runs them. What a residual says grows stale while its
cells go unvisited: every other cell's residual relaxes RESID_RELAX of the way (in log) back to the measured shape
per observed step once it has gone FRESH_STEPS steps unvisited, so a width that a burst of load priced out of the
engine's steps (a policy that stops speculating never runs it again) is tried again once the burst is old, and
taught again if it is still dear, while a cell the engine visits now and then (the plain cell of a speculating batch:
the policy's paired plain steps) keeps what it was taught between visits.
Knows nothing of speculation, proposers or the engine: callers pass a decoder-like callable.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import asdict, is_dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from draftwise.paths import default_cache_dir

GRID_BATCHES = 8  # the grid's rows: B = 1..8 (larger batches extrapolate)
GRID_WIDTHS = 16  # the grid's columns: tokens per row 1..16
MEASURED_BATCHES = (1, 2, 4, 8)
MEASURED_WIDTHS = (1, 2, 4, 8, 16)
CONTEXT = 128  # tokens in each row's cache before the timed forwards (a typical request's; attention grows with it)
ROUNDS = 2  # interleaved rounds at load at least; each cell keeps its fastest ...
BUDGET_S = 2.0  # ... and more rounds (up to MAX_ROUNDS) while they fit this budget: a 1 ms cell a neighbour's
MAX_ROUNDS = 12  # time slice stalled (100+ ms on 2 busy cores) needs a few tries, a 100 ms one rarely does
SCALE_EWMA = 0.1  # per observed step: the load factor's move toward measured / predicted (~10 steps to follow)
CELL_EWMA = 0.2  # per observation of a cell: its residual's move
RESID_RANGE = (0.25, 4.0)  # a residual explains at most this much of a cell (the rest is load, the scale's)
RESID_RELAX = 0.01  # per observed step: an unvisited cell's residual's move back toward 1 (log; ~70 steps to halve)
FRESH_STEPS = 64  # ... once it has gone this many observed steps unvisited (a cell visited now and then stays taught)
PROMPT_WIDTHS = (64,)  # a draft's grid also times one row at a prompt's width: its catch-up (the prompt and the
# tokens decoded plainly before its first guess, ~100 tokens) runs the wide kernels, whose cost a token widths 1..16
# do not tell (logits "last" grids only: a verification never runs one row that wide); past 64 the 16..64 slope
# extrapolates (a 128-token cell would double what the draft's grid costs at load)
MEMO_CELLS = 4096  # predicted_base answers kept between observations (then dropped all at once)
VERSION = 2  # 2: the timed forwards carry spread-out token ids (1: token 0 everywhere)


class StepCost:
    """Seconds of one forward of B rows x width tokens: a measured base, corrected online by the engine's steps."""

    def __init__(self, base: dict[tuple[int, int], float], provisional: bool = False, info: dict | None = None):
        if not base:
            raise ValueError("a step-cost grid needs at least one measured cell")
        self.base = _monotone(base)  # (B, width) -> seconds, measured together (their ratios are what counts)
        self.batches = sorted({b for b, _ in self.base})
        self.widths = {b: sorted(w for bb, w in self.base if bb == b) for b in self.batches}
        self.provisional = provisional
        self.info = info or {}
        self.scale = 1.0  # the load factor, EWMA of measured / predicted over every observed step
        self.resid: dict[tuple[int, int], float] = {}  # per measured cell, EWMA of what the scale leaves over
        self.observations = 0
        self._visited: dict[tuple[int, int], int] = {}  # measured cell -> the observation that last visited it
        # predicted_base's answers and each row's corrected cells since the last observe (which alone moves `resid`):
        # a k policy reads the same cells many times a decision (its widths, each row's catch-up, the probe check)
        self._memo: dict[tuple, float | list[float]] = {}  # (B, width, corrected) -> seconds; (B, corrected) -> cells

    @classmethod
    def from_widths(cls, cost: dict[int, float]) -> StepCost:
        """A batch-1 curve (width -> seconds) as a grid whose rows cost what one row costs (tests, old callers)."""
        return cls({(1, w): s for w, s in cost.items()})

    # ---- reading ------------------------------------------------------------------------------------------
    def predicted_base(self, batch: int, width: int, corrected: bool = False) -> float:
        """The measured base at (batch, width): piecewise-linear in width at each measured B, then in B
        (`corrected`: each measured cell times its residual)."""
        key = (batch, width, corrected)
        hit = self._memo.get(key)
        if hit is None:
            if len(self._memo) >= MEMO_CELLS:  # a draft's grid goes unobserved while it idles: catch-ups vary
                self._memo.clear()
            lo, hi = _segment(self.batches, batch)
            around = self.batches[lo:hi + 1]  # the rows _interp reads: the others are not computed
            hit = self._memo[key] = _interp(around, [self._row(b, width, corrected) for b in around], batch)
        return hit

    def cost(self, batch: int, width: int) -> float:
        """Seconds of one step of `batch` rows x `width` tokens now (the corrected base x the load factor)."""
        return self.predicted_base(batch, width, corrected=True) * self.scale

    def __call__(self, batch: int, width: int) -> float:
        return self.cost(batch, width)

    def catch_up(self, tokens: int) -> float:
        """Seconds one row's forward spends on `tokens` more context tokens than a width-1 forward (a draft reading
        a prompt or the tokens decoded while it was idle, before its first guess): cost(1, 1 + tokens) - cost(1, 1),
        piecewise-linear between the measured widths (PROMPT_WIDTHS where the grid has them: a prompt's width runs
        the wide kernels, cheaper a token than widths 1..16 extrapolated), extrapolated past the widest."""
        if tokens <= 0:
            return 0.0
        return max(0.0, self.cost(1, 1 + tokens) - self.cost(1, 1))

    def grid(self, batches: int = GRID_BATCHES, widths: int = GRID_WIDTHS) -> dict[tuple[int, int], float]:
        """Every cell (B 1..batches, width 1..widths) as it costs now."""
        return {(b, w): self.cost(b, w) for b in range(1, batches + 1) for w in range(1, widths + 1)}

    def _row(self, b: int, width: int, corrected: bool = False) -> float:
        ws = self.widths[b]
        key = (b, corrected)  # the measured cells of row b (times their residuals), also kept until an observe
        cells = self._memo.get(key)
        if cells is None:
            cells = self._memo[key] = [self.base[(b, w)] * (self.resid.get((b, w), 1.0) if corrected else 1.0)
                                       for w in ws]
        return _interp(ws, cells, width)

    def _around(self, batch: int, width: int) -> list[tuple[tuple[int, int], float]]:
        """The measured cells around (batch, width) with their interpolation weights (the nearest beyond the edge)."""
        return [((b, w), wb * ww) for b, wb in _weights(self.batches, batch) for w, ww in _weights(self.widths[b], width)]

    # ---- the online correction ------------------------------------------------------------------------------
    def observe(self, batch: int, width: int, seconds: float) -> None:
        """One engine step of `batch` rows x `width` tokens took `seconds`: the load factor and the cell's residual
        move toward it (module docstring)."""
        base = self.predicted_base(batch, width)
        if not (seconds > 0 and base > 0 and math.isfinite(seconds)):
            return
        self._memo.clear()  # the residuals move
        self.scale *= (seconds / (base * self.scale)) ** SCALE_EWMA  # a uniform load change: all of it here
        left = math.log(seconds / (base * self.scale))  # what the load factor does not explain at this cell
        around = self._around(batch, width)
        visited = {cell for cell, _ in around}
        for cell, r in self.resid.items():  # long-unvisited cells' residuals go stale: back toward the measured shape
            if cell not in visited and self.observations - self._visited.get(cell, -FRESH_STEPS) >= FRESH_STEPS:
                self.resid[cell] = math.exp((1 - RESID_RELAX) * math.log(r))
        for cell, weight in around:
            self._visited[cell] = self.observations
            a = CELL_EWMA * weight
            r = math.exp((1 - a) * math.log(self.resid.get(cell, 1.0)) + a * left)
            self.resid[cell] = min(max(r, RESID_RANGE[0]), RESID_RANGE[1])
        self.observations += 1

    def to_dict(self) -> dict:
        return {"base": {f"{b},{w}": s for (b, w), s in sorted(self.base.items())},
                "provisional": self.provisional, **self.info}

    @classmethod
    def from_dict(cls, d: dict) -> StepCost:
        base = {tuple(int(x) for x in k.split(",")): float(v) for k, v in d["base"].items()}
        info = {k: v for k, v in d.items() if k not in ("base", "provisional")}
        return cls(base, bool(d.get("provisional")), info)


def _segment(xs: list[int], x: float) -> tuple[int, int]:
    """The indices of the two points of sorted xs that _interp reads for x (the nearest segment beyond the ends;
    (0, 0) for a single point)."""
    if len(xs) == 1:
        return 0, 0
    i = 1
    while i < len(xs) - 1 and xs[i] < x:
        i += 1
    return i - 1, i


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys) (sorted xs), extrapolated from the nearest segment, never below 0."""
    if len(xs) == 1:
        return ys[0]
    lo, i = _segment(xs, x)
    x0, x1, y0, y1 = xs[lo], xs[i], ys[lo], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def _weights(xs: list[int], x: float) -> list[tuple[int, float]]:
    """The points of sorted xs around x with their linear-interpolation weights; the nearest alone beyond the ends."""
    if x <= xs[0]:
        return [(xs[0], 1.0)]
    if x >= xs[-1]:
        return [(xs[-1], 1.0)]
    i = next(i for i in range(1, len(xs)) if xs[i] >= x)
    t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return [(xs[i - 1], 1.0 - t), (xs[i], t)] if t < 1.0 else [(xs[i], 1.0)]


def _monotone(base: dict[tuple[int, int], float]) -> dict[tuple[int, int], float]:
    """More rows or more tokens per row never cost less: a cell dearer than a larger one was slowed by load (load
    only adds time), so each cell is the least of itself and every cell at least as large."""
    return {(b, w): min(s for (bb, ww), s in base.items() if bb >= b and ww >= w) for (b, w) in base}


# ---- load-time measurement ---------------------------------------------------------------------------------

def measure_grid(model, max_batch: int = GRID_BATCHES, max_width: int = GRID_WIDTHS, logits: str = "all",
                 rounds: int = ROUNDS, context: int = CONTEXT,
                 prompt_widths: tuple[int, ...] = ()) -> dict[tuple[int, int], float]:
    """Time `model` (a Decoder: forward(ids [B, T], positions [B, T], cache, slots [B], ...)) at the measured
    cells up to (max_batch, max_width), and one row at each of `prompt_widths`, as the engine calls it
    (`num_tokens`; logits "all": every row's, a verification; "last": each row's last, a draft's forward), on a
    scratch cache; each cell its fastest round."""
    from draftwise.kv_cache import KVCache

    c, dev = model.config, model.device
    gen = torch.Generator().manual_seed(0)
    # seeded ids spread over the vocabulary, not one repeated token: a mixture of experts routes each row by its
    # token, and a forward whose rows all carry the same token touches only top-k experts per layer, far fewer
    # than a verification of real text reads (models/transformer.py SparseMoE; dense models time the same)
    tokens = lambda *shape: torch.randint(0, c.vocab_size, shape, generator=gen).to(dev)  # noqa: E731
    batches = sorted({b for b in MEASURED_BATCHES if b < max_batch} | {min(max_batch, MEASURED_BATCHES[-1])})
    widths = sorted({w for w in MEASURED_WIDTHS if w < max_width} | {min(max_width, MEASURED_WIDTHS[-1])})
    wide = sorted(w for w in prompt_widths if widths[-1] < w <= c.max_position_embeddings // 2)  # room for context
    widest = max([widths[-1], *wide])
    context = max(1, min(context, c.max_position_embeddings - widest - 1))
    cache = KVCache(c.num_layers, batches[-1], c.num_kv_heads, context + widest + 1, c.head_dim, model.dtype, dev)
    model(tokens(1, context), torch.arange(context, device=dev)[None], cache,
          torch.tensor([0], device=dev), last_only=True, num_tokens=[context])
    whole = context - context % cache.block_size
    for s in range(1, batches[-1]):  # the other rows read slot 0's keys (shared blocks, written past them only)
        cache.share(s, cache.blocks(0, whole), whole)
        if whole < context:
            model(tokens(1, context - whole),
                  torch.arange(whole, context, device=dev)[None], cache, torch.tensor([s], device=dev),
                  last_only=True, num_tokens=[context - whole])

    def timed(b: int, w: int) -> float:
        for s in range(b):
            cache.truncate(s, context)
        ids = tokens(b, w)  # [b, w]
        pos = context + torch.arange(w, device=dev)[None].expand(b, w)
        kw = {"logit_index": torch.full((b,), w - 1, device=dev)} if logits == "last" else {}
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        model(ids, pos, cache, torch.arange(b, device=dev), num_tokens=[w] * b, **kw)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    timed(1, 1)  # warm-up: first-call allocations
    cells = [(b, w) for b in batches for w in widths] + [(1, w) for w in wide]
    best = {cell: float("inf") for cell in cells}
    t0, done = time.perf_counter(), 0
    while done < rounds or (done < MAX_ROUNDS and time.perf_counter() - t0 < BUDGET_S * done / (done + 1)):
        for cell in cells:
            best[cell] = min(best[cell], timed(*cell))
        done += 1
    return best


def _model_key(model, logits: str, context: int, prompt_widths: tuple[int, ...] = ()) -> str:
    from draftwise.kernels.probe import probe

    p = probe(bandwidth=False)
    cfg = asdict(model.config) if is_dataclass(model.config) else dict(vars(model.config))
    plan = getattr(model, "plan", None)
    what = {"flags": sorted(k for k, v in p.get("flags", {}).items() if v), "cpu": p.get("cpu"),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(model.device),
            "config": cfg, "dtype": str(model.dtype), "plan": plan.to_dict() if hasattr(plan, "to_dict") else None,
            "logits": logits, "context": context, "cells": [MEASURED_BATCHES, MEASURED_WIDTHS, ROUNDS]}
    if prompt_widths:  # (a grid without them keeps its key: the target's cached grids stay valid)
        what["prompt_widths"] = list(prompt_widths)
    return hashlib.sha256((json.dumps(what, sort_keys=True, default=str) + f"v{VERSION}").encode()).hexdigest()[:20]


def cache_path(key: str) -> Path:
    return Path(default_cache_dir()) / "kernels" / "step_cost" / f"{key}.json"


def load_or_measure(model, max_batch: int = GRID_BATCHES, max_width: int = GRID_WIDTHS, logits: str = "all",
                    refresh: bool = False, cache: bool = True) -> StepCost:
    """The model's grid from the cache (this machine, model, plan, threads), else measured now and cached; a
    provisional entry is measured again when the machine is quiet. Cells up to (max_batch, max_width) at least
    (a cached grid measured wider serves a narrower ask); a draft's (logits "last") also one row at PROMPT_WIDTHS."""
    from draftwise.kernels.threads import busy_meter, busy_now, is_busy

    prompt_widths = PROMPT_WIDTHS if logits == "last" else ()
    key = _model_key(model, logits, CONTEXT, prompt_widths)
    path = cache_path(key)
    cached = None
    if cache and not refresh:
        try:
            cached = StepCost.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            cached = None
        if cached is not None and not _covers(cached, max_batch, max_width):
            cached = None
    cpu = model.device.type == "cpu"
    if cached is not None and (not cached.provisional or not cpu or is_busy(busy_now())):
        return cached
    others = busy_meter() if cpu else (lambda: None)
    base = measure_grid(model, max(max_batch, 1), max(max_width, 1), logits, prompt_widths=prompt_widths)
    busy = others()
    grid = StepCost(base, provisional=is_busy(busy),
                    info={"key": key, "busy_cores": busy,
                          "measured_at": datetime.now(timezone.utc).isoformat(timespec="seconds")})
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(grid.to_dict(), indent=1))
        os.replace(tmp, path)
    return grid


def load_now(model, grid: StepCost, logits: str = "all") -> float:
    """How much dearer `model`'s one-row width-1 forward is now than `grid` (its grid, maybe cached from another
    moment) says: measured (1, 1) / the grid's base (1, 1), a few forwards on a scratch cache. Two grids timed at
    different loads (a provisional one: other processes busy while it was timed) have cells in different units;
    the ratio of two models' load_now, timed together, is what one's cells cost in the other's."""
    return measure_grid(model, 1, 1, logits)[(1, 1)] / grid.base[(1, 1)]


def _covers(grid: StepCost, max_batch: int, max_width: int) -> bool:
    """(PROMPT_WIDTHS are in the cache key: an entry under a draft's key was measured with them, where they fit.)"""
    want_b = min(max_batch, MEASURED_BATCHES[-1])
    want_w = min(max_width, MEASURED_WIDTHS[-1])
    return grid.batches[-1] >= want_b and all(grid.widths[b][-1] >= want_w for b in grid.batches)


def format_grid(grid: StepCost, title: str, batches: int = GRID_BATCHES, widths: int = GRID_WIDTHS) -> str:
    """ms per step, rows B = 1..batches, columns width = 1..widths; measured cells plain, interpolated in (),
    and per B the cost of a row's token relative to a plain step of that batch (width 1)."""
    head = f"{title}: ms per step (B rows x width tokens per row; (..) interpolated between measured cells)"
    lines = [head, "  B\\w " + "".join(f"{w:>8d}" for w in range(1, widths + 1)) + "   w16/w1"]
    for b in range(1, batches + 1):
        cells = []
        for w in range(1, widths + 1):
            ms = grid.cost(b, w) * 1e3
            cells.append(f"{ms:8.1f}" if (b, w) in grid.base else f"{'(' + format(ms, '.1f') + ')':>8s}")
        ratio = grid.cost(b, widths) / grid.cost(b, 1)
        lines.append(f"  {b:3d} " + "".join(cells) + f"   {ratio:6.2f}x")
    tail = [f"  a plain step of 8 rows costs {grid.cost(8, 1) / grid.cost(1, 1):.2f}x one row's; "
            f"8 rows x 9 tokens (k = 8 each) {grid.cost(8, 9) / grid.cost(8, 1):.2f}x a plain step of 8"]
    wide = [w for w in grid.widths[1] if w > widths]
    if wide:
        tail.append("  one row at a prompt's width (a draft's catch-up): " + ", ".join(
            f"{w} tokens {grid.cost(1, w) * 1e3:.1f} ms" for w in wide)
            + f"; {grid.catch_up(wide[-1] - 1) / (wide[-1] - 1) * 1e3:.2f} ms a catch-up token"
            + f" (widths 1..{widths} extrapolated: {grid.catch_up(widths - 1) / (widths - 1) * 1e3:.2f})")
    if grid.info.get("measured_at"):
        busy = grid.info.get("busy_cores")
        tail.append(f"  timed {grid.info['measured_at']}" + (f" with {busy:.1f} other cores busy" if busy else "")
                    + ("; PROVISIONAL (timed under load; re-timed at the next quiet start)" if grid.provisional else ""))
    return "\n".join(lines + tail)
