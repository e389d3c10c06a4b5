"""The pieces of a report page: escaped text, tables, inline images, the page and its style.

One self-contained HTML file: images are ``data:`` URIs, the style is inline, there is no
script and nothing is fetched; it reads on a phone (one column, wide tables scroll).
"""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

STYLE = """
:root { color-scheme: light; --line: #d8dde3; --soft: #f4f6f8; --bad: #c0392b; --good: #1e8449; }
* { box-sizing: border-box; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0;
  color: #1d232a; background: #fff; }
main { max-width: 1180px; margin: 0 auto; padding: 12px; }
h1 { font-size: 1.45em; margin: 0.3em 0; word-break: break-word; }
h2 { font-size: 1.2em; margin: 1.6em 0 0.5em; padding-top: 0.4em; border-top: 2px solid var(--line); }
h3 { font-size: 1.02em; margin: 1.1em 0 0.4em; }
nav { display: flex; flex-wrap: wrap; gap: 6px 14px; margin: 8px 0 4px; font-size: 0.95em; }
nav a { color: #2463a6; text-decoration: none; }
.lead { font-size: 1.05em; margin: 0.3em 0; }
.note { color: #5b6570; font-size: 0.92em; }
.warn { color: var(--bad); }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(150px, 1fr)); gap: 8px;
  margin: 10px 0; }
.card { background: var(--soft); border-radius: 6px; padding: 8px 10px; }
.card b { display: block; font-size: 1.25em; }
.card span { color: #5b6570; font-size: 0.85em; }
.scroll { overflow-x: auto; max-width: 100%; }
.tall { max-height: 70vh; overflow-y: auto; }
table { border-collapse: collapse; font-size: 0.9em; font-variant-numeric: tabular-nums; }
th, td { border-bottom: 1px solid var(--line); padding: 3px 8px; text-align: right;
  white-space: nowrap; }
th { background: var(--soft); position: sticky; top: 0; }
td.text, th.text { text-align: left; }
td.text { white-space: normal; overflow-wrap: anywhere; min-width: 6em; }
.figures { display: grid; grid-template-columns: repeat(auto-fill, minmax(300px, 1fr));
  gap: 6px 12px; }
.gallery { display: flex; flex-wrap: wrap; gap: 8px; }
.gallery figure { margin: 0; width: 122px; font-size: 0.78em; line-height: 1.25; }
.gallery img { width: 122px; height: 122px; object-fit: contain; background: var(--soft);
  display: block; border-radius: 4px; }
.gallery figure.wrong img, .gallery figure.wrong .missing { outline: 2px solid var(--bad);
  outline-offset: -2px; }
.gallery figure.wrong .verdict { color: var(--bad); }
.gallery .missing { width: 122px; height: 122px; background: var(--soft); display: flex;
  align-items: center; justify-content: center; text-align: center; color: #8a939c; }
figcaption { overflow-wrap: anywhere; }
.row { margin: 6px 0 12px; }
.bar { display: inline-block; height: 9px; background: #7fa7d1; vertical-align: middle; }
table.matrix td { padding: 0; width: 14px; min-width: 14px; height: 14px; border: 1px solid #fff;
  font-size: 0.7em; text-align: center; }
table.matrix th { font-size: 0.75em; padding: 0 3px; position: static; }
table.matrix.counts td { width: 30px; min-width: 30px; height: 26px; font-size: 0.85em; }
pre { background: var(--soft); padding: 8px; overflow-x: auto; font-size: 0.85em;
  white-space: pre-wrap; overflow-wrap: anywhere; }
pre.command span { white-space: pre; }
details > summary { cursor: pointer; color: #2463a6; margin: 8px 0 4px; font-weight: 600; }
svg.chart { width: 100%; max-width: 460px; height: auto; display: block; font-family: inherit; }
svg.chart .t { font-size: 13px; font-weight: 600; text-anchor: middle; }
svg.chart .f { fill: #fff; stroke: #9aa3ad; stroke-width: 1; }
svg.chart .g { stroke: #e6e9ed; stroke-width: 1; }
svg.chart .a { stroke: #9aa3ad; }
svg.chart .yl { font-size: 11px; text-anchor: end; fill: #444; }
svg.chart .xl { font-size: 11px; text-anchor: middle; fill: #444; }
svg.chart .lg { font-size: 11px; fill: #333; }
svg.chart circle:hover { r: 4; }
@media (max-width: 600px) {
  .figures { grid-template-columns: 1fr; }
  body { font-size: 14px; }
  .gallery figure, .gallery img, .gallery .missing { width: 96px; }
  .gallery img, .gallery .missing { height: 96px; }
  /* a chart is drawn at about 0.8 of its size here: its labels a size larger */
  svg.chart .yl, svg.chart .xl, svg.chart .lg { font-size: 13px; }
  svg.chart .t { font-size: 15px; }
}
"""


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def number(value: Any, digits: int = 4) -> str:
    """A cell's text: floats to ``digits`` decimals, None as a dash."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}" if abs(value) < 1e5 else f"{value:.4g}"
    return esc(value)


def percent(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{100 * value:.{digits}f}%"


@dataclass(frozen=True)
class Cell:
    """A table cell's HTML (already escaped) and whether it is text (left-aligned)."""

    html: str
    text: bool = False


def text(value: Any) -> Cell:
    return Cell(esc(value), text=True)


def table(
    headers: Sequence[str | Cell],
    rows: Iterable[Sequence[Cell | str]],
    table_id: str = "",
    tall: bool = False,
) -> str:
    """A table in a box that scrolls sideways on a narrow screen (and down when ``tall``);
    a plain string cell is a number's text, right-aligned."""

    def cell(tag: str, value: Cell | str) -> str:
        value = value if isinstance(value, Cell) else Cell(value)
        return (
            f"<{tag} class='text'>{value.html}</{tag}>"
            if value.text
            else f"<{tag}>{value.html}</{tag}>"
        )

    head = "".join(cell("th", h if isinstance(h, Cell) else text(h)) for h in headers)
    # A table of (name, value) rows has no header: no empty header row above it.
    thead = (
        f"<thead><tr>{head}</tr></thead>"
        if any(h.html if isinstance(h, Cell) else h for h in headers)
        else ""
    )
    body = "\n".join("<tr>" + "".join(cell("td", c) for c in row) + "</tr>" for row in rows)
    ident = f" id='{esc(table_id)}'" if table_id else ""
    box = "scroll tall" if tall else "scroll"
    return f"<div class='{box}'><table{ident}>{thead}<tbody>\n{body}\n</tbody></table></div>"


def cards(items: Iterable[tuple[str, str]]) -> str:
    """Key figures as tiles: (value, label)."""
    tiles = "".join(
        f"<div class='card'><b>{esc(v)}</b><span>{esc(k)}</span></div>" for v, k in items
    )
    return f"<div class='cards'>{tiles}</div>"


def preformatted(content: str) -> str:
    return f"<pre>{esc(content)}</pre>"


def command_line(content: str) -> str:
    """A command to copy: it wraps between its words only (never inside ``--a_flag``, where
    a browser may break a line after a hyphen)."""
    words = " ".join(f"<span>{esc(word)}</span>" for word in content.split(" "))
    return f"<pre class='command'>{words}</pre>"


def folded(summary: str, body: str, open_: bool = False) -> str:
    return f"<details{' open' if open_ else ''}><summary>{esc(summary)}</summary>{body}</details>"


@dataclass(frozen=True)
class Section:
    ident: str
    title: str
    body: str


def page(title: str, head: str, sections: Sequence[Section]) -> str:
    """The whole document: a title, a lead block ``head`` (HTML), links to each section, then
    the sections. No script, nothing fetched (the content security policy says so too)."""
    nav = "".join(f"<a href='#{s.ident}'>{esc(s.title)}</a>" for s in sections)
    body = "\n".join(
        f"<section id='{s.ident}'><h2>{esc(s.title)}</h2>\n{s.body}\n</section>" for s in sections
    )
    # No script, no request, no form to send anywhere, no base to redirect the links.
    policy = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
    policy += "form-action 'none'; base-uri 'none'"
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>\n"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>\n"
        f"<meta http-equiv='Content-Security-Policy' content=\"{policy}\">\n"
        f"<title>{esc(title)}</title><style>{STYLE}</style></head>\n"
        f"<body><main><h1>{esc(title)}</h1>\n{head}\n<nav>{nav}</nav>\n{body}\n</main></body></html>\n"
    )
