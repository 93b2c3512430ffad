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
# A rid names files in the dump folder: <rid>.safetensors, <rid>.error.json, and while one is
# written its temporary name (mkstemp's) .<rid>.safetensors.XXXXXXXX.tmp, the longest: 26 bytes
# more than the rid. A file name holds at most 255 bytes (NAME_MAX), so a rid at most 229 (UTF-8).
NAME_MAX = 255
MAX_RID_BYTES = NAME_MAX - len("..safetensors.XXXXXXXX.tmp")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def rid_problem(rid: str) -> str | None:
    """Why ``rid`` cannot name a dump file in the dump folder (None when it can)."""
    if not rid:
        return "is empty"
    if "/" in rid or "\\" in rid or rid.startswith("."):
        return "must be a plain file name (no '/', '\\', leading '.')"
    if _CONTROL.search(rid):
        return "contains a control character"
    try:
        size = len(rid.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode (a lone surrogate)"
    if size > MAX_RID_BYTES:
        return f"is {size} bytes long; a dump file name holds at most {MAX_RID_BYTES}"
    return None


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
