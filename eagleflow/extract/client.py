"""The extractor's side of SGLang's native API: one prefill-only ``/generate`` per row.

Request ids come from :func:`sglang_patch.request_ids.row_request_id` (``row{N}-…``), so the
engine's dump is named after the row's attempt. Answers are sorted into what the shard does
next: a result, a retryable :class:`RowFailed` (5xx, timeout, a dropped connection to an
engine that still answers), a final one (4xx, naming the row and the fields sent), or
:class:`ServerGone` (the engine refuses connections after it was ready).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from sglang_patch.request_ids import row_request_id


class ServerGone(Exception):
    """The engine is no longer there; no point sending more rows."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RowFailed(Exception):
    """One row could not be extracted; ``reason`` says why, ``retryable`` whether to try again."""

    def __init__(self, reason: str, retryable: bool = False) -> None:
        super().__init__(reason)
        self.reason, self.retryable = reason, retryable


class EngineClient:
    """Speaks SGLang's native ``/generate`` for one row at a time (thread-safe: a session per thread).

    :param url: the engine's base URL, e.g. ``http://127.0.0.1:30000``.
    :param request_timeout: seconds to wait for one answer.
    :param post: stands in for ``requests.Session.post`` (tests).
    """

    def __init__(self, url: str, request_timeout: float, post: Callable[..., Any] | None = None) -> None:
        import requests

        self.url = url.rstrip("/")
        self.request_timeout = request_timeout
        self._local = threading.local()
        self._post = post
        self._requests = requests

    def _session(self) -> Any:
        if not hasattr(self._local, "session"):
            self._local.session = self._requests.Session()
        return self._local.session

    def reachable(self) -> bool:
        """Whether the engine still accepts connections (any HTTP answer counts)."""
        try:
            self._requests.get(f"{self.url}/health", timeout=5)
        except self._requests.RequestException:
            return False
        return True

    def generate(self, row: int, input_ids: list[int]) -> tuple[str, dict[str, Any]]:
        """Send one prefill-only request for dataset row ``row``; return ``(rid, meta_info)`` or raise."""
        rid = row_request_id(row)
        answer = self.complete(rid, input_ids, max_new_tokens=0, temperature=0.0, row=row)
        return rid, answer.get("meta_info", {})

    def complete(
        self, rid: str, input_ids: list[int], max_new_tokens: int, temperature: float, row: int | None = None
    ) -> dict[str, Any]:
        """One ``/generate`` request; SGLang's answer (``text``, ``output_ids``, ``meta_info``) or raise.

        :param row: the dataset row the request is for, named in a 4xx error.
        """
        body = {"rid": rid, "input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature}}
        post = self._post or self._session().post
        try:
            response = post(f"{self.url}/generate", json=body, timeout=self.request_timeout)
        except self._requests.ConnectionError as exc:
            if self.reachable():
                raise RowFailed(f"connection dropped ({exc}); the engine still answers", retryable=True) from exc
            raise ServerGone(f"engine at {self.url} refuses connections (it was ready before): {exc}") from exc
        except self._requests.Timeout as exc:
            raise RowFailed(f"no answer within {self.request_timeout:.0f}s (--request-timeout)", retryable=True) from exc
        if response.status_code >= 500:
            raise RowFailed(f"engine answered {response.status_code}: {error_message(response)}", retryable=True)
        if response.status_code >= 400:
            raise RowFailed(
                f"engine rejected the request{'' if row is None else f' for row {row}'} with {response.status_code}: "
                f"{error_message(response)} (request fields sent: rid, input_ids, sampling_params)"
            )
        answer = response.json()
        return answer[0] if isinstance(answer, list) else answer


def error_message(response: Any) -> str:
    """The message of an SGLang error answer, whichever of its error shapes it has (at most 500 chars)."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        error = data.get("error", data.get("message", data.get("detail", data)))
        if isinstance(error, dict):
            error = error.get("message", error)
        return str(error)[:500]
    return str(data)[:500]
