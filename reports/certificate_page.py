"""A deletion certificate as a document for a compliance officer, rendered from the certificate's record.

Status first, then what was removed, what each memory did, what was kept and why, and how to verify it. The
page states only what the certificate records as checked; the JSON (hashed into the ledger) stays the
authority.
"""
from __future__ import annotations

import html

from pipeline.certificate import Certificate

from .disclosure import DEFAULT_THRESHOLD, is_small, shown_count

STYLE = ("body{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222;line-height:1.4}"
         "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;"
         "vertical-align:top}th{background:#f7f7f7}code{font-size:90%;word-break:break-all}"
         ".ok{border:2px solid #27ae60;background:#eafaf1;padding:.6em 1em}"
         ".bad{border:2px solid #c0392b;background:#fdedec;padding:.6em 1em}small{color:#555}")

REMOVED_ITEMS = (("stays", "ICU stays (stay table)"),
                 ("quarantine_rows", "quarantined source rows"),
                 ("per_stay_result_rows", "per-stay evaluation result rows"),
                 ("per_stay_memories", "per-stay SV memories (files)"),
                 ("source_rows", "rows of the workspace's own generated source files"))
# removed items that count the patient's stays (one memory file per stay): small-cell suppressed on the page
COUNTS_OF_STAYS = ("stays", "per_stay_memories")


def _problems(cert: Certificate) -> list[str]:
    """What the certificate itself records as not passed."""
    out = [f"memory checkpoint {name} failed its refit check" for name, v in cert.verification.items()
           if not v.get("passed")]
    remaining = cert.residual_scan.get("rows_remaining", 0)
    if remaining:
        out.append(f"the post-deletion scan still found {remaining} row(s)")
    return out


def _status(cert: Certificate) -> str:
    problems = _problems(cert)
    if problems:
        return ('<div class="bad"><h2>Status: NOT verified</h2><ul>' +
                "".join(f"<li>{html.escape(p)}</li>" for p in problems) + "</ul></div>")
    scan = cert.residual_scan
    checked = len(cert.verification)
    memories = (f"{checked} cohort-memory checkpoint(s) holding the patient's tokens were checked against an "
                f"independent refit and passed" if checked else
                "no cohort-memory checkpoint held a token of this patient, so none needed a refit check")
    return (f'<div class="ok"><h2>Status: verified at issue</h2><p>Before this certificate was issued, a scan of '
            f"{html.escape(', '.join(s.replace('_', ' ') for s in scan.get('scanned', [])) or 'the workspace')} found "
            f"<b>{scan.get('rows_remaining', 0)}</b> remaining rows of the patient, and {memories}.</p>"
            f"<p><small>Issued {html.escape(str(cert.issued_at))} in {cert.seconds} s by Forgetful "
            f"{html.escape(str(cert.code_version))}.</small></p></div>")


def _shown(n, threshold: int):
    """A count of stays as a page that may be shared shows it: small ones as "<threshold" (escaped)."""
    return html.escape(str(shown_count(n, threshold))) if is_small(n, threshold) else n


def _removed(cert: Certificate, threshold: int) -> str:
    removed = cert.removed
    # two icustays events (admission, discharge) per stay: a small stay count would be worked back from theirs
    stays_hidden = is_small(removed.get("stays", 0), threshold)
    why_events = (f" <small>(not shown: each ICU stay has an admission and a discharge event here, so this count "
                  f"would give away the number of stays, which is below {threshold})</small>")
    why_stays = (f" <small>(1 to {threshold - 1}: counts of stays this small are not shown on a page that may be "
                 f"shared)</small>")
    rows = [(f"events from <code>{html.escape(t)}</code>",
             f"{_shown(n, 2 * threshold)}{why_events}" if t == "icustays" and stays_hidden else n)
            for t, n in sorted((removed.get("events_by_table") or {}).items())]
    if not rows:
        rows.append(("events", "0 <small>(the store held no event of this patient)</small>"))
    rows += [(label, f"{_shown(removed.get(key, 0), threshold)}{why_stays}" if key in COUNTS_OF_STAYS and
              is_small(removed.get(key, 0), threshold) else removed.get(key, 0)) for key, label in REMOVED_ITEMS]
    tokens = removed.get("cohort_memory_tokens") or {}
    rows += [(f"tokens of cohort memory checkpoint <code>{html.escape(c)}</code>", n) for c, n in tokens.items()]
    if not tokens:
        rows.append(("cohort memory tokens", "0 <small>(the budgeted memory held none of this patient's tokens; "
                                             "it keeps a fixed number of the cohort's tokens, not all)</small>"))
    if "learned_key_encoder" in removed:
        rows.append(("learned key encoder", html.escape(str(removed["learned_key_encoder"]))))
    return ("<h2>What was removed</h2><table><tr><th>item</th><th>removed</th></tr>" +
            "".join(f"<tr><td>{label}</td><td>{f'{n:,}' if isinstance(n, int) else n}</td></tr>"
                    for label, n in rows) + "</table>")


def _number(x) -> str:
    return f"{x:.2e}" if isinstance(x, float) else "&ndash; <small>(not computed: too few tokens to solve)</small>" \
        if x is None else html.escape(str(x))


def _memories(cert: Certificate) -> str:
    verification, digests = cert.verification, cert.memory_digests
    head = (f"<h2>Memories</h2><p>Mode <b>{html.escape(str(cert.mode))}</b>: "
            f"{html.escape(str(cert.mode_meaning))}.</p>")
    if not verification:
        return head + "<p>No memory checkpoint held a token of this patient: none was changed or checked.</p>"
    rows = []
    for name, v in verification.items():
        d = digests.get(name, {})
        rows.append(f"<tr><td><code>{html.escape(name)}</code></td><td>{'passed' if v.get('passed') else 'FAILED'}"
                    f"</td><td>{_number(v.get('max_decision_deviation'))}</td><td>{_number(v.get('tolerance'))}</td>"
                    f"<td>{v.get('tokens', '')}</td><td><small>before <code>{html.escape(str(d.get('before', '')))}"
                    f"</code><br>after <code>{html.escape(str(d.get('after', '')))}</code></small></td></tr>")
    return (head + "<table><tr><th>checkpoint</th><th>refit check</th><th>largest decision deviation</th>"
            "<th>tolerance</th><th>tokens held after</th><th>state digests</th></tr>" + "".join(rows) + "</table>"
            + "".join(_difference(v) for v in verification.values())
            + "<p><small>Refit check: the memory after deletion is compared with an exact fixed-C solve over the "
            "tokens it retains, on its tokens and on probes at the removed keys.</small></p>")


def _difference(v: dict) -> str:
    d = v.get("never_saw_difference")
    if not d:
        return ""
    if "not_measured" in d:
        return (f"<p>The distance to a replay without the patient was not measured "
                f"({html.escape(d['not_measured'])}).</p>")
    return (f"<p>Against the memory a replay without the patient gives: {d['tokens_only_in_decremented']} token(s) "
            f"held only after the decrement, {d['tokens_only_in_replayed']} only after the replay; on "
            f"{d['probe_queries']} probe queries the outputs differ by at most {_number(d['max_output_deviation'])} "
            f"(median {_number(d['median_output_deviation'])}).</p>")


def _kept(cert: Certificate) -> str:
    stale = cert.artifacts_marked_stale
    stale_text = (f"Marked stale (computed before the deletion; regenerated by the next scheduled run): "
                  f"{html.escape(', '.join(stale))}." if stale else "No report is left stale.")
    scope = cert.never_saw_equivalence
    equal = "".join(f"<li>{html.escape(x)}</li>" for x in scope.get("equal", []))
    differ = "".join(f"<li>{html.escape(x)}</li>" for x in scope.get("not_equal", []))
    recomputed = cert.recomputed_without_the_patient
    return ("<h2>Equal to never having seen the patient?</h2>"
            + (f"<p>Recomputed by this deletion from the store without the patient: "
               f"{html.escape(', '.join(recomputed))}.</p>" if recomputed else "")
            + (f"<p>Equal to what a run that never saw the patient makes:</p><ul>{equal}</ul>" if equal else "")
            + (f"<p><b>Not</b> equal to it:</p><ul>{differ}</ul>" if differ else
               "<p>Nothing derived from the patient is left that a run without them would not also make.</p>")
            + f"<h2>What was kept, and why</h2><ul><li>{stale_text}</li>"
            f"<li>The patient's keyed hash stays on the suppression list, so that a later extraction from the "
            f"unchanged source does not bring the patient back.</li></ul>")


def _ordinal(n) -> str:
    if not isinstance(n, int):
        return str(n)
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def render_certificate_html(cert: Certificate, name: str = "", threshold: int = DEFAULT_THRESHOLD) -> str:
    """The certificate ``cert`` (its JSON, as issued) as one offline HTML page; ``name``: its file name;
    ``threshold``: counts of stays below it show as "<threshold" (the cohort config's small-cell threshold)."""
    cid = cert.certificate_id
    path = f"certificates/{name}" if name else f"certificates/{int(cid):06d}.json" if cid is not None else "CERT"
    # people count certificates from 1; the file and the log count entries from 0
    number = int(cid) + 1 if isinstance(cid, int) else "?"
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>Deletion certificate {number}</title>"
            f"<style>{STYLE}</style></head><body><h1>Certificate of deletion no. {number}</h1>"
            f"<p><small>The {_ordinal(number)} deletion of this workspace: file <code>{html.escape(path)}</code>, "
            f"entry {html.escape(str(cid))} of its log (counted from 0).</small></p>{_status(cert)}"
            f"<h2>Patient</h2><p>Identified only by a keyed hash, "
            f"{html.escape(str(cert.hash))}: "
            f"<code>{html.escape(str(cert.subject_hash))}</code>. The raw identifier is recorded nowhere in "
            f"this certificate or its ledger.</p>"
            f"{_removed(cert, threshold)}{_memories(cert)}{_kept(cert)}"
            f"<h2>How to verify</h2><p>From the workspace directory, re-check this certificate and the whole log "
            f"(add <code>--checkpoint FILE</code> with a copy of <code>checkpoint.json</code> you saved earlier to "
            f"check that nothing before it was rewritten or removed; add <code>--public-key KEY</code> with the log "
            f"signer's public key when you do not hold the signing key):</p><pre>forgetful verify "
            f"{html.escape(path)}</pre><p><small>The check recomputes every log entry from the certificates and pages "
            f"it names, the Merkle root and its Ed25519 signature against a key from outside the workspace, this "
            f"certificate's inclusion proof, and reports any memory "
            f"whose refit check or post-deletion scan did not pass. The log held "
            f"{cert.log_size_before} certificates before this one.</small></p></body></html>")
