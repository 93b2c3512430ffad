"""The engines a run launches: their argv and environment, reference engine or SGLang.

The one place that turns a run's settings into an engine command line: the capture engine
extraction reads from (:func:`engine_command`) and the serving engine evaluation measures
(:func:`serving_engine_command`). The SGLang flags themselves are
:mod:`eagleflow.engine.sglang_command`'s (capture) and :mod:`eagleflow.engine.sglang_serving`'s
(serving), the reference engine's :class:`~eagleflow.engine.reference.config.ReferenceEngineConfig`'s.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from eagleflow.config import model_to_argv
from eagleflow.engine.extra_args import check_reference_extra_args
from eagleflow.export.step import ServedDrafter
from eagleflow.pipeline import PipelineConfig, model_dir


def engine_command(cfg: PipelineConfig, port: int, gpu_offset: int = 0) -> tuple[list[str], dict[str, str]]:
    """argv and environment of one engine this run launches (never a shell string).

    :param port: the port it binds on 127.0.0.1.
    :param gpu_offset: first GPU of an SGLang engine (``--base-gpu-id``): the GPUs before it are
        taken by this run's other engines on the same machine.
    """
    layout = cfg.layout
    aux_ids = cfg.resolved_aux_layer_ids()
    if cfg.engine == "reference":
        from eagleflow.engine.reference.config import ReferenceEngineConfig

        engine = ReferenceEngineConfig(
            model=model_dir(cfg), dump_dir=layout.dump_dir, aux_layers=aux_ids, host="127.0.0.1", port=port,
            dump_queue_bytes=cfg.dump_queue_bytes,
            hidden_states_dtype=cfg.hidden_states_dtype,
        )
        check_reference_extra_args(cfg.server_extra_args)
        argv = [sys.executable, "-u", "-m", "eagleflow", "serve-reference", *model_to_argv(engine)]
        return argv + list(cfg.server_extra_args), {"PYTHONUNBUFFERED": "1"}
    from eagleflow.engine.sglang_command import SGLangServerConfig, build_command

    sglang = SGLangServerConfig(
        model_path=str(model_dir(cfg)),
        tp_size=cfg.tp_size,
        host="127.0.0.1",
        port=port,
        aux_layer_ids=aux_ids,
        dump_dir=str(layout.dump_dir),
        dump_queue_bytes=cfg.dump_queue_bytes,
        base_gpu_id=gpu_offset,
        hidden_states_dtype=cfg.hidden_states_dtype,
        extra_args=list(cfg.server_extra_args),
    )
    return build_command(sglang)


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
    """argv and environment of an engine that serves ``model`` (with ``drafter``'s EAGLE-3 decoding if given:
    a chain, or a tree of ``num_draft_tokens`` with ``topk`` > 1).

    The reference engine takes SGLang's speculative flags under the same names, so both
    engines measure the same thing.
    """
    if engine == "reference":
        from eagleflow.engine.reference.config import ReferenceEngineConfig

        served = ReferenceEngineConfig(model=model.absolute(), host="127.0.0.1", port=port)
        if drafter is not None:
            served = served.model_copy(
                update={
                    "speculative_algorithm": "EAGLE3",
                    "speculative_draft_model_path": drafter.path,
                    "speculative_num_steps": drafter.num_steps,
                    "speculative_eagle_topk": topk,
                    "speculative_num_draft_tokens": num_draft_tokens or drafter.num_steps + 1,
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
