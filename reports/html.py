"""Self-contained HTML report of retention vs. budget (inline SVG, no scripts, no external resources).

Aggregates only: the report and its JSON hold no subject or stay identifiers.
"""
import html
import json
import math
from pathlib import Path

COLORS = {"sv_certified": "#c0392b", "sv_learned": "#e67e22", "recency": "#2c3e50", "softmax_h2o": "#2980b9", "residual_delta": "#27ae60",
          "random": "#8e44ad"}
TITLES = {"det_retention_end": "Deterioration hours kept at end of stay",
          "det_retention_hour_end": "Deterioration hours held at each hour's end",
          "rare_recall": "Rare-item recall", "output_deviation": "Readout deviation from full context",
          "certified_fraction": "Certified evictions (SV selection)"}


def _fixed_budgets(summary):
    return sorted({int(r["budget"]) for r in summary if r["budget"].isdigit()})


def _chart(summary, metric, width=460, height=260, pad=46):
    budgets = _fixed_budgets(summary)
    rows = [r for r in summary if r["metric"] == metric and r["budget"].isdigit()]
    if not rows or len(budgets) < 1:
        return ""
    ymax = max(1.0, max(r["ci_high"] for r in rows)) if metric != "output_deviation" else \
        max(r["ci_high"] for r in rows) * 1.1 or 1.0
    lx = [math.log2(b) for b in budgets]
    x0, x1 = min(lx), max(lx) if max(lx) > min(lx) else min(lx) + 1

    def X(b):
        return pad + (math.log2(b) - x0) / (x1 - x0) * (width - 2 * pad)

    def Y(v):
        return height - pad + -(v / ymax) * (height - 2 * pad)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{html.escape(TITLES.get(metric, metric))}">',
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#555"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#555"/>']
    for b in budgets:
        parts.append(f'<text x="{X(b):.1f}" y="{height - pad + 16}" font-size="11" text-anchor="middle">{b}</text>')
    for k in range(5):
        v = ymax * k / 4
        parts.append(f'<text x="{pad - 6}" y="{Y(v) + 4:.1f}" font-size="11" text-anchor="end">{v:.2g}</text>')
        parts.append(f'<line x1="{pad}" y1="{Y(v):.1f}" x2="{width - pad}" y2="{Y(v):.1f}" stroke="#eee"/>')
    parts.append(f'<text x="{width / 2}" y="{height - 8}" font-size="11" text-anchor="middle">budget B (events)'
                 f'</text>')
    for pol in sorted({r["policy"] for r in rows}):
        pr = sorted((r for r in rows if r["policy"] == pol), key=lambda r: int(r["budget"]))
        color = COLORS.get(pol, "#777")
        band = [(X(int(r["budget"])), Y(r["ci_high"])) for r in pr] + \
               [(X(int(r["budget"])), Y(r["ci_low"])) for r in reversed(pr)]
        parts.append(f'<polygon points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in band)}" fill="{color}" '
                     f'fill-opacity="0.15" stroke="none"/>')
        line = " ".join(f"{X(int(r['budget'])):.1f},{Y(r['mean']):.1f}" for r in pr)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2">'
                     f'<title>{html.escape(pol)}</title></polyline>')
    parts.append("</svg>")
    return "".join(parts)


def _legend(policies):
    return " ".join(f'<span style="color:{COLORS.get(p, "#777")}">&#9632; {html.escape(p)}</span>'
                    for p in policies)


def _table(summary, paired, metric):
    budgets = sorted({r["budget"] for r in summary if r["metric"] == metric},
                     key=lambda b: (not b.isdigit(), float(b.lstrip("f"))))
    policies = sorted({r["policy"] for r in summary if r["metric"] == metric})
    idx = {(r["budget"], r["policy"]): r for r in summary if r["metric"] == metric}
    pidx = {(r["budget"], r["baseline"]): r for r in paired if r["metric"] == metric}
    head = "".join(f"<th>{html.escape(p)}</th>" for p in policies)
    body = []
    for b in budgets:
        cells = []
        for p in policies:
            r = idx.get((b, p))
            if r is None:
                cells.append("<td></td>")
                continue
            d = pidx.get((b, p))
            extra = (f"<br><small>SV&minus;this {d['mean_diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]"
                     f" p={d['p_value']:.3g}</small>") if d else ""
            cells.append(f"<td>{r['mean']:.3f} <small>[{r['ci_low']:.3f}, {r['ci_high']:.3f}] n={r['n']}</small>"
                         f"{extra}</td>")
        label = f"{b} events" if b.isdigit() else f"{float(b[1:]):.0%} of stream"
        body.append(f"<tr><th>{label}</th>{''.join(cells)}</tr>")
    return f"<table><tr><th>budget</th>{head}</tr>{''.join(body)}</table>"


def render_report(result, out_dir):
    """Write report.html and report.json into ``out_dir``; returns the HTML path.

    ``result``: dict with summary, paired, cohort, metadata (see flows.jobs.evaluate_store).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary, paired = result["summary"], result["paired"]
    policies = sorted({r["policy"] for r in summary})
    sections = []
    for metric in ("det_retention_end", "det_retention_hour_end", "rare_recall", "output_deviation",
                   "certified_fraction"):
        if not any(r["metric"] == metric for r in summary):
            continue
        sections.append(f"<section><h2>{html.escape(TITLES[metric])}</h2>{_chart(summary, metric)}"
                        f"<p>{_legend(policies)}</p>{_table(summary, paired, metric)}</section>")
    cohort_rows = "".join(f"<tr><th>{html.escape(k.replace('_', ' '))}</th><td>{v}</td></tr>"
                          for k, v in result["cohort"].items())
    meta_rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>"
                        for k, v in result["metadata"].items())
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Forgetful retention report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:.5em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left;
vertical-align:top}}small{{color:#555}}section{{margin-bottom:2em}}</style></head>
<body><h1>Forgetful: retention vs. memory budget</h1>
<p>Every evaluation stay's events were streamed in time order through each policy at the same budget.
Means over stays with 95% percentile-bootstrap intervals; &ldquo;SV&minus;this&rdquo; is the paired difference
of certified SV selection minus that policy, with a sign-flip permutation p-value. Aggregates only.</p>
<h2>Cohort</h2><table>{cohort_rows}</table>
{''.join(sections)}
<h2>Run</h2><table>{meta_rows}</table>
</body></html>"""
    path = out / "report.html"
    path.write_text(doc, encoding="utf-8")
    (out / "report.json").write_text(json.dumps(result, indent=1, default=str))
    return path
