"""How a figure is written on the eagleflow pages: the templates' filters (a missing or non-finite figure as '–').

Beside the plugin's app (``eagleflow_ui.py``), which registers them in its templates.
"""

from __future__ import annotations

import math
import time
from typing import Any

from eagleflow.progress import format_duration


def _real(value: Any) -> float | None:
    """``value`` as a finite number, or None for anything else (None, text, a list, an undefined field)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _num(value: Any, digits: int = 3) -> str:
    if _real(value) is None:
        return "–"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.{digits}g}" if abs(value) < 1e-2 else f"{value:.{digits}f}"
    return f"{int(value):,}"


def _percent(value: Any) -> str:
    number = _real(value)
    return "–" if number is None else f"{100 * number:.1f}%"


def _thousands(value: Any) -> str:
    number = _real(value)
    return "–" if number is None else f"{number:,.0f}"


def _scientific(value: Any) -> str:
    number = _real(value)
    return "–" if number is None else f"{number:.2e}"


def _age(timestamp: Any) -> str:
    if not _real(timestamp):
        return "–"
    seconds = max(0, time.time() - timestamp)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def _duration(seconds: Any) -> str:
    """``3725`` -> ``1h02m05s``; '–' for none (a training that did not record its time)."""
    number = _real(seconds)
    return "–" if number is None else format_duration(number)


def _when(iso: Any) -> str:
    """``2026-12-02T02:05:16.34+00:00`` -> ``2026-12-02 02:05 UTC`` (Airflow stores UTC); '–' for none."""
    return f"{iso[:10]} {iso[11:16]} UTC" if isinstance(iso, str) and len(iso) >= 16 else "–"


FILTERS = {
    "num": _num, "percent": _percent, "age": _age, "thousands": _thousands, "scientific": _scientific, "when": _when,
    "duration": _duration,
}
