"""The engine a run launches: its argv and environment, reference engine or SGLang.

The one place that turns a run's :class:`~eagleflow.pipeline.PipelineConfig` into an engine
command line; the SGLang flags themselves are :mod:`eagleflow.engine.sglang_command`'s, the
reference engine's flags :class:`~eagleflow.engine.reference.config.ReferenceEngineConfig`'s.
"""

from __future__ import annotations

import sys

from eagleflow.config import model_to_argv
from eagleflow.pipeline import PipelineConfig, model_dir


def engine_command(cfg: PipelineConfig, port: int) -> tuple[list[str], dict[str, str]]:
    """argv and environment of the engine this run launches (never a shell string)."""
    layout = cfg.layout
    aux_ids = cfg.resolved_aux_layer_ids()
    if cfg.engine == "reference":
        from eagleflow.engine.reference.config import ReferenceEngineConfig

        engine = ReferenceEngineConfig(
            model=model_dir(cfg), dump_dir=layout.dump_dir, aux_layers=aux_ids, host="127.0.0.1", port=port,
            hidden_states_dtype=cfg.hidden_states_dtype,
        )
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
        hidden_states_dtype=cfg.hidden_states_dtype,
        extra_args=list(cfg.server_extra_args),
    )
    return build_command(sglang)
