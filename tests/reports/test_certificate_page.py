"""The deletion certificate page reads as a document: status first, tables, the verify command, no JSON."""
from pipeline.certificate import Certificate
from reports.certificate_page import render_certificate_html as render_page

CERT = {"certificate_id": 3, "subject_hash": "ab" * 32, "hash": "HMAC-SHA256 (workspace key)", "mode": "decrement",
        "mode_meaning": "memories equal the fixed-C refit of their retained tokens",
        "removed": {"events_by_table": {"labevents": 1200, "chartevents": 5}, "stays": 2, "quarantine_rows": 0,
                    "per_stay_result_rows": 40, "per_stay_memories": 2, "cohort_memory_tokens": {"000001-x": 7}},
        "memory_digests": {"000001-x": {"before": "d0", "after": "d1"}},
        "verification": {"000001-x": {"passed": True, "max_decision_deviation": 2.5e-15, "tolerance": 1e-8,
                                      "tokens": 121, "never_saw_difference": {
                                          "tokens_only_in_decremented": 4, "tokens_only_in_replayed": 17,
                                          "probe_queries": 240, "max_output_deviation": 0.031,
                                          "median_output_deviation": 0.002}}},
        "residual_scan": {"rows_remaining": 0, "scanned": ["events", "per_stay_results"]},
        "artifacts_marked_stale": ["report.html"],
        "never_saw_equivalence": {"equal": ["event store rows"], "not_equal": ["cohort memory: evicted tokens"]},
        "code_version": "0.1.0+test", "issued_at": "2026-12-03T10:00:00+0000", "seconds": 0.2,
        "log_size_before": 3, "log_root_before": "ab" * 32, "recomputed_without_the_patient": [],
        "deleted_together": {"patients": 1, "meaning": "deleted alone"}}


def render_certificate_html(fields: dict, *args) -> str:
    return render_page(Certificate.from_json(fields), *args)


def test_a_verified_certificate_states_its_status_first_and_how_to_check_it():
    page = render_certificate_html(CERT, "000003.json")
    assert page.index("Status: verified at issue") < page.index("What was removed") < page.index("How to verify")
    assert "forgetful verify certificates/000003.json" in page
    assert "1,200" in page and "2.50e-15" in page and "per stay results" in page
    assert "000001-x" in page and "{" not in page.split("</style>")[1]          # tables, no JSON dump
    # decrement states its scope in words, and the measured distance to a replay
    assert "<b>Not</b> equal to it" in page and "cohort memory: evicted tokens" in page
    assert "17 only after the replay" in page and "at most 3.10e-02" in page
    # a small count of stays is hidden, and so is the count of icustays events that would give it away
    small = render_certificate_html(CERT | {"removed": CERT["removed"] | {"events_by_table": {"icustays": 4}}})
    assert "&lt;11" in small and "&lt;22" in small and "<td>4</td>" not in small


def test_a_failed_check_is_not_called_verified_and_empty_fields_are_explained():
    bad = CERT | {"verification": {"000001-x": CERT["verification"]["000001-x"] | {"passed": False}},
                  "residual_scan": {"rows_remaining": 3, "scanned": ["events"]}}
    page = render_certificate_html(bad)
    assert "Status: NOT verified" in page and "verified at issue" not in page
    assert "still found 3 row(s)" in page and "FAILED" in page
    empty = CERT | {"removed": {}, "verification": {}, "memory_digests": {}, "artifacts_marked_stale": []}
    page = render_certificate_html(empty)
    assert "the store held no event of this patient" in page
    assert "held none of this patient's tokens" in page and "No report is left stale" in page


def test_certificates_are_numbered_from_1_and_a_hidden_count_says_why():
    page = render_certificate_html(CERT | {"certificate_id": 0,
                                           "removed": CERT["removed"] | {"events_by_table": {"icustays": 4}}},
                                   "000000.json")
    assert "Certificate of deletion no. 1</h1>" in page and "no. 0" not in page
    assert "The 1st deletion of this workspace: file <code>certificates/000000.json</code>, entry 0 of its log" in page
    assert "each ICU stay has an admission and a discharge event here, so this count would give away the number " \
           "of stays, which is below 11" in page
    assert "counts of stays this small are not shown" in page
