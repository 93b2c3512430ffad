"""SGLang's native ``/generate`` API as the reference engine speaks it.

Field names, defaults, status codes and error bodies are SGLang 0.5.9's (read from
``sglang/srt/entrypoints/http_server.py``, ``managers/io_struct.py`` and
``managers/tokenizer_manager.py``):

- ``POST /generate`` ``{"rid", "input_ids" | "text", "sampling_params": {"max_new_tokens", "temperature"}}``
  -> ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
  "cached_tokens", "e2e_latency", ...}}``. A request error is 400 ``{"error": {"message"}}`` (SGLang's
  ``_create_error_response``); a body without ``text``/``input_ids`` gets SGLang's own message.
- Log-probabilities (0.5.20's ``GenerateReqInput`` fields): ``return_logprob``, ``logprob_start_len``
  (-1: output tokens only), ``top_logprobs_num``, ``return_text_in_logprobs``; the answer's
  ``meta_info`` then carries them in SGLang's shapes (:mod:`~eagleflow.engine.reference.logprobs`).
- ``GET /health`` and ``/health_generate``: 503 until the warmup is done, then 200; answered
  between any request's decode steps (the forward lock is fair and handed over per step).
- Every malformed request is a 400 naming the field; inputs are bounded: a rid by what a dump
  file name can hold, the body by :func:`body_limit` (413), and what an error message quotes of
  any field by :func:`eagleflow.errors.excerpt_repr`.
- A prompt that does not leave room in the context length for the ``max_new_tokens`` it names is a
  400 with SGLang's messages (:mod:`eagleflow.engine.context` has the rule; the length is SGLang's
  derivation from the model's config, or ``--context-length``).
- ``GET /model_info`` (and its deprecated name ``/get_model_info``): answers at once.
- ``GET /v1/models``: SGLang's OpenAI model list, whose ``max_model_len`` is the context length.
- ``GET /server_info`` (and ``/get_server_info``): the launch settings under ``ServerArgs``' names;
  the reference engine reports those a capture client checks (``tp_size``, ``disable_radix_cache``).
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from eagleflow.engine.context import max_new_tokens_left
from eagleflow.errors import excerpt, excerpt_repr
from sglang_patch.request_ids import rid_problem

# SGLang's log line when its warmup request succeeded; the launcher/sensor side may grep for it.
READY_LINE = "The server is fired up and ready to roll!"
# SGLang's GenerateReqInput validation message (io_struct.py, _validate_inputs).
NO_INPUT_MESSAGE = "Either text, input_ids or input_embeds should be provided."
# SGLang's SamplingParams defaults (sampling_params.py) for fields a client leaves out.
DEFAULT_MAX_NEW_TOKENS = 128
DEFAULT_TEMPERATURE = 1.0
GREEDY_BELOW_TEMPERATURE = 1e-6  # SGLang treats temperatures under this as greedy (top_k = 1)


class RequestError(Exception):
    """A request the engine answers with an error status; ``body`` is SGLang's error JSON for it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    @property
    def body(self) -> dict[str, Any]:
        if self.status == HTTPStatus.BAD_REQUEST:
            # http_server._create_error_response: what a ValueError in the tokenizer manager becomes.
            return {"error": {"message": self.message}}
        # http_server's HTTPException handler (ErrorResponse), used for scheduler aborts (500/503).
        return {"object": "error", "message": self.message, "type": str(self.status), "param": None, "code": self.status}


def invalid_json_body(exc: ValueError) -> dict[str, Any]:
    """SGLang's RequestValidationError answer (400) to a body that is not JSON."""
    message = f"the request body is not valid JSON: {excerpt_repr(str(exc))}"
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


# Bytes a request body may hold: generous for any prompt that fits the context (a token id or
# its text takes a few bytes of JSON), small enough that one request cannot take the host's memory.
MIN_BODY_BYTES = 1 << 20
BODY_BYTES_PER_TOKEN = 64


def body_limit(limits: ModelLimits) -> int:
    """The largest ``/generate`` body the engine reads, from its context length."""
    return max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * (limits.context_length or 0))


def parse_json_body(raw: bytes) -> Any:
    """The request body as JSON; raises ``ValueError`` (then 400) for anything else, nesting too deep included."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("the JSON nests deeper than the engine parses") from None


@dataclass(frozen=True)
class GenerateRequest:
    """One parsed ``/generate`` body."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    ignore_eos: bool
    # SGLang's log-probability fields, as the scheduler resolves them: logprob_start_len is
    # len(input_ids) when only output tokens are wanted.
    return_logprob: bool = False
    logprob_start_len: int = 0
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against: the vocabulary, the context length, the tokenizer."""

    vocab_size: int
    context_length: int | None
    tokenize: Callable[[str], list[int]] | None  # None: the model folder has no tokenizer


def parse_generate(body: Any, limits: ModelLimits) -> GenerateRequest:
    """Parse and check a ``/generate`` body as SGLang does; raises :class:`RequestError` (400)."""
    if isinstance(body, list):
        raise RequestError(400, "a JSON list of requests is not supported by the reference engine; send one request per call")
    if not isinstance(body, dict):
        raise RequestError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    rid = body.get("rid")
    if rid is None:
        rid = uuid.uuid4().hex  # SGLang's default rid
    if not isinstance(rid, str):
        raise RequestError(400, f"rid must be a string, got {type(rid).__name__} (batch requests are not supported)")
    # The rid becomes file names in the dump folder: it must not leave it and must fit a file name.
    problem = rid_problem(rid)
    if problem:
        raise RequestError(400, f"rid {excerpt_repr(rid)} {problem}")
    if body.get("stream"):
        raise RequestError(400, f"rid {rid}: stream is not supported by the reference engine; send stream: false")
    if body.get("input_embeds") is not None:
        raise RequestError(400, f"rid {rid}: input_embeds is not supported by the reference engine; send input_ids")
    input_ids = body.get("input_ids")
    text = body.get("text")
    if input_ids is None and text is None:
        # Also what a vLLM-style body ({"prompt_token_ids": [...]}) gets: SGLang drops unknown keys.
        raise RequestError(400, NO_INPUT_MESSAGE)
    if input_ids is None:
        input_ids = _tokenize(rid, text, limits)
    input_ids = _check_input_ids(rid, input_ids, limits.vocab_size)

    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise RequestError(400, f"rid {rid}: sampling_params must be a JSON object, got {type(params).__name__}")
    max_new_tokens = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new_tokens is None:
        max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    if not _is_int(max_new_tokens) or max_new_tokens < 0:
        raise RequestError(
            400, f"rid {rid}: sampling_params.max_new_tokens must be at least 0, got {excerpt_repr(max_new_tokens)}."
        )
    for name, value in params.items():  # NaN or Infinity (JSON's 1e400) in any sampling knob
        if isinstance(value, float) and not math.isfinite(value):
            raise RequestError(400, f"rid {rid}: sampling_params.{excerpt(name, 60)} must be a finite number, got {value!r}.")
    temperature = params.get("temperature", DEFAULT_TEMPERATURE)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise RequestError(400, f"rid {rid}: sampling_params.temperature must be a number >= 0, got {excerpt_repr(temperature)}.")
    if limits.context_length:
        _check_context(rid, len(input_ids), params.get("max_new_tokens"), limits.context_length)
    return GenerateRequest(
        rid, input_ids, int(max_new_tokens), float(temperature), bool(params.get("ignore_eos", False)),
        **_logprob_fields(rid, body, len(input_ids)),
    )


def _check_context(rid: str, prompt_tokens: int, max_new_tokens: int | None, context_length: int) -> None:
    """SGLang's two context checks (:mod:`eagleflow.engine.context`), as its strictest supported release makes them."""
    if prompt_tokens >= context_length:
        raise RequestError(
            400, f"rid {rid}: The input ({prompt_tokens} tokens) is longer than the model's context length ({context_length} tokens)."
        )
    # Only a max_new_tokens the request names is checked, as in SGLang (its default is not).
    if max_new_tokens is not None and max_new_tokens > max_new_tokens_left(context_length, prompt_tokens):
        raise RequestError(
            400,
            f"rid {rid}: Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {prompt_tokens + max_new_tokens} tokens: {prompt_tokens} tokens from the input "
            f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit.",
        )


def _logprob_fields(rid: str, body: dict[str, Any], num_tokens: int) -> dict[str, Any]:
    """SGLang's logprob fields of one request, with its defaults and its scheduler's resolution."""
    return_logprob = body.get("return_logprob") or False
    if not isinstance(return_logprob, bool):
        raise RequestError(400, f"rid {rid}: return_logprob must be true or false, got {excerpt_repr(return_logprob)}")
    start = body.get("logprob_start_len")
    start = -1 if start is None else start
    top = body.get("top_logprobs_num")
    top = 0 if top is None else top
    if not _is_int(start) or start < -1:
        raise RequestError(400, f"rid {rid}: logprob_start_len must be an integer >= -1, got {excerpt_repr(start)}")
    if not _is_int(top) or top < 0:
        raise RequestError(400, f"rid {rid}: top_logprobs_num must be an integer >= 0, got {excerpt_repr(top)}")
    if body.get("token_ids_logprob"):
        raise RequestError(400, f"rid {rid}: token_ids_logprob is not supported by the reference engine; use top_logprobs_num")
    if not return_logprob:
        return {}
    if start == -1:  # scheduler.py: logprobs of the output tokens only
        start = num_tokens
    if start > num_tokens:
        # scheduler.py's abort message (a 400: the tokenizer manager raises it as a ValueError)
        raise RequestError(
            400,
            f"req.logprob_start_len={start} is higher than the number of input tokens "
            f"len(req.origin_input_ids)={num_tokens}. Please use a smaller logprob_start_len.",
        )
    return {
        "return_logprob": True,
        "logprob_start_len": start,
        "top_logprobs_num": top,
        "return_text_in_logprobs": bool(body.get("return_text_in_logprobs", False)),
    }


def _tokenize(rid: str, text: Any, limits: ModelLimits) -> list[int]:
    if not isinstance(text, str):
        raise RequestError(400, f"rid {rid}: text must be a string, got {type(text).__name__} (batch requests are not supported)")
    if limits.tokenize is None:
        raise RequestError(400, f"rid {rid}: text needs a tokenizer and the model folder has none; send input_ids")
    return list(limits.tokenize(text))


def _check_input_ids(rid: str, input_ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(input_ids, list):
        raise RequestError(400, f"rid {rid}: input_ids must be a list of token ids, got {type(input_ids).__name__}")
    if not input_ids:
        raise RequestError(400, f"rid {rid}: input_ids is empty")
    for position, token in enumerate(input_ids):
        if isinstance(token, list):
            raise RequestError(400, f"rid {rid}: input_ids is a list of lists; batch requests are not supported")
        if not _is_int(token):
            raise RequestError(400, f"rid {rid}: input_ids[{position}] = {excerpt_repr(token)} is not an integer token id")
        if not 0 <= token < vocab_size:
            raise RequestError(400, f"rid {rid}: input_ids[{position}] = {token} is outside the vocabulary [0, {vocab_size})")
    return input_ids


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
