"""The engine stage: the server the hidden states come from, and its life as a process.

- :mod:`~eagleflow.engine.process`: start, probe, and stop an engine process (shared by the
  Airflow operators and the extractor, so "ready", "dead" and "stopped" mean one thing);
- :mod:`~eagleflow.engine.pool`: a run's engines, and which one a shard uses;
- :mod:`~eagleflow.engine.launch`: the command line a run launches;
- :mod:`~eagleflow.engine.sglang_command`: SGLang's command line with the capture hook;
- :mod:`~eagleflow.engine.reference`: the ``transformers`` stand-in for SGLang;
- :mod:`~eagleflow.engine.capture`: hidden-state capture from a ``transformers`` model;
- :mod:`~eagleflow.engine.context`: the context length as SGLang derives, reports and enforces it.

The process helpers are exported here; they import no torch, so the Airflow processes that
only start, probe and stop engines stay light.
"""

from eagleflow.engine.process import (
    Readiness,
    ReadinessCheck,
    ServerInfo,
    check_ready,
    free_port,
    last_start_offset,
    log_tail,
    pid_alive,
    read_log_from,
    running_server,
    start_server,
    stop_server,
)

__all__ = [
    "Readiness",
    "ReadinessCheck",
    "ServerInfo",
    "check_ready",
    "free_port",
    "last_start_offset",
    "log_tail",
    "pid_alive",
    "read_log_from",
    "running_server",
    "start_server",
    "stop_server",
]
