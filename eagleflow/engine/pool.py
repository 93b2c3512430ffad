"""Several engines per run: the run's engines, and which one a shard uses.

A run takes its hidden states from one or more engines: launched by the run (``num_engines``,
one ``launch_server`` instance each) or already running elsewhere (``server_urls``, remote
mode), named ``engine-0``, ``engine-1``, … (:func:`eagleflow.layout.engine_name`).

A shard uses its own engine (shard index modulo the number of engines) while that one is ready;
the shards of engines that are not are dealt out over the ready ones in turn. So the shards of
an engine that died, and their retries, go to the engines that are up, and no shard waits for a
dead one.

The engine list travels between tasks as one XCom shape, read only by :func:`engines_from_xcom`:
the mapped ``launch_server`` (and ``wait_server_ready``) tasks' return values, a list in engine
order of :meth:`ServerInfo.as_dict` dicts, ``{url, pid, host, log_path, dump_dir, name}``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

from eagleflow.engine.process import Readiness, ReadinessCheck, ServerInfo, check_ready
from eagleflow.layout import engine_name

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}


class NoEngineReady(Exception):
    """None of the run's engines can take a shard now; ``reasons`` says why for each."""

    def __init__(self, reasons: list[str]) -> None:
        self.reasons = reasons
        super().__init__("no engine of this run is ready: " + "; ".join(reasons))


def plan_engines(num_engines: int, server_urls: Sequence[str], server_port: int) -> list[dict[str, Any]]:
    """The run's engines as ``[{name, index, url, port}]``: the remote ``server_urls``, else ``num_engines`` to launch.

    A launched engine has ``url`` None and port ``server_port + index`` (0: a free port when it starts).
    """
    if server_urls:
        return [{"name": engine_name(i), "index": i, "url": url, "port": None} for i, url in enumerate(server_urls)]
    return [
        {"name": engine_name(i), "index": i, "url": None, "port": server_port + i if server_port else 0}
        for i in range(num_engines)
    ]


def engines_from_xcom(value: Any) -> list[ServerInfo]:
    """The run's engines, in engine order, from the engine-list XCom (see the module docstring).

    A single dict (one engine's ``ServerInfo``) is taken as a list of one; ``None`` as no engine.
    """
    if value is None:
        return []
    if isinstance(value, dict):
        return [ServerInfo.from_dict(value)]
    return [ServerInfo.from_dict(dict(engine)) for engine in value]


def unreachable_reason(engine: ServerInfo) -> str | None:
    """Why this machine cannot use ``engine`` at all: launched on another host and bound to its loopback."""
    if engine.pid is not None and not engine.is_local and urlsplit(engine.url).hostname in LOOPBACK_HOSTS:
        return f"{engine.describe()} runs on {engine.host}, reachable only there"
    return None


def first_reachable(engines: Sequence[ServerInfo]) -> ServerInfo:
    """The first engine this machine can send requests to (regeneration uses that one alone).

    Not probed for readiness: the caller waits out its warmup.
    :raises NoEngineReady: when the run has none this machine reaches.
    """
    reasons = []
    for engine in engines:
        reason = unreachable_reason(engine)
        if reason is None:
            return engine
        reasons.append(reason)
    raise NoEngineReady(reasons or ["the run has no engine (did launch_server run?)"])


def choose_engine(
    engines: Sequence[ServerInfo], shard_index: int, probe: Callable[[ServerInfo], ReadinessCheck] = check_ready
) -> tuple[ServerInfo, list[str]]:
    """The engine shard number ``shard_index`` uses now, and one line for each engine passed over.

    :param engines: the run's engines, in engine order.
    :param shard_index: the shard's position in the run (its map index).
    :param probe: readiness check of one engine (default: the process and ``/health_generate``).
    :raises NoEngineReady: when none is ready.
    """
    if not engines:
        raise NoEngineReady(["the run has no engine (did launch_server run?)"])
    preferred = engines[shard_index % len(engines)]
    ready: list[ServerInfo] = []
    passed_over: list[str] = []
    for engine in engines:
        reason = unreachable_reason(engine)
        if reason is None:
            check = probe(engine)
            if check.state is Readiness.READY:
                ready.append(engine)
                continue
            reason = f"{engine.describe()} is {check.state.value}: {check.message}"
        passed_over.append(reason)
    if not ready:
        raise NoEngineReady(passed_over)
    if preferred in ready:
        return preferred, passed_over
    # Number the shards of the engines that are down, round by round, and deal them out.
    down = [e for e in engines if e not in ready]
    rank = (shard_index // len(engines)) * len(down) + down.index(preferred)
    return ready[rank % len(ready)], passed_over
