"""How a step hands its small JSON result to whoever launched it (the Airflow operator).

A step prints one line ``::eagleflow-result:: {json}`` as its last word; the operator that
streamed the child's output picks the last such line out of the stream and pushes it as
XCom. Plain stdout keeps every step runnable by hand, with the result visible.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any

RESULT_PREFIX = "::eagleflow-result:: "


def emit_result(result: dict[str, Any]) -> None:
    """Print ``result`` as the step's result line."""
    print(RESULT_PREFIX + json.dumps(result, sort_keys=True, default=str), file=sys.stdout, flush=True)


def find_result(lines: Iterable[str]) -> dict[str, Any] | None:
    """The last result printed among ``lines``, or None."""
    result = None
    for line in lines:
        if line.startswith(RESULT_PREFIX):
            result = json.loads(line[len(RESULT_PREFIX):])
    return result
