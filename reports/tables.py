"""The report's clinical cohort table ("Table 1"), criterion breakdown, quarantine and provenance, as HTML."""
import html

from cohorts.characteristics import CohortTable, Count, Spread
from run.provenance import Provenance

from .disclosure import SUPPRESSED, Hidden

SMALL_CELLS_NOTE = ("Counts of 1 to 10 people or stays read &ldquo;&lt;11&rdquo; (MIMIC-IV's data use agreement "
                    "forbids publishing them); a larger count reads &ldquo;suppressed&rdquo; where a hidden one could "
                    "be worked back from it (a split's total minus its other split, a care unit from the others).")
SPLIT_TITLES = {"all": "all stays", "train": "training split", "eval": "evaluation split (scored)"}


def _fmt(cell) -> str:
    if isinstance(cell, Hidden):
        why = "would reveal a small cell" if cell.n == SUPPRESSED else "small cell"
        return f"{html.escape(cell.n)} <small>({why})</small>"
    if isinstance(cell, Count):
        return f"{cell.n:,}" + (f" ({cell.n / cell.of:.0%})" if cell.of else "")
    if isinstance(cell, Spread):
        if cell.median is None:
            return "&ndash; <small>(no values)</small>"
        return f"{cell.median:.1f} [{cell.q1:.1f}, {cell.q3:.1f}]"
    return html.escape(str(cell))


def _rows(rows, splits) -> str:
    out, group = [], None
    for r in rows:
        if r.group != group:
            group = r.group
            if group:
                out.append(f'<tr><th colspan="{len(splits) + 1}" class="group">{html.escape(group)}</th></tr>')
        indent = ' style="padding-left:1.5em"' if r.group else ""
        out.append(f"<tr><th{indent}>{html.escape(r.name)}</th>" + "".join(f"<td>{_fmt(c)}</td>" for c in r.cells)
                   + "</tr>")
    return "".join(out)


def cohort_tables(table: CohortTable | None) -> str:
    """Table 1, the per-criterion breakdown of the clinical criteria, and the quarantine by rule."""
    if table is None:
        return ""
    head = "<tr><th>characteristic</th>" + "".join(f"<th>{SPLIT_TITLES.get(s, s)}</th>" for s in table.splits) + \
        "</tr>"
    quarantine = "".join(f"<tr><th>{html.escape(reason.replace('_', ' '))}</th><td>{n:,}</td></tr>"
                         for reason, n in table.quarantine.items()) or \
        "<tr><td colspan=\"2\">no row was rejected by the extraction</td></tr>"
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in table.notes)
    return (f'<section id="cohort"><h2>Cohort</h2><table>{head}{_rows(table.rows, table.splits)}</table>'
            f"<p><small>{SMALL_CELLS_NOTE}</small></p>"
            f"<h3>Clinical deterioration criteria, one by one</h3><table>{head.replace('characteristic', 'criterion')}"
            f"{_rows(table.criteria, table.splits)}</table>"
            f"<h3>Quarantined rows, by the rule that rejected them</h3><table><tr><th>rule</th><th>rows</th></tr>"
            f"{quarantine}</table><ul><small>{notes}</small></ul></section>")


def provenance_section(prov: Provenance | None) -> str:
    """Source files with checksums, code and package versions, and the cohort configuration in full."""
    if prov is None:
        return ""
    files = "".join(f"<tr><th>{html.escape(f.table)}</th><td>{html.escape(f.path)}</td><td>{f.rows:,}</td>"
                    f"<td>{f.size:,}</td><td><code>{f.sha256}</code></td></tr>" for f in prov.files)
    packages = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in prov.packages.items())
    return (f'<section id="provenance"><h2>Provenance</h2><table>'
            f"<tr><th>data source</th><td>{html.escape(prov.source)}</td></tr>"
            f"<tr><th>code version</th><td>{html.escape(prov.code_version)}</td></tr>"
            f"<tr><th>extraction runs that built the store</th><td>{prov.extractions}</td></tr>"
            f"<tr><th>cohort configuration</th><td>{html.escape(prov.config_path)}<br><small>sha256 "
            f"<code>{prov.config_sha256}</code></small></td></tr></table>"
            f"<h3>Source files (as of the latest extraction)</h3><table><tr><th>table</th><th>file</th><th>rows</th>"
            f"<th>bytes</th><th>sha256</th></tr>{files}</table>"
            f"<h3>Package versions</h3><table>{packages}</table>"
            f"<details><summary>Cohort configuration (YAML)</summary><pre>{html.escape(prov.config_text)}</pre>"
            f"</details></section>")
