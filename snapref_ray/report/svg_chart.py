"""Charts written as SVG text: a figure with a title band and plot areas with axes, bars and lines.

The report draws a few bar charts and histograms (report/plots.py, report/judging.py); this module is
the little of a plotting library they need, so a job's report neither imports nor waits on one.

A :class:`Chart` is a figure in points (1/72 in, the SVG's user unit): a bold title and a muted
subtitle in a band at the top, then one or more :class:`Plot` areas placed by the caller. A plot maps
data to points through its limits and draws, in call order, grid lines, bars (``<rect>``), a dashed
horizontal line, text, axes with tick marks and labels, a title and a legend. Every element a test
or a reader may want back can carry an ``id``; each plot is a ``<g class="axes">``, each tick a
``<g class="xtick">`` / ``<g class="ytick">`` holding its mark (``<line>``) and label (``<text>``),
so a value can be read back through the drawn axis.

Text stays text (searchable, small) and is escaped; coordinates are written with three decimals, so
the same chart gives the same bytes.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["Chart", "LegendEntry", "Plot", "nice_step", "nice_ticks", "tick_labels", "text_width"]

FONT_SIZE = 9.0  # tick labels and axis labels
TITLE_SIZE = 8.5  # a plot's own title
_FONT = "DejaVu Sans, Bitstream Vera Sans, Arial, Helvetica, sans-serif"
_TICK = 3.5  # tick mark length
_PAD = 3.5  # between a tick mark and its label
_AXIS = "#000000"
_STEPS = (1.0, 2.0, 2.5, 5.0)  # a tick step is one of these times a power of ten
_BAND = 0.55 * 72  # title band: title at its top, the subtitle under it


# ----------------------------------------------------------------------------- ticks


def nice_step(span: float, max_intervals: int, integer: bool = False) -> float:
    """The smallest step of 1, 2, 2.5 or 5 times a power of ten that splits ``span`` into at most
    ``max_intervals`` (a whole number at least 1 when ``integer``: counts are never ticked at 0.5).

    This is how matplotlib's ``MaxNLocator(steps=[1, 2, 2.5, 5, 10])`` chooses, so axes read as
    they did when the charts were drawn with it.
    """
    raw = span / max(max_intervals, 1) if span > 0 else 1.0
    exponent = math.floor(math.log10(raw)) - 1
    while True:
        for m in _STEPS:
            step = m * 10.0**exponent
            if integer and (step < 1 or step != round(step)):
                continue
            if step >= raw * (1 - 1e-9):
                return step
        exponent += 1


def nice_ticks(lo: float, hi: float, step: float, *, cover: bool = False) -> list[float]:
    """Multiples of ``step`` within ``[lo, hi]``; with ``cover``, the multiples from the last at or
    below ``lo`` to the first at or above ``hi`` (an axis's round ends)."""
    eps = 1e-9
    if cover:
        first, last = math.floor(lo / step + eps), math.ceil(hi / step - eps)
    else:
        first, last = math.ceil(lo / step - eps), math.floor(hi / step + eps)
    # Multiplying a whole number by the step (not adding steps) keeps 0.3 from being 0.30000000000000004 off.
    return [i * step for i in range(first, last + 1)]


def tick_labels(ticks: Sequence[float], step: float) -> list[str]:
    """Labels with the decimals the step needs, all alike (``0.0 0.5 1.0``, ``0.00 0.25``) and a true minus."""
    decimals = 0
    while decimals < 10 and abs(step * 10**decimals - round(step * 10**decimals)) > 1e-6 * step * 10**decimals:
        decimals += 1
    out = []
    for t in ticks:
        s = f"{t:.{decimals}f}"
        if float(s) == 0:
            s = s.lstrip("-")
        out.append(s.replace("-", "\u2212"))
    return out


def text_width(text: str, size: float = FONT_SIZE) -> float:
    """An estimate of drawn text width in points (DejaVu Sans averages ~0.6 em a character): for margins only."""
    return 0.6 * size * len(text)


# ----------------------------------------------------------------------------- SVG pieces


def _n(v: float) -> str:
    """A coordinate: three decimals, no trailing zeros, never ``-0``."""
    s = f"{v:.3f}".rstrip("0").rstrip(".")
    return "0" if s in ("-0", "") else s


def _attrs(**kw: str | float | None) -> str:
    parts = []
    for key, value in kw.items():
        if value is None:
            continue
        text = _n(value) if isinstance(value, float | int) and not isinstance(value, bool) else str(value)
        parts.append(f'{key.rstrip("_").replace("_", "-")}="{html.escape(text, quote=True)}"')
    return " ".join(parts)


def _text(x: float, y: float, s: str, *, size: float = FONT_SIZE, anchor: str = "start", **style) -> str:
    """``<text>`` with its baseline at ``y`` (callers place baselines: ~0.8 em under the top of a line)."""
    return f"<text {_attrs(x=x, y=y, font_size=size, text_anchor=anchor, **style)}>{html.escape(s, quote=False)}</text>"


def _line(x1: float, y1: float, x2: float, y2: float, **style) -> str:
    return f"<line {_attrs(x1=x1, y1=y1, x2=x2, y2=y2, **style)}/>"


@dataclass(frozen=True)
class LegendEntry:
    """A legend line: a short dashed line (``dash``) or a filled square, then the label in ``text_colour``."""

    label: str
    colour: str
    dash: str | None = None  # a line's stroke-dasharray; None draws a square patch
    text_colour: str = _AXIS


@dataclass
class Plot:
    """A plot area at ``(left, top)`` of ``width`` x ``height`` points showing ``xlim`` x ``ylim``.

    Drawing methods take data coordinates; ``y_down`` puts ``ylim[0]`` at the top (rows listed top
    to bottom).
    """

    left: float
    top: float
    width: float
    height: float
    xlim: tuple[float, float]
    ylim: tuple[float, float]
    id: str
    y_down: bool = False
    parts: list[str] = field(default_factory=list)

    def x(self, v: float) -> float:
        lo, hi = self.xlim
        return self.left + (v - lo) / ((hi - lo) or 1.0) * self.width

    def y(self, v: float) -> float:
        lo, hi = self.ylim
        share = (v - lo) / ((hi - lo) or 1.0)
        return self.top + (share if self.y_down else 1 - share) * self.height

    def bar(self, x0: float, x1: float, y0: float, y1: float, colour: str, *, id: str | None = None, edge=None):
        """A filled box between data ``x0..x1`` and ``y0..y1``; ``edge`` is ``(colour, width)`` of its outline."""
        px0, px1 = sorted((self.x(x0), self.x(x1)))
        py0, py1 = sorted((self.y(y0), self.y(y1)))
        stroke, stroke_width = edge if edge else (None, None)
        box = _attrs(id=id, x=px0, y=py0, width=px1 - px0, height=py1 - py0)
        self.parts.append(f"<rect {box} {_attrs(fill=colour, stroke=stroke, stroke_width=stroke_width)}/>")

    def group(self, id: str, draw) -> None:
        """Elements drawn by ``draw()`` inside one ``<g id=...>`` (one worker's busy boxes)."""
        start = len(self.parts)
        draw()
        inner = self.parts[start:]
        del self.parts[start:]
        self.parts.append(f"<g {_attrs(id=id)}>{''.join(inner)}</g>")

    def hline(self, y: float, colour: str, *, width: float = 1.0, dash: str | None = None, id: str | None = None):
        """A horizontal line across the plot at data ``y``."""
        py = self.y(y)
        self.parts.append(
            _line(
                self.left,
                py,
                self.left + self.width,
                py,
                id=id,
                stroke=colour,
                stroke_width=width,
                stroke_dasharray=dash,
            )
        )

    def y_grid(self, ticks: Sequence[float], colour: str = "#d1d9e0") -> None:
        """Dotted horizontal lines at ``ticks``; draw them first so the bars cover them."""
        for t in ticks:
            self.hline(t, colour, width=0.8, dash="0.8,1.32")

    def text(self, x: float, y: float, s: str, *, size: float = FONT_SIZE, colour: str = _AXIS) -> None:
        """Text starting at data ``(x, y)``, vertically centred on ``y``."""
        self.parts.append(_text(self.x(x), self.y(y) + 0.35 * size, s, size=size, fill=colour))

    def x_axis(self, ticks: Sequence[float], labels: Sequence[str] | None, label: str | None = None) -> None:
        """The bottom spine, tick marks at ``ticks`` and, unless ``labels`` is None (a shared axis), their labels."""
        bottom = self.top + self.height
        self.parts.append(_line(self.left, bottom, self.left + self.width, bottom, stroke=_AXIS, stroke_width=0.8))
        for i, t in enumerate(ticks):
            px = self.x(t)
            mark = _line(px, bottom, px, bottom + _TICK, stroke=_AXIS, stroke_width=0.8)
            words = _text(px, bottom + _TICK + _PAD + 0.8 * FONT_SIZE, labels[i], anchor="middle") if labels else ""
            self.parts.append(f'<g class="xtick">{mark}{words}</g>')
        if label:
            below = bottom + _TICK + _PAD + (1.2 * FONT_SIZE if labels else 0) + 3.5 + 0.8 * FONT_SIZE
            self.parts.append(_text(self.left + self.width / 2, below, label, anchor="middle"))

    def y_axis(
        self, ticks: Sequence[float], labels: Sequence[str] | None, label: str | None = None, *, marks: bool = True
    ) -> None:
        """The left spine, tick marks (unless not ``marks``) and labels at ``ticks``, and a rotated axis label."""
        self.parts.append(_line(self.left, self.top, self.left, self.top + self.height, stroke=_AXIS, stroke_width=0.8))
        for i, t in enumerate(ticks):
            py = self.y(t)
            mark = _line(self.left - (_TICK if marks else 0), py, self.left, py, stroke=_AXIS, stroke_width=0.8)
            x = self.left - (_TICK if marks else 0) - _PAD
            words = _text(x, py + 0.35 * FONT_SIZE, labels[i], anchor="end") if labels else ""
            self.parts.append(f'<g class="ytick">{mark}{words}</g>')
        if label:
            widest = max((text_width(s) for s in labels or ()), default=0.0)
            x = self.left - _TICK - _PAD - widest - 4 - 0.2 * FONT_SIZE
            y = self.top + self.height / 2
            self.parts.append(_text(x, y, label, anchor="middle", transform=f"rotate(-90 {_n(x)} {_n(y)})"))

    def title(self, s: str) -> None:
        """A plot's own title, left-aligned just above it."""
        self.parts.append(_text(self.left, self.top - 6, s, size=TITLE_SIZE))

    def legend(self, entries: Sequence[LegendEntry]) -> None:
        """Entries in a row above the plot's top right corner, where they never hide a bar."""
        right, baseline = self.left + self.width, self.top - 6
        pieces = []
        for e in reversed(entries):
            right -= text_width(e.label)
            pieces.append(_text(right, baseline, e.label, fill=e.text_colour))
            key_y = baseline - 0.35 * FONT_SIZE
            if e.dash:
                pieces.append(
                    _line(
                        right - 24, key_y, right - 4, key_y, stroke=e.colour, stroke_width=1.4, stroke_dasharray=e.dash
                    )
                )
            else:
                pieces.append(f"<rect {_attrs(x=right - 14, y=key_y - 4, width=10, height=8, fill=e.colour)}/>")
            right -= 24 + 12
        self.parts.append(f'<g class="legend">{"".join(reversed(pieces))}</g>')

    def svg(self) -> str:
        return f"<g {_attrs(id=self.id, class_='axes')}>{''.join(self.parts)}</g>"


class Chart:
    """A figure of ``width`` x ``height`` points with a title and a muted subtitle in a band at its top."""

    band = _BAND  # where the plots may start

    def __init__(self, width: float, height: float, title: str, subtitle: str, *, muted: str = "#59636e") -> None:
        self.width, self.height = width, height
        self.parts = [
            _text(7.2, 5.76 + 0.8 * 11, title, size=11, font_weight="bold"),
            _text(7.2, 23.04 + 0.8 * TITLE_SIZE, subtitle, size=TITLE_SIZE, fill=muted),
        ]
        self.plots: list[Plot] = []

    def plot(self, left: float, top: float, width: float, height: float, xlim, ylim, *, y_down: bool = False) -> Plot:
        """A new plot area (figure points); drawn in the order made."""
        p = Plot(left, top, width, height, tuple(xlim), tuple(ylim), id=f"axes-{len(self.plots) + 1}", y_down=y_down)
        self.plots.append(p)
        return p

    def text(self, x: float, y: float, s: str, *, colour: str = _AXIS) -> None:
        """Text with its baseline at figure point ``(x, y)``."""
        self.parts.append(_text(x, y, s, fill=colour))

    def svg(self) -> str:
        """The standalone SVG document (sized in points, white background)."""
        w, h = _n(self.width), _n(self.height)
        head = (
            '<?xml version="1.0" encoding="utf-8"?>\n'
            f'<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="{w}pt" height="{h}pt" '
            f'viewBox="0 0 {w} {h}" font-family="{_FONT}">\n'
            f'<rect width="{w}" height="{h}" fill="#ffffff"/>\n'
        )
        body = "\n".join([*self.parts, *(p.svg() for p in self.plots)])
        return f"{head}{body}\n</svg>\n"
