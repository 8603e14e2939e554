"""The report as a person sees it: ``report.html`` rendered by headless Chromium at 1280 px.

A copy of the page gets a script that, once loaded, measures the layout and writes what it
found into the DOM, which ``--dump-dom`` prints; the report itself carries no script.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

WIDTH = 1280
_PROBE = """
<script>
window.addEventListener("load", () => {
  const page = document.documentElement;
  const h1 = document.querySelector("h1");
  const first = h1 ? h1.nextElementSibling : null;
  const out = {
    scrollWidth: page.scrollWidth,
    clientWidth: page.clientWidth,
    firstAfterTitle: first ? first.tagName + "#" + first.id : "",
    firstParagraph: (document.querySelector("p") || {}).id || "",
    summary: (document.getElementById("summary") || {}).innerText || "",
    text: document.body.innerText,
    images: Array.from(document.images).map(i => [i.naturalWidth, i.getBoundingClientRect().right]),
  };
  const pre = document.createElement("pre");
  pre.id = "probe";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def _chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",  # tests run as root in CI
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={profile}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def measure(page: Path, binary: str, work: Path) -> dict[str, Any]:
    """Layout facts of ``page`` at 1280 px wide: scroll and client width, the element after
    the title, the first paragraph's id, the summary, the visible text, images' right edges."""
    probe = work / "probe.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("</body>", _PROBE + "</body>"))
    result = _chromium(
        binary,
        work / "profile",
        f"--window-size={WIDTH},900",
        "--virtual-time-budget=5000",
        "--dump-dom",
        probe.as_uri(),
    )
    found = re.search(r'<pre id="probe">(.*?)</pre>', result.stdout, re.S)
    assert found, f"chromium printed no measurement: {result.stderr[-2000:]}"
    text = found.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    return json.loads(text)


def screenshot(page: Path, png: Path, binary: str, work: Path, height: int = 1600) -> Path:
    """A PNG of the top ``height`` px of ``page`` at 1280 px wide."""
    result = _chromium(
        binary,
        work / "profile-shot",
        f"--window-size={WIDTH},{height}",
        f"--screenshot={png}",
        page.as_uri(),
    )
    assert png.is_file(), f"no screenshot: {result.stderr[-2000:]}"
    return png


def print_pdf(page: Path, pdf: Path, binary: str, work: Path) -> bytes:
    """``page`` printed to PDF by Chromium (the print stylesheet applies); the PDF's bytes."""
    result = _chromium(
        binary,
        work / "profile-pdf",
        "--no-pdf-header-footer",
        f"--print-to-pdf={pdf}",
        page.as_uri(),
    )
    assert pdf.is_file(), f"no PDF: {result.stderr[-2000:]}"
    return pdf.read_bytes()


def assert_reads_well(facts: dict[str, Any]) -> None:
    """No horizontal scroll at 1280 px, the summary first, no e-notation in visible text."""
    assert facts["scrollWidth"] <= facts["clientWidth"], (
        f"horizontal overflow: {facts['scrollWidth']} px of content in {facts['clientWidth']} px"
    )
    assert facts["firstAfterTitle"] == "P#summary", facts["firstAfterTitle"]
    assert facts["firstParagraph"] == "summary"
    sentences = [s for s in re.split(r"(?<=\.)\s+", facts["summary"].strip()) if s]
    assert 3 <= len(sentences) <= 6, sentences
    assert "e-0" not in facts["text"]
    assert not re.search(r"\d\.?\d*e[-+]\d", facts["text"]), "a number in e-notation is visible"
    for natural, right in facts["images"]:
        assert natural > 0 and right <= facts["clientWidth"], "an image is missing or too wide"
