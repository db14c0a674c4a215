"""Training metrics a job prints, a pure core: the declarations (`metrics: ["accuracy:PERCENTAGE",
"loss"]`), picking `name=value` / `name:value` out of an output line, and the bounded per-task
buffer of points the agent publishes in batches.

A declaration is `NAME` or `NAME:FORMAT`, FORMAT one of RAW (the default) or PERCENTAGE (how the
value is shown; it is stored as printed). Names are what the training prints (Arena's example:
`Train-accuracy`): a letter or '_' first, then letters, digits, '_', '-', '.' or '/'.

In a line, a declared name followed by `=` or `:` (spaces around it allowed) and a number is one
point; a line may hold several (`step=100 loss=0.31 accuracy: 0.93`). A `step=N` (or `step:N`)
on the same line is taken as the points' step. A name must not be glued to a longer word
(`val_loss=` is not `loss=`), and the number must end there (`loss=0.3x` is nothing).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from enum import StrEnum

MAX_METRICS = 16
MAX_NAME = 64
NAME_RE = r"^[A-Za-z_][A-Za-z0-9_./-]*$"
STEP = "step"
MAX_LINE = 4096  # only the start of a very long line is searched
MAX_PER_METRIC = 100  # points of one metric held between two publishes; thinned beyond


class MetricFormat(StrEnum):
    RAW = "RAW"
    PERCENTAGE = "PERCENTAGE"


@dataclass(frozen=True)
class MetricSpec:
    name: str
    format: MetricFormat = MetricFormat.RAW


def parse_spec(entry: str) -> MetricSpec:
    """`NAME` or `NAME:FORMAT`; raises ValueError saying what is wrong."""
    name, sep, fmt = entry.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"needs a metric name, as NAME or NAME:FORMAT, got {entry[:80]!r}")
    if len(name) > MAX_NAME:
        raise ValueError(f"the name must be at most {MAX_NAME} characters, got {len(name)}")
    if not re.match(NAME_RE, name):
        raise ValueError(
            "the name must start with a letter or '_' and use only letters, digits, '_', '-', '.' "
            f"and '/', got {name[:80]!r}"
        )
    if name == STEP:
        raise ValueError("'step' is not a metric: it is read from the same line as the points' step")
    if not sep:
        return MetricSpec(name)
    fmt = fmt.strip().upper()
    if fmt not in MetricFormat.__members__:
        raise ValueError(f"the format must be RAW or PERCENTAGE, got {entry.partition(':')[2][:40]!r}")
    return MetricSpec(name, MetricFormat(fmt))


def parse_specs(entries: list[str]) -> list[MetricSpec]:
    """Every declaration, or ValueError on the first bad or repeated one (with its index)."""
    specs: list[MetricSpec] = []
    for i, entry in enumerate(entries):
        try:
            spec = parse_spec(entry)
        except ValueError as exc:
            raise ValueError(f"metrics[{i}]: {exc}") from None
        if any(s.name == spec.name for s in specs):
            raise ValueError(f"metrics[{i}]: {spec.name!r} is declared twice")
        specs.append(spec)
    return specs


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"


class LinePicker:
    """Picks the declared metrics (and `step`) out of output lines."""

    def __init__(self, names: list[str]):
        self.names = frozenset(names)
        alternatives = "|".join(re.escape(n) for n in sorted({*names, STEP}, key=len, reverse=True))
        self._re = re.compile(rf"(?<![A-Za-z0-9_./-])({alternatives})\s*[=:]\s*({_NUMBER})(?![A-Za-z0-9_.])")

    def pick(self, line: str) -> tuple[list[tuple[str, float]], int | None]:
        """The (name, value) points on the line, in order, and its step (None if none)."""
        if not self.names:
            return [], None
        points: list[tuple[str, float]] = []
        step: int | None = None
        for m in self._re.finditer(line[:MAX_LINE]):
            name, text = m[1], m[2]
            try:
                value = float(text)
            except ValueError:
                continue
            if not math.isfinite(value):
                continue
            if name == STEP:
                if step is None and value.is_integer() and abs(value) < 2**53:
                    step = int(value)
            elif name in self.names:
                points.append((name, value))
        return points, step


Point = tuple[float, int | None, str, float]  # unix time, step, name, value


@dataclass
class Series:
    """One task's points between two publishes, bounded: beyond MAX_PER_METRIC points of a
    metric, every other one of them is dropped (an even thinning of a fast printer), counted in
    `dropped`. `latest` is each metric's last point ever (what `muster status` shows)."""

    pending: dict[str, list[Point]] = field(default_factory=dict)
    latest: dict[str, Point] = field(default_factory=dict)
    dropped: int = 0
    last_output: float | None = None  # unix time of the last output line
    changed: bool = False  # output or points since the last take

    def add(self, at: float, points: list[tuple[str, float]], step: int | None) -> None:
        self.last_output = at
        self.changed = True
        for name, value in points:
            point = (at, step, name, value)
            self.latest[name] = point
            held = self.pending.setdefault(name, [])
            held.append(point)
            if len(held) > MAX_PER_METRIC:
                kept = held[::2]
                self.dropped += len(held) - len(kept)
                self.pending[name] = kept

    def take(self) -> tuple[list[Point], int]:
        """The points held, oldest first, and how many were dropped; both start again."""
        points = sorted((p for held in self.pending.values() for p in held), key=lambda p: p[0])
        dropped = self.dropped
        self.pending, self.dropped, self.changed = {}, 0, False
        return points, dropped


def shown(value: float, fmt: MetricFormat | str) -> str:
    """A value as its declaration says: PERCENTAGE shows 0.93 as 93.00% (a value above 1 is
    taken as already a percentage), RAW as printed (up to 6 significant digits)."""
    if fmt == MetricFormat.PERCENTAGE:
        return f"{value * 100 if abs(value) <= 1 else value:.2f}%"
    return f"{value:.6g}"
