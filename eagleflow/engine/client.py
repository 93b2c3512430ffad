"""SGLang's native API as every stage speaks it, and the one retry policy of engine requests.

Extraction sends one prefill-only ``/generate`` per row and takes its dump; the capture check,
regeneration, evaluation and online training send theirs through the same :class:`EngineClient`.

Request ids come from :func:`sglang_patch.request_ids.row_request_id` (``row{N}-…``), so the
engine's dump is named after the row's attempt. Answers are sorted into what the shard does
next: a result; :class:`AnswerLost` (the connection dropped or the answer was cut off while the
engine still answers: the request may have run, so its dump may still come); a retryable
:class:`RowFailed` (5xx, timeout); a final one (4xx, naming the row and the fields sent);
:class:`ServerGone` (the engine refuses connections after it was ready, or it hangs: accepts
connections but answers nothing). :meth:`EngineClient.abort` is SGLang's ``/abort_request``:
the shard calls it before it sends a row again, so no request runs twice.

:func:`with_retries` is the one retry policy (tenacity's ``Retrying``): a retryable
:class:`RowFailed` is tried again after 1 s, doubling up to 30 s, at most ``max_retries`` times
(:class:`EngineRequestSettings`, the knob every requesting step inherits); "writer behind" does
not use one up.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, Field

from eagleflow.engine.context import context_length_of_model_list
from sglang_patch.request_ids import row_request_id


class ServerGone(Exception):
    """The engine is no longer there; no point sending more rows."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class RowFailed(Exception):
    """One row could not be extracted; ``reason`` says why, ``retryable`` whether to try again.

    ``counts`` is False for a retry that is not the row's fault (the engine's writer was
    behind): it does not use up one of the row's ``--max-retries``.
    """

    def __init__(self, reason: str, retryable: bool = False, counts: bool = True) -> None:
        super().__init__(reason)
        self.reason, self.retryable, self.counts = reason, retryable, counts


class AnswerLost(Exception):
    """The answer never arrived whole, but the engine still answers: the request may have run."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


HUNG_PROBE_SECONDS = 10.0  # an engine that does not answer /health within this is hung
RETRY_FIRST_DELAY_S = 1.0
RETRY_DELAY_MAX_S = 30.0
T = TypeVar("T")


class EngineRequestSettings(BaseModel):
    """The flags of every step that sends requests to an engine (extract, verify-capture, regenerate), declared once."""

    request_timeout: float = Field(600.0, gt=0, description="seconds to wait for one engine answer")
    max_retries: int = Field(
        3, ge=0,
        description=f"retries of a request after a 5xx answer or a timeout, {RETRY_FIRST_DELAY_S:g}s apart, doubling up to "
        f"{RETRY_DELAY_MAX_S:g}s ('writer behind' does not use one up)",
    )


def with_retries(
    attempt: Callable[[], T],
    max_retries: int,
    *,
    before_retry: Callable[[RowFailed, float], None] = lambda exc, delay: None,
    sleep: Callable[[float], Any] = time.sleep,
) -> T:
    """``attempt()``'s result, trying it again after a retryable :class:`RowFailed`: the one retry policy.

    Back-off is exponential (1 s, doubling, at most 30 s). A failure with ``counts`` False (the engine's
    writer was behind) is retried without using up one of the ``max_retries``. Any other exception
    (:class:`ServerGone`, a final :class:`RowFailed`) ends it at once.

    :param before_retry: told the failure and the delay before each retry (abort the request, log it).
    :param sleep: waits out the delay (a stop event's ``wait`` cuts it short; the attempt then raises).
    :raises RowFailed: the last failure, "(after N attempts)" appended when retries ran out.
    """
    from tenacity import RetryCallState, Retrying, retry_if_exception, wait_exponential

    counted = 0

    def out_of_retries(state: RetryCallState) -> bool:
        nonlocal counted
        counted += int(_failure(state).counts)
        return counted > max_retries

    def give_up(state: RetryCallState) -> T:
        failure = _failure(state)
        raise RowFailed(f"{failure.reason} (after {counted} attempts)") from failure

    retrying = Retrying(
        retry=retry_if_exception(lambda exc: isinstance(exc, RowFailed) and exc.retryable),
        wait=wait_exponential(multiplier=RETRY_FIRST_DELAY_S, max=RETRY_DELAY_MAX_S),
        stop=out_of_retries,
        before_sleep=lambda state: before_retry(_failure(state), state.upcoming_sleep),
        sleep=sleep,
        retry_error_callback=give_up,
    )
    return retrying(attempt)


def _failure(state: Any) -> RowFailed:
    exc = state.outcome.exception()
    assert isinstance(exc, RowFailed)
    return exc


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

    def reachable(self, timeout: float = 5.0) -> bool:
        """Whether the engine still answers HTTP at all (any status counts, 503 too)."""
        try:
            self._requests.get(f"{self.url}/health", timeout=timeout)
        except self._requests.RequestException:
            return False
        return True

    def abort(self, rid: str) -> None:
        """SGLang's ``POST /abort_request {"rid"}``: drop the request wherever it is (a no-op when done)."""
        post = self._post or self._session().post
        try:
            post(f"{self.url}/abort_request", json={"rid": rid}, timeout=HUNG_PROBE_SECONDS)
        except self._requests.RequestException:
            pass  # a gone or hung engine is found out by the next request

    def server_info(self) -> dict[str, Any]:
        """SGLang's ``/server_info`` (its launch settings: ``tp_size``, ``disable_radix_cache``, ``version``, …);
        empty when the engine does not answer it."""
        for path in ("/server_info", "/get_server_info"):  # the second: its deprecated name, in older releases
            try:
                response = self._requests.get(f"{self.url}{path}", timeout=30)
            except self._requests.RequestException:
                return {}
            if response.status_code == 200:
                info = response.json()
                return info if isinstance(info, dict) else {}
        return {}

    def context_length(self) -> int | None:
        """The engine's context length: ``max_model_len`` of SGLang's ``GET /v1/models`` (the length its
        request checks use, ``--context-length`` included); None when the engine does not say."""
        try:
            response = self._requests.get(f"{self.url}/v1/models", timeout=30)
            answer = response.json() if response.status_code == 200 else None
        except (self._requests.RequestException, ValueError):
            return None
        return context_length_of_model_list(answer)

    def generate(self, row: int, input_ids: list[int], rid: str | None = None) -> tuple[str, dict[str, Any]]:
        """Send one prefill-only request (rid: a new one for ``row`` by default); return ``(rid, meta_info)`` or raise."""
        rid = rid or row_request_id(row)
        answer = self.complete(rid, input_ids, max_new_tokens=0, temperature=0.0, row=row)
        return rid, answer.get("meta_info", {})

    def complete(
        self, rid: str, input_ids: list[int], max_new_tokens: int, temperature: float, row: int | None = None, **fields: Any
    ) -> dict[str, Any]:
        """One ``/generate`` request; SGLang's answer (``text``, ``output_ids``, ``meta_info``) or raise.

        :param row: the dataset row the request is for, named in a 4xx error.
        :param fields: more top-level fields of SGLang's body, e.g. ``return_logprob=True``.
        """
        body = {
            "rid": rid, "input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature},
            **fields,
        }
        post = self._post or self._session().post
        try:
            response = post(f"{self.url}/generate", json=body, timeout=self.request_timeout)
            if response.status_code < 400:
                answer = response.json()
        except self._requests.Timeout as exc:
            if not self.reachable(HUNG_PROBE_SECONDS):
                raise ServerGone(
                    f"engine at {self.url} hangs: it accepts connections but answered no /generate within "
                    f"{self.request_timeout:.0f}s and no /health within {HUNG_PROBE_SECONDS:.0f}s (see the server log)"
                ) from exc
            raise RowFailed(f"no answer within {self.request_timeout:.0f}s (--request-timeout)", retryable=True) from exc
        except (self._requests.RequestException, ValueError) as exc:  # refused, reset, cut-off or garbled answer
            if self.reachable():
                raise AnswerLost(f"answer lost ({type(exc).__name__}: {exc}); the engine still answers") from exc
            raise ServerGone(f"engine at {self.url} refuses connections (it was ready before): {exc}") from exc
        if response.status_code >= 500:
            raise RowFailed(f"engine answered {response.status_code}: {error_message(response)}", retryable=True)
        if response.status_code >= 400:
            raise RowFailed(
                f"engine rejected the request{'' if row is None else f' for row {row}'} with {response.status_code}: "
                f"{error_message(response)} (request fields sent: {', '.join(body)})"
            )
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
