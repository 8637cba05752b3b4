"""The report as a person sees it: a headless Chromium screenshot (skipped where Chromium is not installed)."""
import shutil
import struct
import subprocess
import zlib

import pytest

from reports.html import render_report
from tests.builders import hand_result

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def png_rows(path):
    """Decode a non-interlaced 8-bit RGB(A) PNG into (width, height, channels, raw scanlines)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    width, height, depth, color = header[:4]
    assert depth == 8 and color in (2, 6)
    channels = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * channels
    rows, prev = [], bytearray(stride)
    for r in range(height):
        kind, line = raw[r * (stride + 1)], bytearray(raw[r * (stride + 1) + 1:(r + 1) * (stride + 1)])
        for i in range(stride):  # undo the PNG filter of this scanline
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + a) & 255
            elif kind == 2:
                line[i] = (line[i] + b) & 255
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, channels, rows


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed on this machine")
def test_report_renders_in_a_headless_browser(tmp_path):
    path = render_report(hand_result(), tmp_path)
    text = path.read_text()
    assert '<section id="headline">' in text and "Holm" in text
    assert 'aria-label="retention at the headline budget, per label and protocol"' in text
    assert "fraction kept (higher is better)" in text and "memory budget B (events" in text
    assert "8 events" in text and "8 tokens" not in text        # the units of the stream mode
    assert "memory budget as a fraction of the stay's stream" in text
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,2400",
                    f"--screenshot={shot}", path.as_uri()], check=True, capture_output=True, timeout=120)
    width, height, channels, rows = png_rows(shot)
    assert (width, height) == (1000, 2400)
    # the first 700 rows hold the heading, the headline figure and the findings: far from a blank page
    dark = [px for row in rows[:700] for px in row[::channels * 5] if px < 128]
    assert len(dark) / (700 * width / 5) > 0.005
    # SV is drawn in its own red (#c0392b; its headline bars at 0.8 opacity) within the first 2400 rows, which
    # machines with wider fallback fonts also reach: CI's chromium drew the first curve below row 1400
    reds = [y for y, row in enumerate(rows) for i in range(0, len(row) - 2, channels)
            if row[i] > 150 and row[i + 1] < 110 and row[i + 2] < 110 and row[i] - row[i + 1] > 80]
    assert len(reds) > 50
    assert min(reds) < 1000, "the headline figure's SV bars are not near the top of the page"


def first_screen(report, tmp_path, width=1400, height=900) -> dict:
    """What a person sees of ``report`` without scrolling, in a real browser: a copy with a script that, after
    layout, writes the bottom edge and text of the report's opening section into the DOM (the report itself has
    no script), read back with --dump-dom."""
    probe = tmp_path / "probe.html"
    probe.write_text(report.read_text().replace("</body>", """<script>
const s = document.getElementById("at-a-glance"), b = s ? s.getBoundingClientRect().bottom : 1e9;
document.body.setAttribute("data-bottom", String(b));
document.body.setAttribute("data-text", s ? s.innerText.replace(/\\s+/g, " ") : "");
</script></body>"""))
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'profile-dom'}", f"--window-size={width},{height}",
                          "--dump-dom", probe.as_uri()], check=True, capture_output=True, text=True, timeout=120).stdout
    import html as html_lib
    import re
    attrs = dict(re.findall(r'data-(bottom|text)="([^"]*)"', dom))
    return {"bottom": float(attrs["bottom"]), "text": html_lib.unescape(attrs["text"]), "height": height}


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed on this machine")
def test_the_first_screen_says_which_data_when_which_cohort_and_the_primary_finding(tmp_path):
    result = hand_result().with_metadata(data_source="/data/mimic-iv-3.1", generated_at="2026-12-06 03:00:00 UTC",
                                         tokens_mode="events")
    screen = first_screen(render_report(result, tmp_path), tmp_path)
    assert screen["bottom"] <= screen["height"], screen          # all of it without scrolling
    text = screen["text"]
    for what in ("Dataset mimic-iv-3.1", "run 2026-12-06 03:00:00 UTC", "cohort <11 ICU stays", "Primary finding."):
        assert what in text, (what, text)
