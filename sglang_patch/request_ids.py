"""Request ids (rids) the pipeline sends and the capture skips: the one place their format lives.

The extractor names each request after its dataset row, ``row{N}-{12 hex}`` (unique per
attempt, the row readable back); the engine names its dump after the rid. SGLang's own health
checks use the rid prefix ``HEALTH_CHECK`` (``sglang/srt/constants.py``; ``/health``'s rid is
``f"{prefix}_{uuid}"``) and must never be captured. Standard library only: the hook imports
this inside the SGLang server.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

HEALTH_CHECK_PREFIX = "HEALTH_CHECK"
_ROW_RID = re.compile(r"^row(\d+)-")


def row_request_id(row: int) -> str:
    """A new rid for one attempt at dataset row ``row``: ``row{row}-{12 hex digits}``."""
    return f"row{row}-{uuid.uuid4().hex[:12]}"


def row_of_request_id(rid: str) -> int | None:
    """The dataset row a rid made by :func:`row_request_id` names, else None."""
    match = _ROW_RID.match(rid)
    return int(match.group(1)) if match else None


def row_request_glob(row: int) -> str:
    """A glob matching every dump or error file of ``row``'s requests in a dump folder."""
    return f"row{row}-*"


def is_captured(rid: Any) -> bool:
    """Whether a request's states are captured: every named request except SGLang's health checks."""
    return rid is not None and not str(rid).startswith(HEALTH_CHECK_PREFIX)
