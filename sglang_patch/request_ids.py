"""Request ids (rids) the pipeline sends and the capture skips: the one place their format lives.

The extractor names each request after its dataset row, ``row{N}-{12 hex}`` (unique per
attempt, the row readable back), the capture check its own ``verify-row{N}-{12 hex}``; the
engine names its dump after the rid. Two kinds are never captured: SGLang's own health checks
(rid prefix ``HEALTH_CHECK``, ``sglang/srt/constants.py``; ``/health``'s rid is
``f"{prefix}_{uuid}"``) and the regeneration of a dataset's answers (``regen-…``), whose prefill
is an extend pass like any other. Standard library only: the hook imports this inside the
SGLang server.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

HEALTH_CHECK_PREFIX = "HEALTH_CHECK"
REGENERATE_PREFIX = "regen-"
NOT_CAPTURED_PREFIXES = (HEALTH_CHECK_PREFIX, REGENERATE_PREFIX)
_ROW_RID = re.compile(r"^row(\d+)-")


def row_request_id(row: int) -> str:
    """A new rid for one attempt at dataset row ``row``: ``row{row}-{12 hex digits}``."""
    return f"row{row}-{uuid.uuid4().hex[:12]}"


def verify_request_id(row: int) -> str:
    """A new rid for the capture check's request of dataset row ``row``: ``verify-row{row}-{12 hex}``.

    Captured like an extraction rid (:func:`is_captured`), but never read back as a row's attempt,
    so neither the extractor's clean-up nor a row's test fault touches it.
    """
    return f"verify-row{row}-{uuid.uuid4().hex[:12]}"


def row_of_request_id(rid: str) -> int | None:
    """The dataset row a rid made by :func:`row_request_id` names, else None."""
    match = _ROW_RID.match(rid)
    return int(match.group(1)) if match else None


def row_request_glob(row: int) -> str:
    """A glob matching every dump or error file of ``row``'s requests in a dump folder."""
    return f"row{row}-*"


def regenerate_request_id(row: int, turn: int) -> str:
    """A new rid for regenerating assistant turn ``turn`` of dataset row ``row`` (never captured)."""
    return f"{REGENERATE_PREFIX}row{row}-turn{turn}-{uuid.uuid4().hex[:8]}"


def is_captured(rid: Any) -> bool:
    """Whether a request's states are captured: every named request but health checks and regeneration."""
    return rid is not None and not str(rid).startswith(NOT_CAPTURED_PREFIXES)
