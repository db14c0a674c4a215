"""What the portal's pages compute from the gateway's answers: charts as SVG, a config's errors
placed at the lines they name, times people read. Pure: no bus, no web server."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from html import escape
from typing import Any

# A line per task: colours that stay apart for the colour-blind (Okabe-Ito), then repeated.
COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
MAX_SERIES = 16  # lines in one chart (more tasks: the first ones, and a note)
MAX_POINTS = 600  # points of one line drawn (more: thinned evenly, the last kept)


def when(value: str | None) -> str:
    """An ISO time as people read it: `2026-11-26 10:42:07` (UTC), or '' when none."""
    if not value:
        return ""
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        return str(value)[:32]
    if at.tzinfo is not None:
        at = at.astimezone(UTC)
    return at.strftime("%Y-%m-%d %H:%M:%S")


def ago(value: str | None, now: datetime | None = None) -> str:
    """How long ago: `42s`, `7m`, `3h`, `5d`."""
    if not value:
        return ""
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        return ""
    seconds = max(0.0, ((now or datetime.now(UTC)) - at).total_seconds())
    return duration(seconds)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return ""
    s = int(seconds)
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    if s < 172800:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d"


def between(start: str | None, end: str | None) -> str:
    if not start:
        return ""
    try:
        a = datetime.fromisoformat(start)
        b = datetime.fromisoformat(end) if end else datetime.now(UTC)
    except ValueError:
        return ""
    return duration((b - a).total_seconds())


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def pretty(config: Any) -> str:
    """A config as people write it: what is unset (null, empty) left out."""
    return json.dumps(_set(config), indent=2, ensure_ascii=False)


def _set(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _set(v) for k, v in value.items() if v is not None and v != [] and v != {}}
    if isinstance(value, list):
        return [_set(v) for v in value]
    return value


# ---------------------------------------------------------------- errors at their lines

_PART = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def path_parts(path: str) -> list[str | int]:
    """`taskRoles[1].memoryMB` -> ['taskRoles', 1, 'memoryMB']."""
    return [int(m[2]) if m[2] is not None else m[1] for m in _PART.finditer(path or "")]


def line_of(text: str, path: str) -> int | None:
    """The line (1-based) of `text` where the field `path` names is written, found by reading
    its keys in order (JSON `"key"`, YAML `key:`); the line of the deepest key found, or None.
    A list index is not resolved by position: the next key is looked for after its parent.
    Blanks within a line only (spaces and tabs, not any white space): with newlines in them, a
    config of blank lines cost time cubic in their number (3,000: 22 s of the portal's loop)."""
    pos, found = 0, None
    for part in path_parts(path):
        if isinstance(part, int):
            continue
        key = re.escape(part)
        m = re.compile(
            r"(?:\"" + key + r"\"[ \t\r\n]*:|^[ \t]*(?:-[ \t]*)?" + key + r"[ \t]*:)", re.M
        ).search(text, pos)
        if m is None:
            break
        pos = m.end()
        found = text.count("\n", 0, m.start() + len(m.group(0)) - len(m.group(0).lstrip())) + 1
    return found


@dataclass
class Annotated:
    """A config's text, a line at a time, with the problems found on each line."""

    lines: list[tuple[int, str, list[dict[str, str]]]] = field(default_factory=list)
    elsewhere: list[dict[str, str]] = field(default_factory=list)  # problems not placed at a line


def annotate(text: str, problems: Iterable[Mapping[str, Any]], kind: str = "error") -> Annotated:
    """`text` with each problem (`{"path", "reason"}`, or `{"line", "reason"}`) at its line."""
    at: dict[int, list[dict[str, str]]] = {}
    out = Annotated()
    for p in problems:
        item = {"path": str(p.get("path") or ""), "reason": str(p.get("reason") or ""), "kind": kind}
        line = p.get("line")
        if not isinstance(line, int):
            line = line_of(text, item["path"]) if item["path"] else None
        if line is None:
            out.elsewhere.append(item)
        else:
            at.setdefault(line, []).append(item)
    out.lines = [(n, line, at.get(n, [])) for n, line in enumerate(text.splitlines() or [""], 1)]
    # A problem placed past the end (a line number from an error at the end of the text).
    last = len(out.lines)
    for n, items in at.items():
        if n > last:
            out.elsewhere.extend(items)
    return out


# ---------------------------------------------------------------- charts


@dataclass
class Series:
    label: str
    points: list[tuple[float, float]]  # (x, y), x ascending


def _nice(low: float, high: float, ticks: int = 5) -> list[float]:
    if not math.isfinite(low) or not math.isfinite(high):
        return []
    if high <= low:
        high = low + (abs(low) or 1.0)
    raw = (high - low) / ticks
    if not math.isfinite(raw) or raw <= 0:  # a range past the largest float: no round ticks
        return []
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(low / step) * step
    out = []
    # Counted, not added up: a step below the values' rounding (0.3 against 0.1 + 0.2) left
    # `v += step` where it was, for ever, and one job page hung the portal.
    for i in range(ticks + 2):
        v = first + i * step
        if v > high + step * 1e-9:
            break
        out.append(round(v, 12))
    return out


def _along(v: float, low: float, high: float) -> float:
    """Where `v` lies from `low` (0) to `high` (1). Halved first when the span is past the largest
    float (a task may print 1e308 and -1e308: any finite value is taken)."""
    span = high - low
    if math.isfinite(span):
        return (v - low) / span
    return (v * 0.5 - low * 0.5) / (high * 0.5 - low * 0.5)


def _label(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.2g}"
    return f"{v:.4g}"


def _thin(points: Sequence[tuple[float, float]], most: int) -> list[tuple[float, float]]:
    if len(points) <= most:
        return list(points)
    step = len(points) / most
    kept = [points[int(i * step)] for i in range(most)]
    kept[-1] = points[-1]
    return kept


def el(tag: str, text: str | None = None, **attrs: object) -> str:
    """One SVG element: attributes by keyword (`_` becomes `-`; floats to one decimal), text
    escaped. Presentation attributes only: the page's content policy allows no style attribute."""

    def shown(v: object) -> str:
        return f"{v:.1f}" if isinstance(v, float) else escape(str(v))

    a = "".join(f' {k.rstrip("_").replace("_", "-")}="{shown(v)}"' for k, v in attrs.items())
    return f"<{tag}{a}/>" if text is None else f"<{tag}{a}>{text}</{tag}>"


def _text(x: float, y: float, words: str, size: int = 10, anchor: str = "start", **more: object) -> str:
    return el(
        "text", escape(words), x=x, y=y, font_size=size, text_anchor=anchor, fill="currentColor", **more
    )


def _clock(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S")


def _svg(kind: str, width: int, height: int, title: str, body: list[str]) -> str:
    head = (
        f'<svg class="{kind}" role="img" viewBox="0 0 {width} {height}" width="100%" '
        f'preserveAspectRatio="xMidYMid meet" xmlns="http://www.w3.org/2000/svg">'
    )
    return head + el("title", escape(title)) + "".join(body) + "</svg>"


def line_chart(
    title: str,
    series: Sequence[Series],
    x_label: str,
    width: int = 640,
    height: int = 240,
    x_is_time: bool = False,
    from_zero: bool = False,
) -> str:
    """An SVG line chart (no script: it draws without JavaScript, and the page's content policy
    allows no inline code): axes with round ticks, a line per series, its last value in a
    tooltip (`<title>`), a legend. `from_zero`: the y axis starts at 0 (counts)."""
    left, right, top, bottom = 56, 12, 26, 40
    shown = [s for s in series if s.points][:MAX_SERIES]
    xs = [x for s in shown for x, _ in s.points]
    ys = [y for s in shown for _, y in s.points]
    out = [_text(left, 16, title, 13, font_weight="bold")]
    if not xs:
        out.append(_text(left, height // 2, "no points yet", 12))
        return _svg("chart", width, height, title, out)
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if from_zero:  # counts: the axis starts at 0, and shows at least 0 to 1
        y0, y1 = min(0.0, y0), max(y1, 1.0)
    if x1 - x0 < (60 if x_is_time else 1):  # a time axis spans a minute at least
        x1 = x0 + (60 if x_is_time else 1)
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) or 1) * 0.05, y1 + (abs(y1) or 1) * 0.05
    pw, ph = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + _along(x, x0, x1) * pw

    def py(y: float) -> float:
        return top + ph - _along(y, y0, y1) * ph

    out.append(el("rect", x=left, y=top, width=pw, height=ph, fill="none", stroke="#999", stroke_width=0.5))
    for t in _nice(y0, y1):
        if y0 <= t <= y1:
            y = py(t)
            out.append(el("line", x1=left, x2=left + pw, y1=y, y2=y, stroke="#ddd", stroke_width=0.5))
            out.append(_text(left - 4, y + 4, _label(t), anchor="end"))
    for t in _nice(x0, x1, 6):
        if x0 <= t <= x1:
            x = px(t)
            out.append(el("line", x1=x, x2=x, y1=top, y2=top + ph, stroke="#eee", stroke_width=0.5))
            out.append(_text(x, top + ph + 14, _clock(t) if x_is_time else _label(t), anchor="middle"))
    out.append(_text(left + pw / 2, height - 4, x_label, 11, "middle"))
    for i, s in enumerate(shown):
        colour = COLOURS[i % len(COLOURS)]
        pts = _thin(s.points, MAX_POINTS)
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        label = escape(s.label)
        out.append(
            el(
                "polyline",
                el("title", label),
                class_="series",
                data_series=s.label,
                points=path,
                fill="none",
                stroke=colour,
                stroke_width=1.5,
            )
        )
        last_x, last_y = pts[-1]
        at = _clock(last_x) if x_is_time else _label(last_x)
        tip = el("title", escape(f"{s.label}: {_label(last_y)} at {x_label} {at}"))
        out.append(el("circle", tip, cx=px(last_x), cy=py(last_y), r=2.5, fill=colour))
        lx = left + 8 + (i % 4) * (pw // 4)
        ly = top + 12 + (i // 4) * 13
        out.append(el("rect", x=lx, y=ly - 8, width=10, height=3, fill=colour))
        out.append(_text(lx + 14, ly - 4, s.label))
    return _svg("chart", width, height, title, out)


def metric_charts(batches: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One chart per metric, a line per task: by step when every point of the metric has one,
    else by time. `batches`: the gateway's `metrics` answers' batches, oldest first."""
    by_metric: dict[str, dict[str, list[tuple[float | None, float, float]]]] = {}
    for batch in batches:
        task = str(batch.get("task", "?"))
        for p in batch.get("points") or []:
            try:
                t = datetime.fromisoformat(p["t"]).timestamp()
                value = float(p["value"])
            except (KeyError, TypeError, ValueError):
                continue
            if not math.isfinite(value):
                continue
            step = p.get("step")
            by_metric.setdefault(str(p.get("name")), {}).setdefault(task, []).append(
                (float(step) if isinstance(step, int | float) else None, t, value)
            )
    charts = []
    for name in sorted(by_metric):
        tasks = by_metric[name]
        by_step = all(step is not None for pts in tasks.values() for step, _, _ in pts)
        series = []
        for task in sorted(tasks):
            pts = tasks[task]
            xy = sorted(((s if by_step and s is not None else t), v) for s, t, v in pts)
            series.append(Series(task, xy))
        charts.append(
            {
                "name": name,
                "tasks": len(series),
                "points": sum(len(s.points) for s in series),
                "svg": line_chart(name, series, "step" if by_step else "time (UTC)", x_is_time=not by_step),
            }
        )
    return charts


def allocation_chart(samples: Iterable[Sequence[Any]]) -> str:
    """GPUs in use and GPUs there over time, from the gateway's `[[time, used, total], ...]`."""
    used, total = [], []
    for row in samples:
        try:
            t = datetime.fromisoformat(str(row[0])).timestamp()
            used.append((t, float(row[1])))
            total.append((t, float(row[2])))
        except (IndexError, TypeError, ValueError):
            continue
    return line_chart(
        "GPUs allocated",
        [Series("used", used), Series("total", total)],
        "time (UTC)",
        x_is_time=True,
        from_zero=True,
    )


# ---------------------------------------------------------------- an attempt's timeline


def timeline(attempts: Sequence[Mapping[str, Any]], now: datetime | None = None, width: int = 1000) -> str:
    """Attempts as bars on one time axis (placed to ended), coloured by how each ended."""
    spans = []
    now_t = (now or datetime.now(UTC)).timestamp()
    for a in attempts:
        try:
            start = datetime.fromisoformat(a["placed_at"]).timestamp()
            end = datetime.fromisoformat(a["ended_at"]).timestamp() if a.get("ended_at") else now_t
        except (KeyError, TypeError, ValueError):
            continue
        spans.append((int(a.get("attempt", 0)), start, max(end, start), str(a.get("outcome") or "RUNNING")))
    if not spans:
        return ""
    t0 = min(s for _, s, _, _ in spans)
    t1 = max(e for _, _, e, _ in spans)
    t1 = t1 if t1 > t0 else t0 + 1
    left, row = 80, 22
    height = row * len(spans) + 24
    colour = {"SUCCEEDED": "#009E73", "FAILED": "#D55E00", "STOPPED": "#999999", "RUNNING": "#0072B2"}
    out = []
    pw = width - left - 12
    for i, (n, start, end, outcome) in enumerate(spans):
        x = left + (start - t0) / (t1 - t0) * pw
        w = max(2.0, (end - start) / (t1 - t0) * pw)
        y = 4 + i * row
        out.append(_text(4, y + 14, f"attempt {n}", 11))
        tip = el("title", escape(f"attempt {n}: {outcome}, {duration(end - start)}"))
        out.append(el("rect", tip, x=x, y=y, width=w, height=row - 6, fill=colour.get(outcome, "#E69F00")))
    out.append(_text(left, height - 6, when(datetime.fromtimestamp(t0, UTC).isoformat())))
    out.append(_text(width - 12, height - 6, when(datetime.fromtimestamp(t1, UTC).isoformat()), anchor="end"))
    return _svg("timeline", width, height, "attempts over time", out)
