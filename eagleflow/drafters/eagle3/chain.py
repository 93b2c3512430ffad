"""Greedy EAGLE-3 speculative decoding in the reference engine, as SGLang runs a chain of drafts.

SGLang's flags mean here what they mean there: ``--speculative-num-steps N`` drafts N tokens
per round, ``--speculative-eagle-topk 1`` keeps one candidate per step (a chain, no tree) and
``--speculative-num-draft-tokens N+1`` verifies them together with the last accepted token.
With ``--speculative-eagle-topk K > 1`` the round drafts and verifies a tree instead
(:mod:`eagleflow.drafters.eagle3.tree`); the rest of this loop is the same.

One request, greedy (temperature 0):

1. the target prefills the prompt (its aux states captured) and picks the first token ``c``;
2. the drafter extends over every position i with ``(token i+1, target aux state i)`` — the
   same alignment speculators trains (``shift_batch``) — and drafts ``d1`` after ``c``, then
   ``d2 … dN`` from its own hidden states;
3. the target verifies ``[c, d1 … dN]`` in one forward: ``d_j`` is accepted while it equals the
   target's own greedy choice, and the target's choice after the last accepted one is the bonus
   token; rejected positions leave both caches;
4. the drafter extends over the accepted positions (with the verify pass's aux states) and the
   next round starts from the bonus token.

The tokens are therefore exactly greedy decoding's (up to the target's own numerics), and the
answer carries SGLang's ``spec_verify_ct``, ``spec_accept_length`` (completion tokens / verify
count, the bonus token included), ``spec_accept_rate`` (accepted / proposed drafts),
``spec_num_correct_drafts`` and ``spec_num_proposed_drafts``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from eagleflow.drafters.eagle3.draft_model import Eagle3Drafter
from eagleflow.engine.reference import SpecStats, SpeculativeDecoder, crop_cache


class ChainDecoder(SpeculativeDecoder):
    """Greedy chain drafting and verification for one target model and one drafter.

    :param target: the ``transformers`` causal LM.
    :param drafter: the exported drafter, computed as SGLang does.
    :param capture: returns a context manager recording the target's aux states, whose
        ``aux()`` gives ``[T, n_aux * hidden]`` for the last pass.
    :param num_steps: drafts per round (``--speculative-num-steps``).
    """

    def __init__(self, target: Any, drafter: Eagle3Drafter, capture: Callable[[], Any], num_steps: int) -> None:
        super().__init__(target, drafter, capture, num_steps)
        self.drafter: Eagle3Drafter = drafter

    def _draft(self, tokens: Sequence[int], hidden: torch.Tensor, start: int, cache: Any) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(start, start + len(tokens), device=self.device)
        ids = torch.tensor(list(tokens), device=self.device)
        return self.drafter.forward(ids, hidden, positions, cache)

    def generate(
        self,
        input_ids: Sequence[int],
        max_new_tokens: int,
        stop_ids: set[int],
        ignore_eos: bool,
        between_rounds: Callable[[], None] = lambda: None,
    ) -> tuple[list[int], dict[str, Any], SpecStats]:
        """Greedy tokens after ``input_ids`` (up to ``max_new_tokens``), the finish reason, the stats.

        ``between_rounds`` runs before each draft-and-verify round (the engine hands its forward lock
        to waiting requests there).
        """
        stats = SpecStats(draft_tokens_per_round=self.draft_tokens_per_round)
        logits, aux, target_cache = self._target(input_ids, None)
        current = int(torch.argmax(logits[-1]))
        output = [current]
        committed = len(input_ids)  # positions whose target KV is cached (the prompt, then accepted tokens)
        if self._finished(output, max_new_tokens, stop_ids, ignore_eos):
            return self._result(output, max_new_tokens, stop_ids, ignore_eos, stats)
        draft_cache = self.drafter.new_cache()
        # Draft extend over the prompt: position i sees token i+1 (the last one: the first output token).
        draft_logits, draft_hidden = self._draft([*input_ids[1:], current], aux, 0, draft_cache)
        while True:
            between_rounds()
            drafts, choice, path_aux, target_cache = self._round(
                current, draft_logits[-1], draft_hidden[-1:], committed, target_cache, draft_cache
            )
            stats.verify_ct += 1
            stats.correct_drafts += len(drafts)
            output += [*drafts, choice]
            if self._finished(output, max_new_tokens, stop_ids, ignore_eos):
                return self._result(output, max_new_tokens, stop_ids, ignore_eos, stats)
            # The drafter forgets this round's drafts and extends over what was accepted instead.
            draft_cache.crop(committed)
            draft_logits, draft_hidden = self._draft([*drafts, choice], path_aux, committed, draft_cache)
            committed += len(drafts) + 1
            current = choice

    def _round(
        self, current: int, logit: torch.Tensor, hidden: torch.Tensor, committed: int, target_cache: Any, draft_cache: Any
    ) -> tuple[list[int], int, torch.Tensor, Any]:
        """Draft a chain after ``current``, verify it: (accepted drafts, the target's choice after them,
        the aux states of ``current`` and the accepted drafts, the target cache holding exactly those)."""
        drafts: list[int] = []
        for step in range(self.num_steps):
            drafts.append(self.drafter.target_token(int(torch.argmax(logit))))
            if step + 1 < self.num_steps:
                step_logits, hidden = self._draft([drafts[-1]], hidden, committed + step, draft_cache)
                logit = step_logits[-1]
        verify_logits, verify_aux, target_cache = self._target([current, *drafts], target_cache)
        choices = [int(t) for t in torch.argmax(verify_logits, dim=-1)]
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == choices[accepted]:
            accepted += 1
        # Keep what was accepted: the verified block up to the last accepted draft.
        crop_cache(target_cache, committed + accepted + 1)
        return drafts[:accepted], choices[accepted], verify_aux[: accepted + 1], target_cache
