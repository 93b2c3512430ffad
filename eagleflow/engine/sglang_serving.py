"""The SGLang server that *serves* a trained drafter: the one place that owns its command line.

Unlike the capture server (:mod:`eagleflow.engine.sglang_command`) it runs as SGLang is meant
to run — prefix cache, chunked prefill and CUDA graphs on, no hook — with SGLang's EAGLE-3
flags (``server_args``; the source test checks each name in the wheels), as the drafter's family gives
them (:mod:`eagleflow.drafters`): ``--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR
--speculative-num-steps N --speculative-eagle-topk 1 --speculative-num-draft-tokens N+1`` (and, for a
drafter trained with sliding-window attention, ``--speculative-draft-window-size W``), or
``--speculative-algorithm DFLASH --speculative-draft-model-path DIR --speculative-num-draft-tokens B``. The seed's tuning stays
(triton attention, NCCL ring/LL); flashinfer is refused on SM120 as for capture.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from eagleflow.deploy import SGLANG_PYTHON_ENV
from eagleflow.engine.sglang_command import (
    ATTENTION_BACKEND_FLAGS,
    NCCL_ENV,
    check_attention_backend,
    detect_sglang_version,
    flag_values,
)
from eagleflow.engine.extra_args import LISTEN, check_extra_args
from eagleflow.errors import UserError
from eagleflow.export import ServedDrafter
from sglang_patch.hook_spec import parse_version


def speculative_flags(drafter: ServedDrafter, topk: int = 1, num_draft_tokens: int | None = None) -> list[str]:
    """SGLang's flags serving ``drafter``, as its family says (:mod:`eagleflow.drafters`): an EAGLE-3 chain of
    ``drafter.num_steps`` (topk 1, steps + 1 verified tokens) unless ``topk`` and ``num_draft_tokens`` ask for a
    tree; a block drafter's block of ``num_draft_tokens`` verified (default: the trained one, the manifest's block_size)."""
    from eagleflow.drafters import family_of_algorithm

    serving = family_of_algorithm(drafter.algorithm).owner("serving")
    if family_of_algorithm(drafter.algorithm).block:
        return serving(str(drafter.path), 1, 1, num_draft_tokens or drafter.block_size)
    return serving(str(drafter.path), drafter.num_steps, topk, num_draft_tokens, drafter.window)


# Flags build_serving_command sets itself (an extra argument repeating one would silently win, as
# argparse keeps the last value), and where their values come from.
SERVING_OWNED: dict[str, str] = {
    "--model-path": "the run's model_path",
    "--model": "the run's model_path",
    "--tp-size": "the run's tp_size",
    "--tensor-parallel-size": "the run's tp_size",
    "--host": LISTEN,
    "--port": "a free port of its own",
    **{flag: "the exported drafter (export.json); the baseline runs without one" for flag in (
        "--speculative-algorithm", "--speculative-draft-model-path", "--speculative-num-steps",
        "--speculative-eagle-topk", "--speculative-num-draft-tokens", "--speculative-draft-window-size",
        "--speculative-dflash-block-size",
    )},
}


def build_serving_command(
    model_path: str,
    port: int,
    drafter: ServedDrafter | None,
    *,
    tp_size: int = 1,
    host: str = "127.0.0.1",
    attention_backend: str = "triton",
    extra_args: Sequence[str] = (),
    python: str | None = None,
    sglang_version: str | None = None,
    compute_caps: Callable[[], list[str] | None] | None = None,
    topk: int = 1,
    num_draft_tokens: int | None = None,
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` of ``python -m sglang.launch_server`` serving ``model_path``, with ``drafter`` if given.

    A drafter whose export needs a newer SGLang than the server's interpreter has (a setting the
    older release would silently ignore) is refused, naming both versions.
    """
    python = python or os.environ.get(SGLANG_PYTHON_ENV) or sys.executable
    if drafter is not None:
        version = sglang_version or detect_sglang_version(python)
        if parse_version(version) < parse_version(drafter.minimum_sglang):
            raise UserError(
                f"the drafter in {drafter.path} needs sglang >= {drafter.minimum_sglang} (older releases ignore settings "
                f"it was trained with; see its export.json), found sglang {version} for {python}"
            )
    extra = [str(arg) for arg in extra_args]
    check_extra_args(extra, SERVING_OWNED, who="the evaluation")
    check_attention_backend([attention_backend, *flag_values(extra, ATTENTION_BACKEND_FLAGS)], compute_caps)
    argv = [
        python, "-m", "sglang.launch_server",
        "--model-path", model_path,
        "--tp-size", str(tp_size),
        "--host", host,
        "--port", str(port),
        "--attention-backend", attention_backend,
        *(speculative_flags(drafter, topk, num_draft_tokens) if drafter is not None else []),
        *extra,
    ]
    return argv, {**NCCL_ENV, "PYTHONUNBUFFERED": "1"}
