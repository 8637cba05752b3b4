"""Self-contained HTML report of retention vs. budget (inline SVG, no scripts, no external resources).

Aggregates only: the report and its JSON hold no subject or stay identifiers.
"""
from __future__ import annotations

import dataclasses
import html
import json
import math
from pathlib import Path

from cohorts.characteristics import CohortTable, Count
from cohorts.endpoints import EXPLORATORY, FAMILIES, endpoint_of
from cohorts.results import SUPPORT, Budget, PairedRow, SummaryRow
from cohorts.stream_mode import StreamMode
from run.result import RunResult

from .disclosure import disclosed
from .tables import cohort_tables, provenance_section

COLORS = {"sv_certified": "#c0392b", "sv_learned": "#e67e22", "recency": "#2c3e50", "softmax_h2o": "#2980b9",
          "residual_delta": "#27ae60", "random": "#8e44ad", "h2o_proxy": "#7f8c8d"}
LABEL_TITLES = {"composite_vitals": "Composite vital-sign deterioration (shares channels with the keys)",
                "heldout_spo2": "Held-out SpO2 < 90 % (SpO2 removed from every selector's keys)",
                "clinical_criteria": "Clinical deterioration criteria (MAP, lactate, vasopressor, ventilation, "
                                     "SOFA rise, death)",
                "rare_items": "Rare items (hours holding a code rare in training)", "none": "Label-free"}
# Retrieval reads out with the nearest kept token (the argmax of the RBF over the kept keys, taken per key), not
# the paper's synthetic rare-item readout (kernel weight summed per group); bench/rare_items_bench.py runs both.
METRIC_TITLES = {"retention": "labelled tokens kept (fraction)", "retrieval": "retrieval of a labelled token: is "
                 "the kept token nearest to it (RBF readout, nearest-token) labelled? (fraction)",
                 "retention_hour_end": "held at each labelled hour's end (fraction)",
                 "certified_fraction": "certified evictions (fraction)",
                 "certificate_expiry": "certified evictions active in the full-history solve (fraction)",
                 "output_deviation": "readout deviation from the full context", "budget_k": "budget k = |S u E|"}
# A chart's y-axis title is rotated along its 300 px height: the short form of each metric (the chart's heading
# above it holds the long one); the long titles ran off the figure.
AXIS_TITLES = {"retention": "fraction kept", "retrieval": "fraction retrieved", "retention_hour_end":
               "held at the hour's end", "certified_fraction": "certified fraction", "certificate_expiry":
               "still active", "output_deviation": "readout deviation"}


def _chart(rows, metric, fractions=False, width=900, height=300, pad=60):
    """Mean and 95% band per policy over the fixed budgets (log axis) or the fraction budgets (linear axis)."""
    rows = [r for r in rows if r.metric == metric and (r.budget.is_fraction if fractions else r.budget.is_fixed)]
    if not rows:
        return ""
    budgets = sorted({r.budget.axis_value for r in rows})
    # fitted to the data: a fraction that never passes 0.25 gets a 0-0.25 axis, not 0-1
    top = max((r.ci_high for r in rows if math.isfinite(r.ci_high)), default=1.0)
    ymax = min(1.0, top * 1.1) if metric != "output_deviation" else top * 1.1
    ymax = ymax if ymax > 0 else 1.0
    scale = (lambda b: b) if fractions else math.log2
    x0, x1 = scale(budgets[0]), scale(budgets[-1])
    x1 = x1 if x1 > x0 else x0 + 1

    def X(b):
        return pad + (scale(b) - x0) / (x1 - x0) * (width - 2 * pad)

    def Y(v):
        return height - pad + -(v / ymax) * (height - 2 * pad)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="{html.escape(METRIC_TITLES.get(metric, metric))}">',
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="#555"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#555"/>']
    for b in budgets:
        tick = f"{b:.0%}" if fractions else f"{b:.0f}"
        parts.append(f'<text x="{X(b):.1f}" y="{height - pad + 16}" font-size="11" text-anchor="middle">{tick}</text>')
    for k in range(5):
        v = ymax * k / 4
        parts.append(f'<text x="{pad - 6}" y="{Y(v) + 4:.1f}" font-size="11" text-anchor="end">{v:.2g}</text>')
        parts.append(f'<line x1="{pad}" y1="{Y(v):.1f}" x2="{width - pad}" y2="{Y(v):.1f}" stroke="#eee"/>')
    unit = _unit(rows[0])
    direction = "lower is better" if metric in ("output_deviation", "certificate_expiry") else "higher is better"
    xlabel = (f"memory budget as a fraction of the stay's stream ({unit} kept = fraction x stream length)"
              if fractions else f"memory budget B ({unit} kept, log scale)")
    parts.append(f'<text x="{width / 2}" y="{height - 12}" font-size="12" text-anchor="middle">{xlabel}</text>')
    parts.append(f'<text x="14" y="{height / 2}" font-size="12" text-anchor="middle" '
                 f'transform="rotate(-90 14 {height / 2})">{html.escape(AXIS_TITLES.get(metric, metric))} '
                 f'({direction.split()[0]} is better)</text>')
    for pol in sorted({r.policy for r in rows}):
        pr = sorted((r for r in rows if r.policy == pol), key=lambda r: r.budget.axis_value)
        color = COLORS.get(pol, "#777")
        band = [(X(r.budget.axis_value), Y(r.ci_high)) for r in pr] + \
               [(X(r.budget.axis_value), Y(r.ci_low)) for r in reversed(pr)]
        parts.append(f'<polygon points="{" ".join(f"{a:.1f},{b:.1f}" for a, b in band)}" fill="{color}" '
                     f'fill-opacity="0.15" stroke="none"/>')
        line = " ".join(f"{X(r.budget.axis_value):.1f},{Y(r.mean):.1f}" for r in pr)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2">'
                     f'<title>{html.escape(pol)}</title></polyline>')
    parts.append("</svg>")
    return "".join(parts)


def _legend(policies):
    return " ".join(f'<span style="color:{COLORS.get(p, "#777")}">&#9632; {html.escape(p)}</span>'
                    for p in policies)


def _table(summary, paired, metric):
    budgets = sorted({r.budget for r in summary if r.metric == metric}, key=lambda b: (not b.is_fixed, b.axis_value))
    policies = sorted({r.policy for r in summary if r.metric == metric})
    idx = {(r.budget, r.policy): r for r in summary if r.metric == metric}
    pidx = {(r.budget, r.baseline): r for r in paired if r.metric == metric}
    unit = _unit(summary[0]) if summary else "events"
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
            extra = (f"<br><small>SV&minus;this {d.mean_diff:+.3f} [{d.ci_low:+.3f}, {d.ci_high:+.3f}]"
                     f" {_p_text(d)}</small>") if d else ""
            cells.append(f"<td>{r.mean:.3f} <small>[{r.ci_low:.3f}, {r.ci_high:.3f}] n={_n(r.n)}</small>"
                         f"{extra}</td>")
        label = f"{b} {unit}" if b.is_fixed else f"{b.value:.0%} of stream"
        body.append(f"<tr><th>{label}</th>{''.join(cells)}</tr>")
    return f"<table><tr><th>budget</th>{head}</tr>{''.join(body)}</table>"


STREAMING_HEADLINE = Budget("tokens", 32)    # the streaming budget the report's first sections read


def _unit(row: SummaryRow) -> str:
    return "tokens" if row.tokens is StreamMode.HOURLY else "events"


def _n(count) -> str:
    """A number of stays as shown: the count, or "<11" where small-cell suppression hid it."""
    return html.escape(str(count))


def _p_text(d: PairedRow) -> str:
    """A comparison's p-value with its family: Holm-adjusted within a declared family, else exploratory."""
    family = d.family
    if family == EXPLORATORY or d.p_holm is None:
        return f"p={d.p_value:.3g} (exploratory, unadjusted)"
    return f"p={d.p_value:.3g} (Holm {d.p_holm:.3g}, {html.escape(family)} family)"


def _select(rows, **match):
    """The rows whose fields equal ``match``'s (a budget or stream mode may be given as its text)."""
    return [r for r in rows if all(str(getattr(r, k)) == str(v) for k, v in match.items())]


def _groups(summary):
    """(protocol, tokens, keys, label) groups of the run, in a fixed reading order."""
    order = {"fixed_context": 0, "streaming": 1}
    return sorted({(r.protocol, r.tokens, r.keys, r.label) for r in summary},
                  key=lambda g: (order.get(g[0], 9), g[1], g[3] == "none", g[3], g[2]))


def _fixed_table(summary, paired):
    """Policies x metrics of one fixed-context group, with SV's paired differences."""
    metrics = [m for m in ("retention", "retrieval") if _select(summary, metric=m)]
    head = "".join(f"<th>{html.escape(METRIC_TITLES[m])}</th>" for m in metrics)
    body = []
    for pol in sorted({r.policy for r in summary}, key=lambda p: (p != "sv_certified", p)):
        cells = []
        for m in metrics:
            r = next(iter(_select(summary, policy=pol, metric=m)), None)
            d = next(iter(_select(paired, baseline=pol, metric=m)), None)
            extra = (f"<br><small>SV&minus;this {d.mean_diff:+.3f} [{d.ci_low:+.3f}, {d.ci_high:+.3f}] "
                     f"{_p_text(d)}</small>") if d else ""
            cells.append(f"<td>{r.mean:.3f} <small>[{r.ci_low:.3f}, {r.ci_high:.3f}] n={_n(r.n)}</small>"
                         f"{extra}</td>" if r else "<td>&ndash;</td>")
        body.append(f"<tr><th>{html.escape(pol)}</th>{''.join(cells)}</tr>")
    return f"<table><tr><th>policy</th>{head}</tr>{''.join(body)}</table>"


def _cell(v):
    """A table cell: a mapping as one 'name: value' per line, a list of texts as a list, a list of mappings as a
    small table; never a repr."""
    if isinstance(v, dict):
        return "<br>".join(f"{html.escape(str(k))}: {_cell(x)}" for k, x in v.items())
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        return "<ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in v) + "</ul>"
    if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
        cols = list(v[0])
        head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{_cell(x.get(c))}</td>" for c in cols) + "</tr>" for x in v)
        return f"<table>{head}{body}</table>"
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape(str(v))


def _fixed_budget(rows):
    k = next(iter(_select(rows, metric="budget_k")), None)
    dropped = next(iter(_select(rows, metric="support_size_boundary")), None)
    kept = (f"budget k = |S &cup; E| of the exact solve: mean {k.mean:.1f} tokens [{k.ci_low:.1f}, "
            f"{k.ci_high:.1f}] over {_n(k.n)} stays" if k else "no stay scored")
    return f"<p>{kept}; dropped (k = 0 or k &ge; n): {_n(dropped.n) if dropped else 0} stays.</p>"


def _cohort_memory(info):
    """The cohort memory's state as numbers: tokens fed and held, evictions, and the certified share."""
    if not info:
        return ""
    cert, unc = info.get("certified_evictions", 0), info.get("uncertified_evictions", 0)
    share = f"{cert / (cert + unc):.3f}" if cert + unc else "no evictions"
    hist = info.get("history") or {}
    history = ("rows dated before the watermark arrived or changed: rebuilt from "
               f"{hist.get('rebuilt_from')}" if hist.get("changed_before_watermark") else
               "unchanged" if hist.get("checked") else "a new memory: nothing was fed before" if
               hist.get("new_memory") else "not checked (a checkpoint from before the check)")
    rows = [("stream", info.get("tokens_mode", "events")), ("fed this run", info.get("fed")),
            ("history before the watermark", history),
            ("held", info.get("tokens")), ("certified evictions", cert), ("uncertified evictions", unc),
            ("certified share", share)]
    return ("<h3>Cohort memory</h3><table>" + "".join(f"<tr><th>{k}</th><td>{html.escape(str(v))}</td></tr>"
                                                    for k, v in rows) + "</table>")


def _headline_rows(summary):
    """{(protocol, tokens, keys, label): retention rows at the protocol's headline budget}."""
    out = {}
    for protocol, tokens, keys, label in _groups(summary):
        budget = SUPPORT if protocol == "fixed_context" else STREAMING_HEADLINE
        rows = _select(summary, protocol=protocol, tokens=tokens, keys=keys, label=label, budget=budget,
                       metric="retention")
        if label != "none" and rows:
            out[(protocol, tokens, keys, label)] = sorted(rows, key=lambda r: -r.mean)
    return out


def _headline_figure(summary, panel_width=440, bar=15, pad=8, name_width=110):
    """One figure: per label (rows) and protocol (columns), each policy's retention at the headline budget as a
    bar with its 95% interval."""
    groups = _headline_rows(summary)
    if not groups:
        return ""
    protocols = sorted({g[0] for g in groups}, key=lambda p: p != "fixed_context")
    labels = list(dict.fromkeys((g[1], g[2], g[3]) for g in groups))
    n_pol = max(len(v) for v in groups.values())
    panel_h = 22 + n_pol * bar + pad
    top = max(r.ci_high for v in groups.values() for r in v if math.isfinite(r.ci_high))
    xmax = min(1.0, top * 1.05) if top > 0 else 1.0
    width, height = 20 + panel_width * len(protocols), 40 + panel_h * len(labels) + 36
    plot_w = panel_width - name_width - 60
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img" '
             f'aria-label="retention at the headline budget, per label and protocol">',
             f'<rect x="0" y="0" width="{width}" height="{height}" fill="white"/>']
    for j, protocol in enumerate(protocols):
        x0 = 20 + j * panel_width
        budget = "budget k = |S u E| per stay" if protocol == "fixed_context" else f"budget B = {STREAMING_HEADLINE}"
        title = html.escape(protocol.replace("_", " "))
        parts.append(f'<text x="{x0}" y="18" font-size="13" font-weight="bold">{title} ({budget})</text>')
        for i, (tokens, keys, label) in enumerate(labels):
            y0 = 32 + i * panel_h
            parts.append(f'<text x="{x0}" y="{y0 + 14}" font-size="12">{html.escape(label)} '
                         f'<tspan fill="#777">(keys: {html.escape(keys)})</tspan></text>')
            for k, r in enumerate(groups.get((protocol, tokens, keys, label), [])):
                y = y0 + 22 + k * bar
                bx = x0 + name_width

                def X(v):
                    return bx + max(0.0, min(v, xmax)) / xmax * plot_w

                color = COLORS.get(r.policy, "#777")
                weight = ' font-weight="bold"' if r.policy == "sv_certified" else ""
                parts.append(f'<text x="{bx - 4}" y="{y + bar - 4}" font-size="11" text-anchor="end"{weight}>'
                             f'{html.escape(r.policy)}</text>'
                             f'<rect x="{bx}" y="{y + 2}" width="{X(r.mean) - bx:.1f}" height="{bar - 4}" '
                             f'fill="{color}" fill-opacity="0.8"><title>{html.escape(r.policy)} '
                             f'{r.mean:.3f}</title></rect>'
                             f'<line x1="{X(r.ci_low):.1f}" y1="{y + bar / 2}" x2="{X(r.ci_high):.1f}" '
                             f'y2="{y + bar / 2}" stroke="#222"/>'
                             f'<text x="{X(r.ci_high) + 4:.1f}" y="{y + bar - 4}" font-size="10" '
                             f'fill="#444">{r.mean:.2f}</text>')
    # two short lines from the left edge: one protocol's figure is 460 px wide, too narrow for one centred line
    parts.append(f'<text x="20" y="{height - 20}" font-size="11">labelled tokens kept: fraction of each stay\'s, '
                 f'mean over stays, higher is better</text>'
                 f'<text x="20" y="{height - 6}" font-size="11">bar = mean, line = 95% interval; axis 0 to '
                 f'{xmax:.2g}</text></svg>')
    return "".join(parts)


def _compared_rows(d: PairedRow, summary: list) -> tuple[SummaryRow | None, SummaryRow | None]:
    """The summary rows of SV and of the baseline that the paired comparison ``d`` compares."""
    at = {k: getattr(d, k) for k in ("protocol", "tokens", "keys", "label", "budget", "metric")}
    return (next(iter(_select(summary, policy="sv_certified", **at)), None),
            next(iter(_select(summary, policy=d.baseline, **at)), None))


def _verdict(d: PairedRow, alpha: float) -> str:
    """'more', 'less' (SV keeps more or less than the baseline) or 'tied': a difference is claimed only when the
    Holm-adjusted p is below alpha and the paired interval lies on that side of 0 (never a claim beside an
    interval that spans 0)."""
    if d.p_holm is not None and d.p_holm < alpha:
        if d.ci_low > 0:
            return "more"
        if d.ci_high < 0:
            return "less"
    return "tied"


def _endpoint_item(d: PairedRow, summary: list, alpha: float, size: int) -> str:
    """One declared comparison in words: both policies' means, the paired difference and its CI, the p-values,
    and what they support at the family-wise alpha."""
    sv, base = _compared_rows(d, summary)
    rival = html.escape(d.baseline)
    means = f"SV {sv.mean:.3f} vs {rival} {base.mean:.3f}; " if sv and base else ""
    verdict = {"more": "<b>SV keeps more</b>", "less": f"<b>{rival} keeps more</b>"}.get(
        _verdict(d, alpha), f"not told apart at family-wise &alpha; = {alpha:g}"
        + (" (the interval spans 0)" if d.ci_low <= 0 <= d.ci_high else ""))
    return (f"<li><b>{html.escape(endpoint_of(d).describe())}</b>: {means}difference {d.mean_diff:+.3f} "
            f"[{d.ci_low:+.3f}, {d.ci_high:+.3f}] (paired 95% CI, n={_n(d.n)} stays); sign-flip "
            f"p={d.p_value:.3g}, Holm-adjusted within the {html.escape(d.family)} family of {size}: "
            f"p={d.p_holm:.3g}; Wilcoxon signed-rank p={d.p_wilcoxon:.3g}: {verdict}.</li>")


def _endpoints(summary: list, paired: list, declared: dict) -> str:
    """The declared families first, primary then secondary, each comparison in words; a declared comparison
    this run did not measure is named."""
    alpha = declared.get("alpha", 0.05)
    out = []
    for family in FAMILIES:
        rows = [d for d in paired if d.family == family]
        names = declared.get(family) or []
        measured = {endpoint_of(d).describe() for d in rows}
        items = [_endpoint_item(d, summary, alpha, len(rows)) for d in rows]
        items += [f"<li><b>{html.escape(n)}</b>: not measured in this run (its protocol, label or budget was not "
                  f"scored)</li>" for n in names if n not in measured]
        if items:
            out.append(f"<h3>{family.capitalize()} endpoints <small>(declared in the cohort config; Holm within the "
                       f"family, family-wise &alpha; = {alpha:g})</small></h3><ul>{''.join(items)}</ul>")
    return "".join(out) or ("<p>The cohort config declares no endpoints: every comparison below is exploratory "
                            "(unadjusted p).</p>")


def _headline(summary, paired, declared: dict):
    """The declared endpoints in words; then, per protocol and label at its headline budget, which policy keeps
    most and by how much (exploratory unless the comparison is declared)."""
    items = []
    for (protocol, tokens, keys, label), rows in _headline_rows(summary).items():
        budget = SUPPORT if protocol == "fixed_context" else STREAMING_HEADLINE
        sv = next(iter(_select(rows, policy="sv_certified")), None)
        if sv is None:
            continue
        best = rows[0]
        others = [r for r in rows if r.policy != "sv_certified"]
        rival = max(others, key=lambda r: r.mean) if others else None
        text = (f"<b>{html.escape(protocol.replace('_', ' '))}, {html.escape(tokens)} tokens, "
                f"{html.escape(label)}</b> (budget {'k = |S u E|' if budget == SUPPORT else budget}): ")
        if rival is None:
            items.append(f"<li>{text}SV keeps {sv.mean:.3f}.</li>")
            continue
        d = next(iter(_select(paired, protocol=protocol, tokens=tokens, keys=keys, label=label, budget=budget,
                              metric="retention", baseline=rival.policy)), None)
        tied = d is not None and d.ci_low <= 0.0 <= d.ci_high
        if tied:
            verdict = (f"{'SV' if best.policy == 'sv_certified' else html.escape(best.policy)} has the highest "
                       f"mean, not told apart from {'SV' if best.policy != 'sv_certified' else 'the best other'} "
                       f"(the paired interval spans 0)")
        else:
            verdict = "SV keeps most" if best.policy == "sv_certified" else \
                f"SV does <b>not</b> win: {html.escape(best.policy)} keeps most"
        diff = (f"; SV&minus;{html.escape(rival.policy)} {d.mean_diff:+.3f} [{d.ci_low:+.3f}, "
                f"{d.ci_high:+.3f}], {_p_text(d)}") if d else ""
        items.append(f"<li>{text}{verdict}: SV {sv.mean:.3f}, best other {html.escape(rival.policy)} "
                     f"{rival.mean:.3f}{diff} (n={_n(sv.n)} stays).</li>")
    cert = []
    for m in ("certified_fraction", "certificate_expiry"):
        for r in _select(summary, protocol="streaming", budget=STREAMING_HEADLINE, metric=m):
            cert.append(f"<li>{html.escape(METRIC_TITLES[m])} at B = {STREAMING_HEADLINE} ({html.escape(r.tokens)} "
                        f"tokens, keys {html.escape(r.keys)}): {r.mean:.3f} [{r.ci_low:.3f}, "
                        f"{r.ci_high:.3f}] over {_n(r.n)} stays with evictions</li>")
    return (f"<section id=\"headline\"><h2>What this run found</h2>{_endpoints(summary, paired, declared)}"
            f"<h3>Exploratory: the policy that keeps most, per protocol and label</h3><ul>{''.join(items)}</ul>"
            f"{_headline_figure(summary)}"
            f"<h3>Certification</h3><ul>{''.join(cert) or '<li>no SV evictions at this budget</li>'}</ul>"
            f"<p><small>Retention = fraction of a stay's labelled tokens kept, averaged over stays with at least "
            f"one. p-values are two-sided sign-flip tests (enough resamples that a declared family's adjusted p "
            f"is not limited by them), with the Wilcoxon signed-rank test beside them for the declared endpoints; "
            f"Holm adjusts within each declared family only. Every other p in this report is exploratory and "
            f"unadjusted: read it as a description, not a finding.</small></p></section>")


LABEL_WORDS = {"composite_vitals": "composite vital-sign deterioration", "heldout_spo2": "held-out SpO2 < 90 %",
               "clinical_criteria": "clinical deterioration criteria", "rare_items": "rare-item"}


def _people(table, row: str, split: str) -> str:
    """A count of the cohort table (stays, patients) as shown: the number, or what hid it."""
    if table is None:
        return ""
    r = next((r for r in table.rows if r.name == row), None)
    cell = r.cells[table.splits.index(split)] if r is not None and split in table.splits else None
    return f"{cell.n:,}" if isinstance(cell, Count) else html.escape(str(getattr(cell, "n", "?")))


def _lead_sentence(summary: list, paired: list, declared: dict) -> str:
    """The primary finding in one plain sentence: the first declared primary comparison with both means, the
    paired difference and its interval; then how the primary family came out as a whole."""
    alpha = declared.get("alpha", 0.05)
    primary = [d for d in paired if d.family == "primary"]
    if not primary:
        return ("No primary endpoint was measured in this run" + (" (the cohort config declares none)" if not
                declared.get("primary") else "") + ": every comparison below is exploratory.")
    d = primary[0]
    sv, base = _compared_rows(d, summary)
    unit = "hours" if d.tokens == "hourly" else "events"
    setting = ("With the paper's fixed context (each policy keeps k = |S &cup; E| tokens, the support of the stay's "
               "exact solve)" if d.protocol == "fixed_context" else
               f"Streaming each stay through a memory of B = {html.escape(str(d.budget))} tokens")
    words = {"more": "more", "less": "less", "tied": "no more and no less, statistically,"}[_verdict(d, alpha)]
    means = (f"{sv.mean:.2f} of each stay's {html.escape(LABEL_WORDS.get(d.label, d.label))} {unit} "
             f"against {base.mean:.2f} for {html.escape(d.baseline)}") if sv and base else "its labelled tokens"
    lead = (f"{setting}, SV memory kept {means} (paired difference {d.mean_diff:+.2f}, 95% CI "
            f"{d.ci_low:+.2f} to {d.ci_high:+.2f}, {_n(d.n)} stays): {words} than {html.escape(d.baseline)}")
    verdicts = [_verdict(x, alpha) for x in primary]
    tally = (f"across all {len(primary)} primary comparisons SV kept more in {verdicts.count('more')}, less in "
             f"{verdicts.count('less')}, and {verdicts.count('tied')} were not told apart (Holm, family-wise "
             f"&alpha; = {alpha:g})")
    return f"{lead}; {tally}."


def _at_a_glance(result: RunResult, declared: dict) -> str:
    """The report's first screen: which data, when, which cohort, and the primary finding in one sentence."""
    meta, cohort, summary, paired = result.metadata, result.cohort, result.summary, result.paired
    table = cohort.get("characteristics") if isinstance(cohort.get("characteristics"), CohortTable) else None
    source = str(meta.get("data_source") or "unknown source")
    name = Path(source).name if "/" in source else source
    mode = "hourly patient-state tokens" if meta.get("tokens_mode") == "hourly" else "raw events"
    if table is not None:
        cohort_words = (f'{_people(table, "ICU stays", "all")} ICU stays of {_people(table, "patients", "all")} '
                        f'patients; {_people(table, "ICU stays", "eval")} stays of {_people(table, "patients", "eval")}'
                        f' patients in the evaluation split are scored')
    else:       # a result without the cohort table (events mode): the stream counts
        cohort_words = (f'{html.escape(str(cohort.get("stays", "?")))} ICU stays; '
                        f'{html.escape(str(cohort.get("eval_stays", "?")))} in the evaluation split are scored')
    where = f' <small>({html.escape(source)})</small>' if source != name else ""   # the full path, when a path
    return (f'<section id="at-a-glance"><p class="glance"><b>Dataset</b> {html.escape(name)}{where} '
            f'&middot; <b>run</b> {html.escape(str(meta.get("generated_at")))}'
            f' &middot; <b>cohort</b> {cohort_words} &middot; <b>stream</b> {mode}</p>'
            f'<p class="finding"><b>Primary finding.</b> {_lead_sentence(summary, paired, declared)}</p></section>')


def mark_stale(report_html: str, reason: str) -> str:
    """A report's HTML with a banner at the top of its body saying why its numbers are out of date (the next
    scheduled run regenerates the report)."""
    banner = (f"<p style='background:#fde;border:2px solid #c00;padding:8px'><b>Stale:</b> {html.escape(reason)}; "
              f"the next scheduled run regenerates it.</p>")
    return report_html.replace("<body>", "<body>" + banner, 1)


def _jsonable(o):
    return dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o)


def render_report(result: RunResult, out_dir: Path | str) -> Path:
    """Write report.html and report.json into ``out_dir`` (small counts hidden); returns the HTML path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = disclosed(result)
    summary, paired = result.summary, result.paired
    declared = result.metadata.get("declared_endpoints") or {}
    sections = []
    for protocol, tokens, keys, label in _groups(summary):
        match = dict(protocol=protocol, tokens=tokens, keys=keys, label=label)
        rows, prows = _select(summary, **match), _select(paired, **match)
        title = (f"{protocol.replace('_', ' ').capitalize()} &middot; {html.escape(tokens)} tokens &middot; "
                 f"{html.escape(LABEL_TITLES.get(label, label))} <small>(keys: {html.escape(keys)})</small>")
        if protocol == "fixed_context":
            body = _fixed_table(rows, prows) if label != "none" else _fixed_budget(rows)
            sections.append(f"<section><h2>{title}</h2>{body}</section>")
            continue
        parts = []
        for metric in ("retention", "retrieval", "retention_hour_end", "certified_fraction", "certificate_expiry",
                       "output_deviation"):
            mrows = _select(rows, metric=metric)
            if not mrows:
                continue
            series = sorted({r.policy for r in mrows})
            parts.append(f"<h3>{html.escape(METRIC_TITLES[metric])}</h3>{_chart(mrows, metric)}"
                         f"{_chart(mrows, metric, fractions=True)}"
                         f"<p>{_legend(series)}</p>{_table(rows, prows, metric)}")
        sections.append(f"<section><h2>{title}</h2>{''.join(parts)}</section>")
    stream_rows = "".join(f"<tr><th>{html.escape(k.replace('_', ' '))}</th><td>{_cell(v)}</td></tr>"
                          for k, v in result.cohort.items() if k != "characteristics")
    meta_rows = "".join(f"<tr><th>{html.escape(str(k).replace('_', ' '))}</th><td>{_cell(v)}</td></tr>"
                        for k, v in result.metadata.items() if k != "cohort_memory")
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Forgetful retention report</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}}
table{{border-collapse:collapse;margin:.5em 0}}td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left;
vertical-align:top}}small{{color:#555}}section{{margin-bottom:2em}}th.group{{background:#f3f3f3}}
pre{{background:#f7f7f7;padding:.5em;overflow-x:auto}}
.glance{{font-size:1.05em;background:#f3f6fa;padding:.6em .8em;border-left:4px solid #2c3e50}}
.finding{{font-size:1.15em;line-height:1.45;padding:.2em .8em}}</style></head>
<body><h1>Forgetful: what a certified SV memory keeps of ICU stays</h1>
{_at_a_glance(result, declared)}
{_headline(summary, paired, declared)}
{_cohort_memory(result.metadata.get("cohort_memory"))}
<p>Fixed context (the paper's protocol): per stay, the exact solve over all its tokens sets the budget
k = |S &cup; E| and every policy keeps k. Streaming: each evaluation stay's tokens in time order through each policy
at the same budget. Means over stays with 95% percentile-bootstrap intervals; &ldquo;SV&minus;this&rdquo; is the
paired difference of certified SV selection minus that policy, with a sign-flip permutation p-value. Aggregates
only.</p>
{cohort_tables(result.cohort.get("characteristics"))}
<h2>Streams scored</h2><table>{stream_rows}</table>
{''.join(sections)}
<h2>Run</h2><table>{meta_rows}</table>
{provenance_section(result.provenance)}
</body></html>"""
    path = out / "report.html"
    path.write_text(doc, encoding="utf-8")
    (out / "report.json").write_text(json.dumps(result.as_json(), indent=1, default=_jsonable))
    return path
