"""SGLang's log-probability answer fields, computed from the reference engine's logits.

Shapes as SGLang 0.5.20 answers them (``managers/scheduler_components/logprob_result_processor.py``
builds the values, ``tokenizer_manager.add_logprob_to_meta_info`` the JSON):

- ``input_token_logprobs``: one ``[logprob, token_id, text]`` per prompt position from
  ``logprob_start_len`` on; the logprob of token j is the model's at position j-1, so the first
  entry's is ``null``. Token ids ``>= vocab_size - 1`` read 0 (SGLang clips padded image-token
  hashes that way).
- ``input_top_logprobs`` (with ``top_logprobs_num > 0``): per prompt position, ``null`` for the
  first, else the ``top_logprobs_num`` best ``[logprob, token_id, text]`` of the position before.
- ``output_token_logprobs`` / ``output_top_logprobs``: the same for each generated token (greedy:
  the raw logits' log-softmax; sampled: of the temperature-scaled logits, SGLang's default);
  ``output_token_logprobs_length`` counts them.
- ``text`` is ``null`` unless ``return_text_in_logprobs``; then each token decoded on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from eagleflow.engine.reference.protocol import GenerateRequest

if TYPE_CHECKING:
    import torch

Entry = list[Any]  # [logprob | None, token_id, text | None]


def _texts(token_ids: Sequence[int], decode: Callable[[list[int]], str] | None) -> list[str | None]:
    if decode is None:
        return [None] * len(token_ids)
    return [decode([int(t)]) for t in token_ids]


def _entries(values: Sequence[float | None], token_ids: Sequence[int], decode: Callable[[list[int]], str] | None) -> list[Entry]:
    return [[v, int(t), text] for v, t, text in zip(values, token_ids, _texts(token_ids, decode))]


def _top(logprobs: torch.Tensor, k: int, decode: Callable[[list[int]], str] | None) -> list[Entry]:
    import torch

    values, ids = torch.topk(logprobs, min(k, logprobs.shape[-1]))
    return _entries(values.tolist(), ids.tolist(), decode)


def logprob_meta_info(
    request: GenerateRequest,
    prompt_logprobs: torch.Tensor | None,
    output_logprobs: Sequence[torch.Tensor],
    output_ids: Sequence[int],
    vocab_size: int,
    decode: Callable[[list[int]], str] | None,
) -> dict[str, Any]:
    """The ``meta_info`` logprob fields of one answer.

    :param request: the parsed request (its logprob fields resolved as SGLang's scheduler does).
    :param prompt_logprobs: ``[T, V]`` log-softmax at every prompt position (row j predicts token
        j+1); None when ``logprob_start_len`` is the prompt length.
    :param output_logprobs: ``[V]`` log-softmax behind each generated token, in order.
    :param output_ids: the generated tokens.
    :param vocab_size: the model's vocabulary (SGLang's token-id clipping).
    :param decode: the tokenizer's ``decode`` when ``return_text_in_logprobs``, else None.
    """
    if not request.return_logprob:
        return {}
    start, ids = request.logprob_start_len, request.input_ids
    positions = range(start, len(ids))
    values: list[float | None] = []
    tops: list[list[Entry] | None] = []
    for j in positions:
        if j == start or prompt_logprobs is None:
            values.append(None)
            tops.append(None)
            continue
        row = prompt_logprobs[j - 1]
        values.append(float(row[ids[j]]))
        tops.append(_top(row, request.top_logprobs_num, decode) if request.top_logprobs_num > 0 else None)
    shown_ids = [t if t < vocab_size - 1 else 0 for t in ids[start:]]
    out_values = [float(row[t]) for row, t in zip(output_logprobs, output_ids)]
    meta: dict[str, Any] = {
        "input_token_logprobs": _entries(values, shown_ids, decode),
        "output_token_logprobs": _entries(out_values, list(output_ids), decode),
        "output_token_logprobs_length": len(out_values),
    }
    if request.top_logprobs_num > 0:
        meta["input_top_logprobs"] = tops
        meta["output_top_logprobs"] = [_top(row, request.top_logprobs_num, decode) for row in output_logprobs]
    return meta
