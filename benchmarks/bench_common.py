"""What every benchmark shares: a row per measured figure (its goal, pass/fail), the table
``bench.py`` prints, and a scratch folder inside the repo's cache (the disk the pipeline uses)."""

from __future__ import annotations

import contextlib
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the benchmarks run from a checkout: its eagleflow and sglang_patch


@contextlib.contextmanager
def scratch(name: str) -> Iterator[Path]:
    """An empty ``.cache/<name>`` folder, removed afterwards (GBs of test files must not linger)."""
    work = REPO / ".cache" / name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


@dataclass(frozen=True)
class Row:
    """A measured figure. ``ok`` is None for a figure that has no goal (reported only)."""

    figure: str
    value: str
    goal: str
    ok: bool | None
    note: str = ""

    @property
    def verdict(self) -> str:
        return {True: "pass", False: "FAIL", None: "-"}[self.ok]


def ratio_row(figure: str, measured: float, baseline: float, goal: float, unit: str = "MB/s", note: str = "") -> Row:
    """``measured / baseline`` against ``>= goal``, both values shown."""
    ratio = measured / baseline if baseline else 0.0
    return Row(figure, f"{measured:,.0f} vs {baseline:,.0f} {unit} = {ratio:.2f}x", f">= {goal:.2f}x", ratio >= goal, note)


def median(values: list[float]) -> float:
    return statistics.median(values)


def print_table(rows: list[Row]) -> str:
    """The table as text (also printed)."""
    header = ("figure", "measured", "goal", "result")
    cells = [header] + [(r.figure, r.value, r.goal, r.verdict) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(4)).rstrip() for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    notes = [f"  [{n}] {r.figure}: {r.note}" for n, r in enumerate(rows, 1) if r.note]
    text = "\n".join(lines + ([""] + notes if notes else []))
    print(text, flush=True)
    return text


def measure_in_scratch(measure: Callable[[Path], list[Row]], name: str) -> list[Row]:
    """``measure(work)`` in the scratch folder ``.cache/<name>``, removed afterwards."""
    with scratch(name) as work:
        return measure(work)


def run_alone(measure: Callable[[Path], list[Row]], name: str) -> int:
    """One benchmark module run by itself: its rows as a table."""
    print_table(measure_in_scratch(measure, name))
    return 0


def run_sections(title: str, sections: list[tuple[str, Callable[[], list[Row]]]]) -> int:
    """Measure each section in turn (timed, with a heading), print one table; 1 if a row misses its goal."""
    started = time.monotonic()
    rows: list[Row] = []
    for name, measure in sections:
        began = time.monotonic()
        print(f"== {name}", flush=True)
        rows += measure()
        print(f"== {name}: {time.monotonic() - began:.0f}s", flush=True)
    print(f"\n{title} ({time.monotonic() - started:.0f}s)\n", flush=True)
    print_table(rows)
    return 0 if all(row.ok is not False for row in rows) else 1
