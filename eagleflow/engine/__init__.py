"""The engine stage: the server the hidden states come from, and its life as a process.

- :mod:`~eagleflow.engine.process`: start, probe, and stop an engine process (shared by the
  Airflow operators and the extractor, so "ready", "dead" and "stopped" mean one thing);
- :mod:`~eagleflow.engine.server_log`: an engine's log read from outside (its tail, its newest start, its last error);
- :mod:`~eagleflow.engine.client`: SGLang's native API as every stage speaks it (extraction, the capture
  check, regeneration, evaluation, online training), with the one retry policy of engine requests;
- :mod:`~eagleflow.engine.pool`: a run's engines, and which one a shard uses;
- :mod:`~eagleflow.engine.serving_command`: the command line of an engine serving a drafter, and the extra
  arguments each engine takes (the engines a *run* launches are :mod:`eagleflow.run.launch`'s);
- :mod:`~eagleflow.engine.sglang_command`: SGLang's command line with the capture hook;
- :mod:`~eagleflow.engine.sample_store_service`: the run's own Mooncake Store, started and stopped beside its engines;
- :mod:`~eagleflow.engine.reference`: the ``transformers`` stand-in for SGLang (its decoding loop is shared;
  each drafter family's rounds are the family's, ``eagleflow/drafters/<family>/``);
- :mod:`~eagleflow.engine.capture`: hidden-state capture from a ``transformers`` model;
- :mod:`~eagleflow.engine.context`: the context length as SGLang derives, reports and enforces it.

What other stages use is exported here and loads lazily: the Airflow processes that only
start, probe and stop engines import no torch.
"""

from eagleflow import lazy_exports

__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "process": [
            "EngineGone", "Readiness", "ReadinessCheck", "ServerInfo", "check_ready", "die_with_parent",
            "engine_label", "free_port", "interrupted_by_signals", "launch_lock", "recorded_server", "running_server",
            "start_server", "stop_server", "wait_until_ready",
        ],
        "server_log": ["engine_error_line", "last_start_offset", "last_start_time", "log_tail", "read_log_from"],
        "client": [
            "HUNG_PROBE_SECONDS", "AnswerLost", "EngineClient", "EngineRequestSettings", "RowFailed", "ServerGone",
            "with_retries",
        ],
        "context": ["context_length_of_model_list", "derived_context_length", "max_new_tokens_left"],
        "sglang_command": ["SGLangServerConfig", "build_command", "flag_values"],
        "serving_command": ["check_server_extra_args", "serving_engine_command"],
        "extra_args": ["check_reference_extra_args"],
        "sample_store_service": ["ensure_store", "stop_store"],
        "reference_config": ["ReferenceEngineConfig"],
        "capture": ["AuxStateCapture", "capture_hidden_states", "decoder_layers_and_norm"],
        "pool": ["plan_engines"],
    },
)
