"""Greedy speculative decoding in the reference engine: what every drafter family's loop shares.

One request, greedy (temperature 0): the target prefills the prompt (its aux states captured) and
picks the first token; each round the family's drafter proposes, the target verifies the proposal in
one forward, a draft is accepted while it equals the target's own greedy choice, and the target's choice
after the last accepted one is the bonus token; rejected positions leave both caches. The tokens are
therefore exactly greedy decoding's (up to the target's own numerics), and the answer carries SGLang's
``spec_verify_ct``, ``spec_accept_length`` (completion tokens / verify count, the bonus token included),
``spec_accept_rate`` (accepted / proposed drafts), ``spec_num_correct_drafts`` and
``spec_num_proposed_drafts``.

Each family's rounds are its own (``eagleflow/drafters/<family>/``: EAGLE-3's chain and tree, DFlash's
block), chosen by the drafter registry (:mod:`eagleflow.drafters`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SpecStats:
    """What SGLang's answer reports about one request's speculative decoding."""

    verify_ct: int = 0
    correct_drafts: int = 0
    draft_tokens_per_round: int = 0

    def meta_info(self, completion_tokens: int) -> dict[str, Any]:
        """SGLang's ``meta_info`` spec fields (tokenizer_manager); none when nothing was verified."""
        if self.verify_ct == 0:
            return {}
        proposed = self.verify_ct * self.draft_tokens_per_round
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_accept_length": completion_tokens / self.verify_ct,
            "spec_accept_rate": self.correct_drafts / proposed if proposed else 0.0,
            "spec_num_correct_drafts": self.correct_drafts,
            "spec_num_proposed_drafts": proposed,
        }


def crop_cache(cache: Any, length: int) -> None:
    """Cut a transformers cache back to ``length`` positions."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class SpeculativeDecoder:
    """What every family's greedy draft-and-verify loop shares: the target's pass with its aux states captured,
    the end of decoding, and SGLang's stats. A family's decoder (``eagleflow/drafters/<family>/``) drafts and
    verifies its own rounds in :meth:`generate`.

    :param target: the ``transformers`` causal LM.
    :param drafter: the exported drafter, computed as SGLang does.
    :param capture: returns a context manager recording the target's aux states, whose
        ``aux()`` gives ``[T, n_aux * hidden]`` for the last pass.
    :param num_steps: drafts per round.
    """

    def __init__(self, target: Any, drafter: Any, capture: Callable[[], Any], num_steps: int) -> None:
        self.target = target
        self.drafter = drafter
        self.capture = capture
        self.num_steps = num_steps
        self.device = next(target.parameters()).device

    @property
    def draft_tokens_per_round(self) -> int:
        """Drafts verified per round (``--speculative-num-draft-tokens`` - 1): SGLang's accept-rate denominator."""
        return self.num_steps

    def _target(self, ids: Sequence[int], cache: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """One target pass over ``ids`` after ``cache``: (logits [T, V], aux [T, n_aux*H], cache)."""
        with self.capture() as hooks:
            out = self.target(
                input_ids=torch.tensor([list(ids)], device=self.device), past_key_values=cache, use_cache=True
            )
        return out.logits[0], hooks.aux(), out.past_key_values

    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        stop_ids: set[int],
        ignore_eos: bool,
        between_rounds: Callable[[], None] = lambda: None,
    ) -> tuple[list[int], dict[str, Any], SpecStats]:
        """Greedy tokens after ``input_ids`` (up to ``max_new_tokens``), the finish reason, the stats."""
        raise NotImplementedError

    @staticmethod
    def _finished(output: list[int], max_new_tokens: int, stop_ids: set[int], ignore_eos: bool) -> bool:
        return len(output) >= max_new_tokens or (not ignore_eos and any(t in stop_ids for t in output))

    @staticmethod
    def _result(
        output: list[int], max_new_tokens: int, stop_ids: set[int], ignore_eos: bool, stats: SpecStats
    ) -> tuple[list[int], dict[str, Any], SpecStats]:
        """Cut at the first stop token or at ``max_new_tokens``, as decoding one token at a time would."""
        if not ignore_eos:
            for i, token in enumerate(output):
                if token in stop_ids:
                    return output[: i + 1], {"type": "stop", "matched": token}, stats
        return output[:max_new_tokens], {"type": "length", "length": max_new_tokens}, stats
