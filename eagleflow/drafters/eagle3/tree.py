"""Tree drafts (``--speculative-eagle-topk K > 1``) in the reference engine, as SGLang builds and verifies them.

Read from SGLang 0.5.23 (``speculative/eagle_worker_v2.py`` ``draft_forward``,
``spec_utils.select_top_k_tokens``, ``eagle_utils.organize_draft_results`` and
``build_tree_kernel_efficient``, ``kernels/ops/speculative/spec_tree.py``'s tree and greedy-verify
kernels, ``cache_locs.generate_draft_decode_kv_indices``). One round after the last accepted token
``c`` (the tree's root):

1. **expand**: the drafter's distribution after ``c`` (softmax) gives K first-level candidates,
   scored by their probability; each of the ``--speculative-num-steps`` - 1 further steps runs the
   drafter on the K *rows* of the frontier at once and scores each row's K best children by the
   cumulative product ``score(parent) * p(child)``; the K best of those K² become the next frontier
   (taking their parent row's hidden state). A row attends to the prefix and to the tokens earlier
   steps put in the *same row*, as SGLang's draft KV layout gives it (a re-chosen branch sees its
   row's history, not necessarily its own ancestors; this affects the drafts, never the output).
   Every candidate is kept: K + (steps - 1) * K² in all.
2. **select**: the best ``--speculative-num-draft-tokens`` - 1 candidates by score, in candidate
   order (so a parent precedes its children); a candidate whose parent was not selected is left
   unreachable, as SGLang's kernel leaves it.
3. **verify**: the target runs ``[c, selected…]`` in one pass, each token at position
   ``prefix + depth`` and attending to the prefix, its ancestors and itself (the tree mask).
4. **accept**: from the root, the child whose token equals the target's greedy choice at the
   current node is accepted, depth after depth; the target's choice after the last accepted node is
   the bonus token. The target cache keeps exactly the accepted path.

Output tokens are those of greedy decoding (the accepted path is the target's own choices); the
stats count ``num_draft_tokens - 1`` proposed drafts per round, SGLang's accept-rate denominator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from eagleflow.drafters.eagle3.chain import ChainDecoder
from eagleflow.drafters.eagle3.draft_model import Eagle3Drafter
from eagleflow.errors import UserError


@dataclass(frozen=True)
class DraftTree:
    """The verified block of one round: node 0 is the root (the last accepted token), then the drafts.

    :param tokens: target-vocabulary token of each draft node (``tokens[0]`` unused: the root's is the caller's).
    :param parents: each node's parent node (-1 for the root; None for a node whose parent was not selected).
    """

    tokens: list[int]
    parents: list[int | None]

    def depths(self) -> list[int]:
        """Depth of each node (root 0); an unreachable node counts as depth 1."""
        depths = [0] * len(self.parents)
        for node, parent in enumerate(self.parents[1:], start=1):
            depths[node] = depths[parent] + 1 if parent is not None else 1
        return depths

    def ancestors_mask(self) -> torch.Tensor:
        """``[M, M]`` bool: node i may attend to node j (j is i, or an ancestor of i)."""
        size = len(self.parents)
        allowed = torch.zeros(size, size, dtype=torch.bool)
        for node in range(size):
            allowed[node, 0] = True
            walk: int | None = node
            while walk is not None and walk > 0:
                allowed[node, walk] = True
                walk = self.parents[walk]
        return allowed

    def accept(self, choices: list[int]) -> list[int]:
        """The accepted path, root first: each step takes the child whose token is the target's choice
        at the current node (SGLang's ``verify_tree_greedy``)."""
        path = [0]
        while True:
            target = choices[path[-1]]
            child = next(
                (n for n in range(1, len(self.parents)) if self.parents[n] == path[-1] and self.tokens[n] == target), None
            )
            if child is None:
                return path
            path.append(child)


def select_tree(scores: torch.Tensor, tokens: list[int], parents: list[int], num_draft_tokens: int) -> DraftTree:
    """SGLang's ``organize_draft_results`` + tree build: the best ``num_draft_tokens - 1`` candidates.

    :param scores: ``[C]`` cumulative score of every candidate, in drafting order.
    :param tokens: ``[C]`` their target-vocabulary tokens.
    :param parents: ``[C]`` each candidate's parent candidate, -1 for a child of the root.
    """
    chosen = sorted(int(i) for i in torch.topk(scores, num_draft_tokens - 1).indices)
    node_of = {candidate: node for node, candidate in enumerate(chosen, start=1)}
    tree_parents: list[int | None] = [-1]
    for candidate in chosen:
        parent = parents[candidate]
        tree_parents.append(0 if parent == -1 else node_of.get(parent))
    return DraftTree([0] + [tokens[c] for c in chosen], tree_parents)


def keep_cache_positions(cache: Any, committed: int, path: list[int]) -> None:
    """Keep the first ``committed`` positions of a transformers cache and the verified block's ``path`` nodes."""
    keep = torch.tensor(list(range(committed)) + [committed + node for node in path])
    for layer in cache.layers:
        if type(layer).__name__ != "DynamicLayer":
            raise UserError(
                f"--speculative-eagle-topk > 1: the target's cache layer {type(layer).__name__} cannot keep a verified "
                "tree's path (plain attention caches only); serve this model with --speculative-eagle-topk 1"
            )
        layer.keys = layer.keys.index_select(-2, keep.to(layer.keys.device))
        layer.values = layer.values.index_select(-2, keep.to(layer.values.device))


class TreeDecoder(ChainDecoder):
    """Greedy EAGLE-3 decoding with tree drafts of ``topk`` branches and ``num_draft_tokens`` verified tokens."""

    def __init__(
        self, target: Any, drafter: Eagle3Drafter, capture: Callable[[], Any], num_steps: int, topk: int, num_draft_tokens: int
    ) -> None:
        super().__init__(target, drafter, capture, num_steps)
        self.topk = topk
        self.num_draft_tokens = num_draft_tokens

    @property
    def draft_tokens_per_round(self) -> int:
        return self.num_draft_tokens - 1

    def _round(
        self, current: int, logit: torch.Tensor, hidden: torch.Tensor, committed: int, target_cache: Any, draft_cache: Any
    ) -> tuple[list[int], int, torch.Tensor, Any]:
        tree = self._draft_tree(logit, hidden, committed, draft_cache)
        verify_logits, verify_aux, target_cache = self._verify(current, tree, committed, target_cache)
        choices = [int(t) for t in torch.argmax(verify_logits, dim=-1)]
        path = tree.accept(choices)
        keep_cache_positions(target_cache, committed, path)
        return [tree.tokens[n] for n in path[1:]], choices[path[-1]], verify_aux[path], target_cache

    def _draft_tree(self, logit: torch.Tensor, hidden: torch.Tensor, committed: int, cache: Any) -> DraftTree:
        """Expand ``num_steps`` levels of ``topk`` rows after the root; select the verified block."""
        k = self.topk
        top_p, top_ids = torch.softmax(logit.float(), dim=-1).topk(k)
        scores = [top_p]
        tokens = [self.drafter.target_token(int(i)) for i in top_ids]
        parents = [-1] * k
        frontier, frontier_scores, row_hidden = list(range(k)), top_p, hidden.expand(k, -1)
        for step in range(1, self.num_steps):
            row_tokens = torch.tensor([tokens[c] for c in frontier], device=self.device)
            positions = torch.full((k,), committed + step - 1, device=self.device)
            step_logits, step_hidden = self.drafter.forward(
                row_tokens, row_hidden, positions, cache, self._row_mask(committed, step, positions[0].item())
            )
            child_p, child_ids = torch.softmax(step_logits.float(), dim=-1).topk(k, dim=-1)  # [k rows, k children]
            expanded = (frontier_scores[:, None] * child_p).flatten()
            base = len(tokens)
            scores.append(expanded)
            tokens += [self.drafter.target_token(int(i)) for i in child_ids.flatten()]
            parents += [frontier[row] for row in range(k) for _ in range(k)]
            frontier_scores, best = expanded.topk(k)
            frontier = [base + int(b) for b in best]
            row_hidden = step_hidden[best // k]
        return select_tree(torch.cat(scores), tokens, parents, self.num_draft_tokens)

    def _row_mask(self, committed: int, step: int, position: int) -> torch.Tensor:
        """``[K, committed + step*K]``: row r sees the prefix (within the draft's window) and its own row's entries."""
        k = self.topk
        mask = torch.zeros(k, committed + step * k, dtype=torch.bool, device=self.device)
        prefix = torch.arange(committed, device=self.device)
        mask[:, :committed] = True if self.drafter.window is None else (prefix > position - self.drafter.window)[None, :]
        for row in range(k):
            mask[row, committed + row :: k] = True
        return mask

    def _verify(self, current: int, tree: DraftTree, committed: int, cache: Any) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """One target pass over ``[current, drafts…]`` with the tree mask and each node's depth as its position."""
        size = len(tree.tokens)
        allowed = torch.ones(size, committed + size, dtype=torch.bool)
        allowed[:, committed:] = tree.ancestors_mask()
        dtype = self.target.dtype
        mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        positions = torch.tensor([[committed + d for d in tree.depths()]], device=self.device)
        ids = torch.tensor([[current, *tree.tokens[1:]]], device=self.device)
        with self.capture() as hooks:
            out = self.target(
                input_ids=ids, attention_mask=mask[None, None].to(self.device), position_ids=positions,
                past_key_values=cache, use_cache=True,
            )
        return out.logits[0], hooks.aux(), out.past_key_values
