"""``report.html``: the report's blocks as one self-contained page (plots inlined as base64
PNG), readable at 1280 px without a horizontal scroll bar, and printable."""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Above this many columns a table is wide: its font shrinks (and the per-phase table turns).
MAX_COLUMNS = 8


@dataclass(frozen=True)
class Block:
    """One element of the report: ``kind`` is heading, summary, text, table or image; a
    table's ``titles`` and ``cells`` are already formatted for people."""

    kind: str
    text: str = ""
    titles: Sequence[str] = ()
    cells: Sequence[Sequence[str]] = ()
    path: Path | None = None
    wide: bool = False  # an image that spans the page's width


# Fits 1280 px without a horizontal scroll bar: long words wrap, wide tables shrink their font
# rather than overflow, figures scale down; printing drops the width limit and keeps each
# figure and table row on one page.
_CSS = (
    "body{font-family:system-ui,sans-serif;max-width:1180px;margin:1.5em auto;padding:0 1em;"
    "color:#222;line-height:1.4}"
    "h1{font-size:1.6em;margin-bottom:.3em}h2{font-size:1.2em;margin-top:1.6em;"
    "border-bottom:1px solid #ddd}"
    "p.summary{font-size:1.08em;background:#f4f7fb;border-left:4px solid #4a78b0;"
    "padding:.6em .9em}"
    "table{border-collapse:collapse;font-size:13px;margin:.4em 0 1em;max-width:100%}"
    "table.wide{font-size:11px}"
    "caption{text-align:left;font-size:13px;color:#444;padding-bottom:.2em}"
    "td,th{border:1px solid #ccc;padding:2px 6px;text-align:right;overflow-wrap:anywhere}"
    "td.t,th.t{text-align:left}th{background:#f0f0f0;font-weight:600;overflow-wrap:normal}"
    "tr:nth-child(even) td{background:#fafafa}"
    ".plots{display:grid;grid-template-columns:repeat(auto-fit,minmax(520px,1fr));gap:1em}"
    "figure{margin:0}figure.wide{grid-column:1/-1}img{max-width:100%;height:auto}"
    "figcaption{font-size:13px;color:#444}"
    "@media print{body{max-width:none;margin:0}figure,tr{break-inside:avoid}"
    "h2{break-after:avoid}.plots{display:block}}"
)


def _html_table(block: Block) -> str:
    if not block.cells:
        return "<p>(none)</p>"
    numeric = [
        all(c[i] == "–" or c[i][:1].isdigit() or c[i][:1] == "-" for c in block.cells)
        for i in range(len(block.titles))
    ]
    cls = ["" if n else ' class="t"' for n in numeric]
    head = "".join(f"<th{c}>{html.escape(t)}</th>" for t, c in zip(block.titles, cls, strict=True))
    rows = "".join(
        "<tr>"
        + "".join(f"<td{c}>{html.escape(v)}</td>" for v, c in zip(row, cls, strict=True))
        + "</tr>"
        for row in block.cells
    )
    wide = ' class="wide"' if len(block.titles) > MAX_COLUMNS else ""
    caption = f"<caption>{html.escape(block.text)}</caption>" if block.text else ""
    return f"<table{wide}>{caption}<tr>{head}</tr>{rows}</table>"


def to_html(blocks: list[Block]) -> str:
    """The blocks as one HTML page with every image inlined (no external files)."""
    body: list[str] = []
    first = True
    figures: list[str] = []
    for block in blocks:
        if block.kind != "image" and figures:
            body.append(f'<div class="plots">{"".join(figures)}</div>')
            figures = []
        if block.kind == "heading":
            tag = "h1" if first else "h2"
            first = False
            body.append(f"<{tag}>{html.escape(block.text)}</{tag}>")
        elif block.kind in ("text", "summary"):
            cls = ' class="summary" id="summary"' if block.kind == "summary" else ""
            body.append(f"<p{cls}>{html.escape(block.text.replace('`', ''))}</p>")
        elif block.kind == "table":
            body.append(_html_table(block))
        elif block.kind == "image" and block.path is not None:
            data = base64.b64encode(block.path.read_bytes()).decode("ascii")
            wide = ' class="wide"' if block.wide else ""
            alt = html.escape(block.text)
            figures.append(
                f'<figure{wide}><img alt="{alt}" src="data:image/png;base64,{data}">'
                f"<figcaption>{html.escape(block.text)}</figcaption></figure>"
            )
    if figures:
        body.append(f'<div class="plots">{"".join(figures)}</div>')
    title = html.escape(blocks[0].text if blocks else "report")
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width,initial-scale=1"><title>{title}'
        f"</title><style>{_CSS}</style></head><body>{''.join(body)}</body></html>\n"
    )
