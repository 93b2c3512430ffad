"""The command line of an engine that serves a drafter (evaluation's), and the extra arguments each engine takes.

The reference engine takes SGLang's speculative flags under the same names, so both engines measure the same
thing; SGLang's serving flags are :mod:`eagleflow.engine.sglang_serving`'s, the capture engines a run launches
:mod:`eagleflow.run.launch`'s.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from eagleflow.config import model_to_argv
from eagleflow.drafters import family_of_algorithm
from eagleflow.engine.extra_args import check_reference_extra_args
from eagleflow.export import ServedDrafter


def serving_engine_command(
    engine: str,
    model: Path,
    port: int,
    drafter: ServedDrafter | None,
    *,
    tp_size: int = 1,
    extra_args: Sequence[str] = (),
    topk: int = 1,
    num_draft_tokens: int | None = None,
) -> tuple[list[str], dict[str, str]]:
    """argv and environment of an engine that serves ``model`` (with ``drafter``'s decoding if given: an EAGLE-3
    chain, or a tree of ``num_draft_tokens`` with ``topk`` > 1; a block drafter's block of ``num_draft_tokens``,
    default the trained block size).

    The reference engine takes SGLang's speculative flags under the same names, so both
    engines measure the same thing.
    """
    if engine == "reference":
        from eagleflow.engine.reference_config import ReferenceEngineConfig

        served = ReferenceEngineConfig(model=model.absolute(), host="127.0.0.1", port=port)
        if drafter is not None:
            block = family_of_algorithm(drafter.algorithm).block
            served = served.model_copy(
                update={
                    "speculative_algorithm": drafter.algorithm,
                    "speculative_draft_model_path": drafter.path,
                    "speculative_num_steps": 1 if block else drafter.num_steps,
                    "speculative_eagle_topk": 1 if block else topk,
                    "speculative_num_draft_tokens": num_draft_tokens or (drafter.block_size if block else drafter.num_steps + 1),
                    "speculative_draft_window_size": drafter.window,
                }
            )
        check_reference_extra_args(extra_args)
        argv = [sys.executable, "-u", "-m", "eagleflow", "serve-reference", *model_to_argv(served)]
        return argv + list(extra_args), {"PYTHONUNBUFFERED": "1"}
    from eagleflow.engine.sglang_serving import build_serving_command

    return build_serving_command(
        str(model.absolute()), port, drafter, tp_size=tp_size, extra_args=extra_args, topk=topk, num_draft_tokens=num_draft_tokens
    )


def check_server_extra_args(engine: str, extra: Sequence[str], *, serving: bool = False) -> None:
    """Refuse extra arguments that set what the run sets: the capture engines' (``server_extra_args``) or,
    with ``serving``, the evaluation engines' (``eval_server_extra_args``). The policy is in
    :mod:`eagleflow.engine.extra_args`."""
    if engine == "reference":
        check_reference_extra_args(extra)
        return
    from eagleflow.engine.extra_args import check_extra_args
    from eagleflow.engine.sglang_command import check_extra_args as check_capture_args
    from eagleflow.engine.sglang_serving import SERVING_OWNED

    if serving:
        check_extra_args(extra, SERVING_OWNED, who="the evaluation")
    else:
        check_capture_args(list(extra))
