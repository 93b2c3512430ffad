"""Progress lines for long steps (count, rate and ETA, printed unbuffered), and the units they print."""

from __future__ import annotations

import math
import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    """``3725`` -> ``1h02m05s``; ``42.5`` -> ``42s``."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


def format_bytes(n: float) -> str:
    """``924e9`` -> ``924.0 GB`` (decimal units, as disks are sold)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def format_gb(n: float) -> str:
    """A byte count as a value for a Param in GB, rounded up (two significant digits; whole GB from 100 GB on), no exponent:
    ``33024`` -> ``0.000034``, ``1.5e9`` -> ``1.5``, ``123e9`` -> ``123``, ``7e8`` -> ``0.7`` (``{n / 1e9:.2f}`` said ``0.00`` below 5 MB)."""
    gb = n / 1e9
    if gb <= 0:
        return "0"
    decimals = max(0, 1 - math.floor(math.log10(gb)))
    value = math.ceil(round(gb * 10**decimals, 9)) / 10**decimals  # round: 1.5 * 10 is 15.000000000000002
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def format_table(rows: list[tuple[str, str]]) -> str:
    """A two-column text table for the task log."""
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"  {key.ljust(width)}  {value}" for key, value in rows)


class Progress:
    """Prints ``label: done/total (pct) rate/s ETA`` every ``every`` items or ``interval`` seconds.

    :param total: number of items expected.
    :param label: what is counted, e.g. ``"rows"``.
    :param every: print after this many items since the last line.
    :param interval: or after this many seconds since the last line, whichever comes first.
    """

    def __init__(
        self,
        total: int,
        label: str = "items",
        every: int = 50,
        interval: float = 30.0,
        stream: TextIO | None = None,
        clock=time.monotonic,
    ) -> None:
        self.total = total
        self.label = label
        self.every = every
        self.interval = interval
        self.stream = stream or sys.stdout
        self.clock = clock
        self.start = clock()
        self.done = 0
        self._last_count = 0
        self._last_time = self.start

    def advance(self, n: int = 1, extra: str = "") -> bool:
        """Count ``n`` more items and print a line if one is due; True when it printed."""
        self.done += n
        now = self.clock()
        if self.done - self._last_count >= self.every or now - self._last_time >= self.interval or self.done >= self.total:
            self.report(extra)
            return True
        return False

    def report(self, extra: str = "") -> str:
        """Print and return the current progress line."""
        now = self.clock()
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        remaining = max(self.total - self.done, 0)
        eta = format_duration(remaining / rate) if rate > 0 else "?"
        pct = 100.0 * self.done / self.total if self.total else 100.0
        line = (
            f"{self.label}: {self.done}/{self.total} ({pct:.0f}%) {rate:.2f} {self.label}/s "
            f"elapsed {format_duration(elapsed)} ETA {eta}"
        )
        if extra:
            line += f" {extra}"
        print(line, file=self.stream, flush=True)
        self._last_count, self._last_time = self.done, now
        return line
