"""The mask token a block drafter's block is filled with after the bonus token, as SGLang resolves it.

Read from SGLang 0.5.23 (``srt/speculative/dflash_worker_v2.py`` ``_resolve_mask_token_id``, which the
block drafters' workers share): ``mask_token_id`` if the draft's config gives it (it must be below the
target's vocab size and agree with the tokenizer's id of ``mask_token``, default ``<|MASK|>``); else the
tokenizer's mask token when it is ``<|MASK|>``, else ``<|MASK|>``'s id in its vocabulary, else the id
adding it gives (``len(tokenizer)``), which must be below the vocab size. Training passes the same id
explicitly, so training and serving embed the same row.
"""

from __future__ import annotations

from typing import Any

DEFAULT_MASK_TOKEN = "<|MASK|>"


class BlockRuleError(ValueError):
    """A block drafter's setting SGLang would serve differently from how it was trained, or not at all."""


def resolve_mask_token_id(tokenizer: Any, vocab_size: int, given: int | None = None, mask_token: str = DEFAULT_MASK_TOKEN) -> int:
    """The mask token id SGLang's DFLASH and DSPARK workers resolve for ``tokenizer`` (``_resolve_mask_token_id``).

    :param tokenizer: the verifier's tokenizer (transformers), or None when ``given`` is set.
    :param vocab_size: the target's vocabulary size (its config's ``vocab_size``).
    :param given: an explicit ``mask_token_id`` (checked as SGLang checks it).
    :raises BlockRuleError: an id SGLang would refuse, naming it and the vocabulary size.
    """
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    if given is not None:
        resolved = int(given)
        if mask_token in vocab and int(vocab[mask_token]) != resolved:
            raise BlockRuleError(
                f"mask token id {resolved} conflicts with the tokenizer, whose {mask_token} is id {vocab[mask_token]} "
                "(SGLang refuses the drafter)"
            )
    elif getattr(tokenizer, "mask_token", None) == mask_token and getattr(tokenizer, "mask_token_id", None) is not None:
        resolved = int(tokenizer.mask_token_id)
    elif mask_token in vocab:
        resolved = int(vocab[mask_token])
    else:
        resolved = len(tokenizer)  # SGLang adds the token: it gets the next id
    if not 0 <= resolved < vocab_size:
        raise BlockRuleError(
            f"mask token id {resolved} is not below the target's vocab size {vocab_size}: SGLang cannot embed it "
            f"(it does not resize the target's embedding); give a mask token id below {vocab_size}, e.g. an unused token's"
        )
    return resolved


def choose_mask_token_id(tokenizer: Any, vocab_size: int, given: int | None = None) -> tuple[int, str]:
    """The mask token id a block drafter is trained and exported with, and how it was chosen: ``given`` (checked as
    SGLang checks it), else the id SGLang's own resolution gives (:func:`resolve_mask_token_id`); where SGLang could
    not embed that one (no mask token in the tokenizer and no room to add one: a full vocabulary, as small models
    have), the tokenizer's pad token, which no training target holds. The export writes the id into the drafter's
    config, so SGLang serves with the same one whichever way it was chosen.

    :raises BlockRuleError: nothing SGLang can embed (no pad token either), naming the vocabulary size.
    """
    if given is not None:
        return resolve_mask_token_id(tokenizer, vocab_size, given), "as given"
    try:
        return resolve_mask_token_id(tokenizer, vocab_size), "as SGLang resolves it"
    except BlockRuleError as exc:
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is None:
            raise
        why = f"the pad token: {str(exc).split(':')[0]}"  # "mask token id N is not below the target's vocab size V"
        return resolve_mask_token_id(tokenizer, vocab_size, int(pad)), why
