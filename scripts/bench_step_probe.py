"""Per decode step, what the auto-k policy predicted against what the step took: `draftwise bench ...` run in this
process with the policy's decision, the target's verify forward, the draft's forwards and the step wrapped, every
record written to --records as JSON, then a summary per (batch size, guessing or plain): predicted vs measured verify,
draft and tokens, and at 4 rows the plain step as priced at guessing decisions against plain steps forced now and
then (every --force-every-th 4-row guessing step runs plain instead, not taught to the policy). What found the
plain price at a guessing decision 13-19% above the engine's plain steps (docs/PERFORMANCE.md, 2026-12-07 second
session, issue 44).

    python scripts/bench_step_probe.py --records /tmp/steps.json --force-every 8 -- bench --workload chat \\
        --methods none,draft_model --num-speculative-tokens auto --concurrency 4 --requests 30 --warmup 1 \\
        --out /tmp/probe --fresh --no-plots --no-humaneval

A script, not part of the package (nothing under draftwise/ imports it); it wraps private methods of the engine and
the policy, so it follows them when they change.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics as st
import sys
import time


def install(rec: list, force_every: int) -> None:
    """Wrap the engine's decode step and verify forward, the draft's forward and the policy's decision and
    observation so that each decode step appends one record to `rec`."""
    from draftwise import engine as E
    from draftwise.spec_decode import adaptive as A
    from draftwise.spec_decode.draft_model import DraftModelProposer

    cur, fw, state = {}, [], {"in_decode": False, "n": 0}
    choose, forward, verify = A.AdaptiveK.choose_batch, DraftModelProposer._forward, E.Engine._verify_forward
    observe, decode_step = A.AdaptiveK.observe_step, E.Engine._decode_step

    def choose_batch(pol, reqs, caps=None, guessing=None):
        if not state["in_decode"]:
            return choose(pol, reqs, caps, guessing)
        rids = [r.request_id for r in reqs]
        behind = [pol._behind.get(rid, len(r.prompt_ids) + 1) for rid, r in zip(rids, reqs)]
        remaining = [pol.remaining(r) if rid in pol._behind else 1 for rid, r in zip(rids, reqs)]
        alphas = [pol.acceptance(r) for r in reqs]
        ks = choose(pol, reqs, caps, guessing)
        e, verify_s, forward_s, _ = pol._rate_of(alphas, max(max(ks), 1), behind, remaining).parts

        def parts(kk):
            d = sum(forward_s[b] for b in A.forward_rows(kk)) if forward_s else 0.0
            return dict(verify=A._at(verify_s, pol.verify_width(kk)), draft=d,
                        tokens=sum(e[i][k] for i, k in enumerate(kk)))
        forced = False
        if force_every and len(reqs) == 4 and any(ks):
            state["n"] += 1
            if state["n"] % force_every == 0:  # this step runs plain: its rows fall one more token behind
                forced = True
                for i, rid in enumerate(rids):
                    if ks[i]:
                        pol._behind[rid] = behind[i] + 1
        cur.update(B=len(reqs), ks=list(ks), forced=forced, alphas=alphas, pred=parts(ks),
                   pred_plain=parts([0] * len(reqs)))
        return [0] * len(ks) if forced else ks

    def timed_forward(self, slots, new_tokens):
        w = time.perf_counter()
        out = forward(self, slots, new_tokens)
        fw.append(time.perf_counter() - w)
        return out

    def timed_verify(self, reqs, drafts):
        w = time.perf_counter()
        out = verify(self, reqs, drafts)
        cur["verify_wall"] = time.perf_counter() - w
        return out

    def observe_step(pol, batch, width, step_s, propose_s, k_per_seq):
        cur["step_s"], cur["propose_s"] = step_s, propose_s
        if not cur.get("forced"):
            observe(pol, batch, width, step_s, propose_s, k_per_seq)

    def timed_decode_step(self, reqs):
        cur.clear()
        fw.clear()
        before = [len(r.output_ids) for r in reqs]
        state["in_decode"] = True
        w = time.perf_counter()
        try:
            out = decode_step(self, reqs)
        finally:
            state["in_decode"] = False
        cur.setdefault("B", len(reqs))
        cur.update(decode_wall=time.perf_counter() - w, policy=type(self.k_policy).__name__,
                   emitted=[len(r.output_ids) - b for r, b in zip(reqs, before)], draft_fw=list(fw),
                   load=os.getloadavg()[0])
        rec.append(dict(cur))
        return out

    A.AdaptiveK.choose_batch, A.AdaptiveK.observe_step = choose_batch, observe_step
    DraftModelProposer._forward, E.Engine._verify_forward = timed_forward, timed_verify
    E.Engine._decode_step = timed_decode_step


def summarize(rec: list) -> None:
    groups = collections.defaultdict(list)
    for r in rec:
        if "pred" not in r:
            continue
        kind = "forced" if r["forced"] else ("guess" if any(r["ks"]) else "plain")
        groups[(r["B"], kind)].append(r)
    print(f"load average {st.median(r['load'] for r in rec):.1f}; ms per step, means")
    for (B, kind), rs in sorted(groups.items()):
        p = [r["pred"] if kind == "guess" else r["pred_plain"] for r in rs]
        ms = lambda xs: 1e3 * st.mean(xs)  # noqa: E731
        print(f"B={B} {kind:6s} n={len(rs):4d}  verify predicted {ms(x['verify'] for x in p):6.1f} measured "
              f"{ms(r['verify_wall'] for r in rs):6.1f}  draft predicted {ms(x['draft'] for x in p):5.1f} "
              f"measured {ms(sum(r['draft_fw']) for r in rs):5.1f}  tokens predicted "
              f"{st.mean(x['tokens'] for x in p):.2f} measured {st.mean(sum(r['emitted']) for r in rs):.2f}  "
              f"decode step {ms(r['decode_wall'] for r in rs):6.1f}")
    guess, forced = groups.get((4, "guess"), []), groups.get((4, "forced"), [])
    if guess and forced:
        rate = lambda rs: sum(sum(r["emitted"]) for r in rs) / sum(r["decode_wall"] for r in rs)  # noqa: E731
        pg = st.mean(r["pred"]["tokens"] / (r["pred"]["verify"] + r["pred"]["draft"]) for r in guess)
        pp = st.mean(r["pred_plain"]["tokens"] / r["pred_plain"]["verify"] for r in guess)
        priced = 1e3 * st.mean(r["pred_plain"]["verify"] for r in guess)
        took = 1e3 * st.mean(r["decode_wall"] for r in forced)
        print(f"4 rows: a plain step priced {priced:.1f} ms at guessing decisions, forced plain steps took {took:.1f} "
              f"ms; guessing vs plain predicted {pg:.1f} vs {pp:.1f} tok/s ({pg / pp:.2f}x), measured "
              f"{rate(guess):.1f} vs {rate(forced):.1f} ({rate(guess) / rate(forced):.2f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", required=True, help="where every step's record is written (JSON)")
    ap.add_argument("--force-every", type=int, default=8, help="every n-th 4-row guessing step runs plain (0: none)")
    ap.add_argument("cli", nargs=argparse.REMAINDER, help="-- then the draftwise command line (bench ...)")
    args = ap.parse_args()
    from draftwise import cli

    rec: list = []
    install(rec, args.force_every)
    try:
        cli.main(args.cli[1:] if args.cli[:1] == ["--"] else args.cli)
    finally:
        with open(args.records, "w") as f:
            json.dump(rec, f)
        summarize(rec)


if __name__ == "__main__":
    sys.exit(main())
