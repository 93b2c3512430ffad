"""The engines a run launches: their argv and environment, reference engine or SGLang, and their life.

The one place that turns a run's settings into an engine command line: the capture engine
extraction reads from (:func:`engine_command`; the serving engine evaluation measures is
:func:`eagleflow.engine.serving_engine_command`'s). :func:`launch_engine` and :func:`stop_engine` start (or reuse)
and stop one engine of a run, as the DAG's ``launch_server`` and ``stop_server`` tasks do and as
``python -m eagleflow launch|stop --params run.json --engine engine-0`` does by hand. The SGLang flags themselves are
:mod:`eagleflow.engine.sglang_command`'s (capture) and :mod:`eagleflow.engine.sglang_serving`'s
(serving), the reference engine's :class:`~eagleflow.engine.reference_config.ReferenceEngineConfig`'s.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagleflow.config import model_to_argv
from eagleflow.engine import (
    ServerInfo, check_reference_extra_args, ensure_store, free_port, launch_lock, recorded_server, running_server,
    start_server, stop_server, stop_store,
)
from eagleflow.errors import UserError
from eagleflow.results import emit_result
from eagleflow.run.pipeline import PipelineConfig, model_dir
from sglang_patch.mooncake_store import SAMPLE_STORE_ENV, StoreAddress

STOP_GRACE_SECONDS = 30.0


class EngineElsewhere(Exception):
    """The engine to stop runs on another machine (``host``): only a worker there can stop it."""

    def __init__(self, info: ServerInfo) -> None:
        self.host = info.host
        super().__init__(f"{info.describe()} (pid {info.pid}) runs on {info.host}, not here; cannot stop it from this worker")


def planned_engine(plan: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Engine ``name`` of the run's ``plan`` (``PipelineConfig.engine_plan``), ``{name, index, url, port}``."""
    for engine in plan:
        if engine["name"] == name:
            return engine
    raise UserError(f"the run has no engine {name!r}; its engines: {', '.join(e['name'] for e in plan)}")


def launch_engine(cfg: PipelineConfig, name: str, say: Callable[[str], None] = print, sample_store: StoreAddress | None = None) -> ServerInfo:
    """Start engine ``name`` of the run in its own session, or reuse it when it is already up; its address.

    The engine outlives the caller, its output appended to ``<run>/server/<name>.log`` and its process
    recorded in ``<run>/server/<name>.json``. One launch at a time per run folder (a lock): an SGLang
    engine that shares its machine with engines of the same run already running takes the GPUs after
    theirs (``--base-gpu-id``). In remote mode (``server_urls``) nothing starts: the remote engine's
    address comes back. With ``sample_transport`` mooncake the engine hands its samples to ``sample_store``
    (what the Param ``sample_store_conn_id`` names), else to the run's own store, started here with the first
    engine (:mod:`eagleflow.engine.sample_store_service`).
    """
    plan = cfg.engine_plan()
    engine = planned_engine(plan, name)
    layout = cfg.layout
    if cfg.remote:
        say(f"Remote mode: not launching anything; {name} is at {engine['url']}")
        return ServerInfo(
            url=str(engine["url"]), pid=None, host="", log_path="", dump_dir=str(cfg.server_dump_dir), name=name,
            sample_store=sample_store.as_dict() if sample_store else None,
        )
    with launch_lock(layout.server):
        existing = running_server(layout.engine_state(name))
        if existing is not None:
            say(f"Reusing {existing.describe()}: pid {existing.pid} (log {existing.log_path})")
            return existing
        # Engines of this run already running on this machine hold the first GPUs.
        neighbours = [e for e in plan if e["name"] != name and running_server(layout.engine_state(e["name"]))]
        port = int(engine["port"]) or free_port()
        store = run_sample_store(cfg, sample_store, say)
        argv, env = engine_command(cfg, port, gpu_offset=len(neighbours) * cfg.tp_size, sample_store=store)
        say(f"Starting {cfg.engine} engine {name}: {' '.join(argv)}")
        info = start_server(
            argv, env, layout.engine_log(name), layout.engine_state(name), f"http://127.0.0.1:{port}", layout.dump_dir, name,
            sample_store=store.as_dict() if store else None,
        )
    say(f"{info.describe()}: pid {info.pid}, log {info.log_path}")
    return info


def stop_engine(cfg: PipelineConfig, name: str, grace: float = STOP_GRACE_SECONDS) -> str:
    """Stop engine ``name`` of the run and its whole process group (SIGTERM, SIGKILL after ``grace`` seconds).

    Finds it in ``<run>/server/<name>.json`` (what :func:`launch_engine` recorded), so it works whatever the
    launch returned or whether it failed; a remote engine is left running. Returns what was done.

    :raises EngineElsewhere: the engine runs on another machine.
    """
    if cfg.remote:
        return "remote engine left running"
    state = cfg.layout.engine_state(name)
    info = recorded_server(state)
    if info is None or info.pid is None:
        return "nothing to stop"
    if not info.is_local:
        raise EngineElsewhere(info)
    message = stop_server(info.pid, grace)
    state.unlink(missing_ok=True)
    if not any(running_server(cfg.layout.engine_state(e["name"])) for e in cfg.engine_plan()):
        message += f"; {stop_store(cfg.layout.server)}"  # the run's own store goes with its last engine
    return message


def run_sample_store(cfg: PipelineConfig, given: StoreAddress | None, say: Callable[[str], None] = print) -> StoreAddress | None:
    """Where the run's engines hand samples over: None (the dump folder), ``given``, or the run's own store."""
    if cfg.sample_transport != "mooncake":
        return None
    return given or ensure_store(cfg.layout.server, store_namespace(cfg), say)


def revive_sample_store(cfg: PipelineConfig, say: Callable[[str], None] = print) -> None:
    """Before online training (a retry): bring the run's own store back on its ports if it died (its master was
    killed); the engines' store clients reconnect to it. A store a connection names is its owner's to keep up."""
    if cfg.sample_transport == "mooncake" and not cfg.sample_store_conn_id and not cfg.remote:
        ensure_store(cfg.layout.server, store_namespace(cfg), say, start_new=False)


def store_namespace(cfg: PipelineConfig) -> str:
    """The run's keys in a store: ``eagleflow/<run name>``."""
    return f"eagleflow/{cfg.run_name}"


def engine_command(
    cfg: PipelineConfig, port: int, gpu_offset: int = 0, sample_store: StoreAddress | None = None
) -> tuple[list[str], dict[str, str]]:
    """argv and environment of one engine this run launches (never a shell string).

    :param port: the port it binds on 127.0.0.1.
    :param gpu_offset: first GPU of an SGLang engine (``--base-gpu-id``): the GPUs before it are
        taken by this run's other engines on the same machine.
    :param sample_store: the store the capture hands samples to instead of the dump folder.
    """
    layout = cfg.layout
    aux_ids = cfg.captured_aux_layer_ids()
    if cfg.engine == "reference":
        from eagleflow.engine import ReferenceEngineConfig

        engine = ReferenceEngineConfig(
            model=model_dir(cfg), dump_dir=layout.dump_dir, aux_layers=aux_ids, host="127.0.0.1", port=port,
            dump_queue_bytes=cfg.dump_queue_bytes,
            hidden_states_dtype=cfg.hidden_states_dtype, sample_store=sample_store.to_json() if sample_store else None,
        )
        check_reference_extra_args(cfg.server_extra_args)
        argv = [sys.executable, "-u", "-m", "eagleflow", "serve-reference", *model_to_argv(engine)]
        return argv + list(cfg.server_extra_args), {"PYTHONUNBUFFERED": "1"}
    from eagleflow.engine import SGLangServerConfig, build_command

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
    argv, env = build_command(sglang)
    return argv, env | ({SAMPLE_STORE_ENV: sample_store.to_json()} if sample_store else {})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``python -m eagleflow launch`` and ``stop``."""
    parser.add_argument("--params", type=Path, required=True, help="the run's Params (JSON or YAML), as the trigger form takes them")
    parser.add_argument("--run-id", default="", help="names the run folder when the Params give no run_name")
    parser.add_argument("--engine", default="engine-0", help="which of the run's engines (engine-0, engine-1, …)")
    parser.add_argument(
        "--grace-seconds", type=float, default=STOP_GRACE_SECONDS, help="stop: seconds SIGTERM gets before SIGKILL"
    )


def main(args: argparse.Namespace) -> int:
    """``launch``: start (or reuse) the engine, print its address as the result line. ``stop``: stop it."""
    import yaml

    try:
        params = yaml.safe_load(args.params.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"--params {args.params}: cannot read the run's Params: {exc}") from exc
    if not isinstance(params, dict):
        raise UserError(f"--params {args.params}: expected a mapping of Param names to values")
    cfg = PipelineConfig.from_params(params, args.run_id)
    if args.step == "launch":
        emit_result(launch_engine(cfg.check_model(), args.engine).as_dict())
        return 0
    try:
        message = stop_engine(cfg, args.engine, args.grace_seconds)
    except EngineElsewhere as exc:
        raise UserError(str(exc)) from exc
    print(message, flush=True)
    emit_result({"engine": args.engine, "stopped": message})
    return 0
