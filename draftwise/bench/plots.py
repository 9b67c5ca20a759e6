"""PNG plots for the report (matplotlib, Agg backend): latency distributions, tok/s, acceptance by position.

Owns figure layout only: one PNG per kind, one panel per segment, conditions in the report's order. Reads
the report's figures and per-request samples; knows nothing of how they were measured.
"""
from __future__ import annotations

from pathlib import Path


def _figure(n_panels: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n_panels, figsize=(max(5.0, 4.5 * n_panels), 3.8), squeeze=False)
    return plt, fig, axes[0]


def plot_all(report: dict, out_dir: Path) -> list[str]:
    segs = report["segments"]
    if not segs:
        return []
    names = []
    for fname, draw in (("latency.png", _latency), ("tok_s.png", _tok_s), ("acceptance.png", _acceptance)):
        plt, fig, axes = _figure(len(segs))
        drawn = [draw(ax, name, seg) for ax, (name, seg) in zip(axes, segs.items())]
        if any(drawn):
            fig.tight_layout()
            fig.savefig(Path(out_dir) / fname, dpi=90)
            names.append(fname)
        plt.close(fig)
    return names


def _latency(ax, name: str, seg: dict) -> bool:
    conds = list(seg["conditions"])
    data = [seg["samples"][c]["e2e_s"] for c in conds]
    if not any(data):
        return False
    ax.boxplot([d or [0] for d in data], tick_labels=conds, whis=(5, 95))
    ax.set_title(f"{name}: E2E latency (s)")
    ax.tick_params(axis="x", rotation=30)
    return True


def _tok_s(ax, name: str, seg: dict) -> bool:
    conds = list(seg["conditions"])
    med = [seg["conditions"][c]["tok_s"]["median"] or 0 for c in conds]
    agg = [seg["conditions"][c]["aggregate_tok_s"] or 0 for c in conds]
    xs = range(len(conds))
    ax.bar([x - 0.2 for x in xs], med, width=0.4, label="median per request")
    ax.bar([x + 0.2 for x in xs], agg, width=0.4, label="aggregate")
    ax.set_xticks(list(xs), conds, rotation=30)
    ax.set_title(f"{name}: output tok/s")
    ax.legend(fontsize=8)
    return True


def _acceptance(ax, name: str, seg: dict) -> bool:
    drawn = False
    for c, f in seg["conditions"].items():
        by_pos = (f.get("spec") or {}).get("acceptance_by_position") or []
        if by_pos:
            ax.plot(range(1, len(by_pos) + 1), by_pos, marker="o", label=c)
            ax.set_xticks(range(1, len(by_pos) + 1))
            drawn = True
    ax.set_title(f"{name}: accepted / drafts, by position")
    ax.set_xlabel("position in draft")
    ax.set_ylim(0, 1.05)
    if drawn:
        ax.legend(fontsize=8)
    return drawn
