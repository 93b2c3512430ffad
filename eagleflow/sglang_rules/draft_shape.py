"""SGLang's rules for the shape of what a speculative round drafts and verifies, per algorithm.

Read from SGLang 0.5.23 (``arg_groups/speculative_hook.py``; ``organize_draft_results``' top-k). The
reference engine's flags, the evaluation's configs and the export's serving flags all obey these,
so a config SGLang would refuse or silently change is refused here first, naming the flag.
"""

from __future__ import annotations


def check_tree_flags(num_steps: int, topk: int, num_draft_tokens: int | None) -> None:
    """SGLang's rule for the three draft-shape flags (``speculative_hook._handle_eagle_family``;
    ``eagle_utils.organize_draft_results``' top-k).

    - topk 1, a chain: SGLang sets ``--speculative-num-draft-tokens`` to steps + 1 whatever was given
      (with a warning), so any other value would be measured as something it is not;
    - topk K > 1, a tree: the tree's size has no default (0 is SGLang's "not set": ``--speculative-num-draft-tokens``
      left out stays None, and the draft's ``topk(scores, num_draft_tokens - 1)`` fails; the reference engine
      and the serving flags would fill in steps + 1 instead); it verifies the bonus token and at least one
      draft, and at most the ``K + (steps - 1) * K^2`` candidates the steps draft.
    """
    chain = num_steps + 1
    if topk == 1:
        if num_draft_tokens not in (None, chain):
            raise ValueError(
                f"--speculative-num-draft-tokens must be --speculative-num-steps + 1 = {chain} for a chain (topk 1): "
                f"SGLang would serve {chain} instead of {num_draft_tokens}"
            )
        return
    candidates = topk + (num_steps - 1) * topk * topk
    if not num_draft_tokens:  # None, or 0: SGLang's "not set"
        raise ValueError(
            f"--speculative-eagle-topk {topk} needs --speculative-num-draft-tokens, the tree's size (2..{candidates + 1}): "
            "SGLang has no default for a tree (0 is its 'not set'), and the tree's top-k draft selection cannot run without it"
        )
    if num_draft_tokens < 2:
        raise ValueError(
            f"--speculative-num-draft-tokens {num_draft_tokens}: a tree verifies the bonus token and at least one draft (>= 2)"
        )
    if num_draft_tokens - 1 > candidates:
        raise ValueError(
            f"--speculative-num-draft-tokens {num_draft_tokens} is more than 1 + the {candidates} candidates "
            f"{num_steps} steps of topk {topk} draft (K + (steps - 1) * K^2)"
        )


def check_block_flags(block_size: int, num_steps: int | None = None, topk: int | None = None) -> None:
    """SGLang's rule for a block drafter (DFLASH): ``--speculative-num-draft-tokens`` is the block size
    (the bonus token and ``block_size - 1`` drafts), at least 2; steps and topk are 1 (SGLang forces them,
    with a warning, so any other value would be measured as something it is not)."""
    if block_size < 2:
        raise ValueError(f"--speculative-num-draft-tokens {block_size}: a block drafter verifies the bonus token and at least one draft (>= 2)")
    for flag, value in (("--speculative-num-steps", num_steps), ("--speculative-eagle-topk", topk)):
        if value not in (None, 1):
            raise ValueError(f"{flag} {value}: SGLang runs a block drafter with one step of topk 1 (it would override {value})")
