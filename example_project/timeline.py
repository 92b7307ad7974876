"""Per-key timelines of task executions, as text for the terminal and as an SVG picture.

The demo records one :class:`Span` per execution and shows, for each pass (say "no lock" and
"with celery_dlock"), which keys ran more than once at the same time. Text rows show how many
executions of a key ran in each time cell; in the picture, overlapping executions are red.

    spans = [Span("crm:1", 0.0, 1.2, "w1", "ok"), Span("crm:1", 0.5, 1.4, "w2", "ok")]
    print(render_text({"no lock": spans}))
    write_picture({"no lock": spans}, "timeline.html")
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

__all__ = ["Span", "overlaps", "render_text", "write_picture"]


@dataclass(frozen=True)
class Span:
    """One execution of the task for ``key``, from ``start`` to ``end``.

    Times are seconds since the pass started; the span covers [start, end), so one execution
    ending as the next begins is no overlap, and a span with ``end <= start`` covers nothing.
    ``outcome`` is usually one of "ok", "dropped", "killed", "paused", "lost", "failed".
    """

    key: str
    start: float
    end: float
    worker: str
    outcome: str


def _peak(intervals: Iterable[tuple[float, float]]) -> int:
    """The most of the half-open ``intervals`` that cover one instant."""
    events: list[tuple[float, int]] = []
    for start, end in intervals:
        if end > start:
            events += [(start, +1), (end, -1)]
    # At equal times -1 sorts first: an interval ends before one that touches it begins.
    events.sort()
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def _by_key(spans: Iterable[Span]) -> dict[str, list[Span]]:
    grouped: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        grouped[span.key].append(span)
    return dict(sorted(grouped.items()))


def overlaps(spans: Iterable[Span]) -> dict[str, int]:
    """For each key, the most of its spans running at once (1: never overlapped)."""
    return {key: _peak((s.start, s.end) for s in group) for key, group in _by_key(spans).items()}


# -- text ------------------------------------------------------------------------------------

_END_MARKS = {"killed": "x", "paused": "z"}


def _cell(count: int) -> str:
    if count == 0:
        return " "
    if count == 1:
        return "█"
    return str(count) if count <= 9 else "+"


def _row(spans: Sequence[Span], width: int, duration: float) -> str:
    """One key's cells: each shows how many of ``spans`` ran at once within that cell."""
    step = duration / width
    counts = [
        _peak((max(s.start, i * step), min(s.end, (i + 1) * step)) for s in spans)
        for i in range(width)
    ]
    cells = [_cell(n) for n in counts]
    for span in spans:
        mark = _END_MARKS.get(span.outcome)
        if mark is None or span.end <= span.start:
            continue
        # The cell holding the span's last instant: end itself belongs to the next span.
        last = min(max(math.ceil(span.end / step) - 1, 0), width - 1)
        if counts[last] == 1:
            cells[last] = mark
    return "".join(cells)


def render_text(passes: dict[str, list[Span]], width: int = 60) -> str:
    """Text timeline: per pass, one row per key over ``width`` cells, then a time axis.

    A cell shows " " when nothing ran, "█" for one execution, 2-9 (or "+") when that many
    ran at once; "x" and "z" mark where a killed or paused execution stopped. Rows of keys
    that ever ran twice at once end with "← overlap". Spans that cover nothing are not shown.
    """
    if width < 1:
        raise ValueError(f"render_text(width={width!r}): width must be at least 1")
    label = max((len(s.key) for spans in passes.values() for s in spans), default=0)
    lines: list[str] = []
    for name, spans in passes.items():
        duration = max((s.end for s in spans), default=0.0)
        lines.append(f"{name}  ({len(spans)} executions over {duration:.1f} s)")
        if duration <= 0:
            lines.append("  (nothing ran)")
            continue
        peaks = overlaps(spans)
        for key, group in _by_key(spans).items():
            flag = "  ← overlap" if peaks[key] > 1 else ""
            lines.append(f"  {key:<{label}} │{_row(group, width, duration)}│{flag}")
        right = f"{duration:.1f} s"
        axis = "0 s".ljust(max(width - len(right), 4)) + right
        lines.append(f"  {'':<{label}}  {axis}")
    lines.append("█ one execution, 2-9 that many at once, x killed, z paused")
    return "\n".join(lines)


# -- picture ---------------------------------------------------------------------------------

_COLOURS = {
    "ok": "#4c9f50",
    "dropped": "#b0b0b0",
    "killed": "#e08a1e",
    "paused": "#8a6fbf",
    "lost": "#8c564b",
    "failed": "#404040",
}
_OTHER = "#4a7fb5"  # outcomes not in _COLOURS
_OVERLAP = "#d62728"

_PLOT_WIDTH = 760  # pixels for the whole time range
_LANE = 18  # pixels per key
_BAR = 12  # bar height within a lane
_CHAR = 7  # rough width of one character at font-size 12


def _attr(value: str) -> str:
    return escape(value, {'"': "&quot;"})


def _overlapping(spans: Sequence[Span]) -> set[int]:
    """Indexes of the spans (of one key) that overlap another of them."""
    found: set[int] = set()
    for i, a in enumerate(spans):
        for j, b in enumerate(spans[:i]):
            if a.start < b.end and b.start < a.end and a.end > a.start and b.end > b.start:
                found |= {i, j}
    return found


def _tick_step(duration: float) -> int:
    """Seconds between axis ticks: 1 for short runs, else 5 (or a multiple, for long ones)."""
    if duration <= 15:
        return 1
    return 5 * math.ceil(duration / 75)


def _svg(passes: dict[str, list[Span]]) -> str:
    """The picture as an ``<svg>`` element: one band per pass, one lane per key."""
    # One time scale for every pass, so that passes compare at a glance.
    duration = max((s.end for spans in passes.values() for s in spans), default=0.0) or 1.0
    label = max((len(s.key) for spans in passes.values() for s in spans), default=4)
    left = 16 + _CHAR * label
    width = left + _PLOT_WIDTH + 24
    step = _tick_step(duration)

    def x(t: float) -> float:
        return left + _PLOT_WIDTH * min(max(t, 0.0), duration) / duration

    out: list[str] = []
    y = 8
    for name, spans in passes.items():
        groups = _by_key(spans)
        out.append(f'<text x="8" y="{y + 14}" font-weight="bold">{escape(name)}</text>')
        y += 24
        if not groups:
            out.append(f'<text x="{left}" y="{y + 12}" fill="#666">(nothing ran)</text>')
            y += _LANE
        top, bottom = y, y + _LANE * len(groups)
        for t in range(0, math.floor(duration) + 1, step):
            out.append(
                f'<line x1="{x(t):.1f}" y1="{top}" x2="{x(t):.1f}" y2="{bottom + 4}" '
                f'stroke="#ddd"/>'
                f'<text x="{x(t):.1f}" y="{bottom + 16}" text-anchor="middle" '
                f'font-size="10" fill="#666">{t} s</text>'
            )
        for key, group in groups.items():
            out.append(f'<text x="{left - 8}" y="{y + 13}" text-anchor="end">{escape(key)}</text>')
            red = _overlapping(group)
            for i, s in enumerate(group):
                fill = _OVERLAP if i in red else _COLOURS.get(s.outcome, _OTHER)
                tip = f"{s.key}, {s.worker}, {s.start:.2f}\N{EN DASH}{s.end:.2f} s, {s.outcome}"
                if i in red:
                    tip += " (overlaps another execution of this key)"
                # At least a pixel wide, so that instantaneous executions stay visible.
                w = max(x(s.end) - x(s.start), 1.0)
                out.append(
                    f'<rect class="span" x="{x(s.start):.1f}" y="{y + (_LANE - _BAR) // 2}" '
                    f'width="{w:.1f}" height="{_BAR}" fill="{fill}" fill-opacity="0.85" '
                    f'stroke="#fff" stroke-width="0.5">'
                    f"<title>{escape(tip)}</title></rect>"
                )
            y += _LANE
        y = bottom + 32

    # Colour key, so that the picture explains itself without the HTML page around it.
    legend = [("overlap", _OVERLAP), *_COLOURS.items(), ("other", _OTHER)]
    lx = 8
    for outcome, colour in legend:
        out.append(
            f'<rect class="swatch" x="{lx}" y="{y}" width="12" height="12" fill="{colour}"/>'
            f'<text x="{lx + 16}" y="{y + 11}">{escape(outcome)}</text>'
        )
        lx += 28 + _CHAR * len(outcome)
    height = y + 20
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">\n'
        + "\n".join(out)
        + "\n</svg>\n"
    )


def write_picture(
    passes: dict[str, list[Span]], path: str | Path, *, title: str = "Executions per key"
) -> None:
    """Write the timelines as a standalone ``.svg`` or an ``.html`` page around the same SVG.

    Each pass is a band, each key a lane, each execution a bar coloured by outcome; bars of
    a key that ran twice at once are red. Hover a bar for its key, worker, times and outcome.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    svg = _svg(passes)
    if suffix == ".svg":
        text = '<?xml version="1.0" encoding="UTF-8"?>\n' + svg
    elif suffix == ".html":
        text = (
            "<!DOCTYPE html>\n"
            '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>{escape(title)}</title>\n</head>\n"
            '<body style="font-family: sans-serif; margin: 2em">\n'
            f"<h1>{escape(title)}</h1>\n"
            "<p>One band per pass, one lane per key, one bar per execution, coloured by "
            "outcome. <b style='color: #d62728'>Red</b> bars ran while another execution of "
            "the same key was running: the overlaps a per-key lock prevents. Hover a bar for "
            "its worker, times and outcome.</p>\n" + svg + "</body>\n</html>\n"
        )
    else:
        raise ValueError(
            f"write_picture(path={str(path)!r}): unsupported suffix {path.suffix!r}; "
            "use a path ending in .svg or .html"
        )
    path.write_text(text, encoding="utf-8")
