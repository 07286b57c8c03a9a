"""The text an FP8 teacher measures itself on when no --fp8-calibration file is given: English
prose and Python source, the two kinds of text the project's students are distilled on most.
Written for this project (no licence attached to it), so that the figure a teacher reports at
start-up is reproducible from the repository alone. The bench measures on other text
(bench/fp8_teacher.py's real-model section), so that a plan chosen here is judged on text it
was not chosen on.
"""

PROSE = """\
The harbour town woke slowly in winter. Before the light came, the bakers were already at work,
and the smell of bread drifted down the narrow streets toward the water, where the fishing boats
knocked gently against the stone quay. Most of the boats had not gone out for a week. A storm
had passed through on Tuesday, tearing slates from the roofs and flooding the cellars of the
houses nearest the shore, and the fishermen said the sea had not yet settled enough to be
trusted. They spent the mornings mending nets in the shelter of the old customs house, talking
about prices, about the new harbour master, and about the weather, which they discussed the way
other people discuss an unreliable relative.

The harbour master had arrived in the autumn from a much larger port in the south. He was a
careful man who wrote everything down. Within a month he had counted every mooring, measured
the depth of the channel at low tide, and sent a long letter to the regional council explaining
that the breakwater needed repairs that would cost more than the town could pay. The council
replied that it would consider the matter at its next meeting, which was not until March. The
fishermen, who had been saying the same thing about the breakwater for twenty years, were not
surprised, but they began to treat the new man with a little more warmth.

Scientists who study coastal erosion describe a shoreline as a system in balance. Waves carry
sand along the coast, depositing it in some places and removing it from others, and over many
years the shape of the beach reflects the average of these movements. When a harbour wall or a
breakwater is built, the balance changes. Sand that once moved freely piles up on one side of
the structure, while the beach on the other side, deprived of its supply, slowly retreats. This
is why a town that protects its harbour may find, a generation later, that its beaches have
become narrower and its cliffs less stable. Engineers now try to model these effects before
construction begins, using measurements of wave height, tidal range and sediment size, but the
models are only as good as the data that feed them, and long records are rare.

Learning a language as an adult is a different experience from learning one as a child. Adults
bring a large vocabulary of concepts and an ability to study grammar explicitly, which helps
them make rapid progress in the first months. Children, on the other hand, tend to acquire the
sound system of a new language more completely, and they are less embarrassed by mistakes. Many
teachers believe that the most important factor is not age but the amount of meaningful
practice a learner receives: conversations in which something real is at stake, reading that
is interesting for its own sake, and writing that someone will actually read. A student who
spends twenty minutes a day talking with a neighbour may learn more than one who spends two
hours with a textbook.

The history of timekeeping shows how practical needs shape technology. For most of human
history, people measured time by the sun, and noon was simply the moment when the sun stood
highest in the sky. Each town kept its own time, and this caused no difficulty as long as
travel was slow. The railways changed that. A train leaving one city at a scheduled hour would
arrive in another city whose clocks showed a different local time, and timetables became
confusing and even dangerous. Railway companies began to adopt a single standard time along
their lines, and governments eventually followed, dividing the world into time zones. Today,
atomic clocks keep time so precisely that an extra second must occasionally be added to keep
civil time in step with the slightly irregular rotation of the Earth.

A good recipe is a small piece of engineering. It lists its inputs, states the order of the
operations, and gives the conditions under which each step is complete: until the onions are
soft, until a knife comes out clean, until the sauce coats the back of a spoon. Experienced
cooks read a recipe the way programmers read a specification, looking for the places where the
author assumed something without saying it. How hot is a moderate oven? How large is a medium
egg? The best recipes answer these questions before they are asked, and they explain why a
step matters, so that the cook can adapt when the kitchen, the ingredients or the altitude are
different from the author's.

When the storm finally blew itself out, the sky over the harbour turned a pale, washed blue,
and the first boats went out on the morning tide. By the afternoon they were back, low in the
water, and the quay was crowded with buyers. The harbour master stood at the end of the
breakwater with his notebook, watching the waves break against the damaged stones, and wrote
down the time, the height of the tide and the direction of the wind.
"""

PYTHON = '''\
"""Small utilities for reading and summarising measurement logs."""

from __future__ import annotations

import csv
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator


@dataclass
class Series:
    """A named sequence of (time, value) samples, kept in time order."""

    name: str
    times: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)

    def add(self, time_s: float, value: float) -> None:
        if self.times and time_s < self.times[-1]:
            raise ValueError(f"{self.name}: sample at {time_s} s is older than the last one ({self.times[-1]} s)")
        self.times.append(time_s)
        self.values.append(value)

    def __len__(self) -> int:
        return len(self.values)

    def mean(self) -> float:
        return statistics.fmean(self.values) if self.values else math.nan

    def percentile(self, q: float) -> float:
        """The q-th percentile (0..100) by linear interpolation between the closest ranks."""
        if not self.values:
            return math.nan
        ordered = sorted(self.values)
        position = (len(ordered) - 1) * q / 100
        low, high = math.floor(position), math.ceil(position)
        if low == high:
            return ordered[low]
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    def rate(self) -> float:
        """The average change per second between the first and the last sample."""
        if len(self) < 2 or self.times[-1] == self.times[0]:
            return 0.0
        return (self.values[-1] - self.values[0]) / (self.times[-1] - self.times[0])


def read_rows(path: Path) -> Iterator[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        yield from csv.DictReader(f)


def collect(rows: Iterable[dict[str, str]], time_key: str = "time_s") -> dict[str, Series]:
    """Groups rows of (time, name, value) into one Series per name."""
    series: dict[str, Series] = {}
    for line, row in enumerate(rows, start=2):
        try:
            time_s, value = float(row[time_key]), float(row["value"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"line {line}: expected numeric {time_key!r} and 'value' columns") from e
        name = row.get("name", "value")
        series.setdefault(name, Series(name)).add(time_s, value)
    return series


def moving_average(values: list[float], window: int) -> list[float]:
    if window < 1:
        raise ValueError("window must be at least 1")
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def histogram(values: Iterable[float], bins: int = 10) -> list[tuple[float, float, int]]:
    values = list(values)
    if not values:
        return []
    low, high = min(values), max(values)
    width = (high - low) / bins or 1.0
    counts = defaultdict(int)
    for value in values:
        counts[min(int((value - low) / width), bins - 1)] += 1
    return [(low + i * width, low + (i + 1) * width, counts[i]) for i in range(bins)]


def summary(series: dict[str, Series]) -> str:
    lines = [f"{'name':<20} {'n':>6} {'mean':>10} {'p50':>10} {'p99':>10} {'rate/s':>10}"]
    for name in sorted(series):
        s = series[name]
        lines.append(f"{name:<20} {len(s):>6} {s.mean():>10.3f} {s.percentile(50):>10.3f} "
                     f"{s.percentile(99):>10.3f} {s.rate():>10.3f}")
    return "\\n".join(lines)


class RateLimiter:
    """Allows at most `limit` events in any window of `window_s` seconds."""

    def __init__(self, limit: int, window_s: float):
        self.limit, self.window_s = limit, window_s
        self.events: list[float] = []

    def allow(self, now_s: float) -> bool:
        self.events = [t for t in self.events if now_s - t < self.window_s]
        if len(self.events) >= self.limit:
            return False
        self.events.append(now_s)
        return True


if __name__ == "__main__":
    import sys

    table = collect(read_rows(Path(sys.argv[1])))
    print(summary(table))
'''

TEXTS = (PROSE, PYTHON)
