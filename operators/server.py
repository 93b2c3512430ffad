"""Engine lifecycle in the DAG: launch (setup), readiness sensor + trigger (setup), stop (teardown)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator, BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSensorTimeout
from airflow.triggers.base import BaseTrigger, TriggerEvent

from operators.step import pipeline_config

if TYPE_CHECKING:
    from airflow.sdk import Context

    from eagleflow.run.pipeline import PipelineConfig
    from sglang_patch.mooncake_store import StoreAddress

# How often the trigger hands the new server log lines back to the task log while waiting.
LOG_REPORT_SECONDS = 60.0
# One retry of the readiness wait: Airflow 3.3 can fail a deferred task whose trigger fired before the
# scheduler took in its worker's exit (apache/airflow#72716, "finished with state success, but the task
# instance's state attribute is running"). The retry finds a ready engine ready and a dead one dead at once,
# and waits only what is left of warmup_timeout, counted from the engine's start.
WAIT_RETRIES, WAIT_RETRY_DELAY = 1, timedelta(seconds=5)
# How long past the deadline Airflow waits for the trigger's own timeout event.
DEFERRAL_GRACE_SECONDS = 300.0


# In launch_server's XCom: the engine was not launched, and why (every shard complete); the
# readiness wait and the capture check pass such an engine on at once.
NOT_LAUNCHED_KEY = "not_launched"

# Names each mapped engine task after its engine in the UI (engine-0, …); give it to .partial().
ENGINE_MAP_INDEX_TEMPLATE = "{{ task.engine['name'] }}"
SERVER_MAP_INDEX_TEMPLATE = "{{ task.server['name'] }}"


class PlanEnginesOperator(BaseOperator):
    """The run's engines, ``[{name, index, url, port}]``: ``num_engines`` to launch, or the ``server_urls``.

    The engine tasks (launch, readiness, stop) are mapped over this list, one instance per engine.
    """

    def execute(self, context: Context) -> list[dict[str, Any]]:
        # The first task: a wrong path fails here, in plain words, before any engine starts.
        cfg = pipeline_config(context, check_model=False, check_paths=True)
        plan = cfg.engine_plan()
        if cfg.remote:
            self.log.info("Remote engines: %s", ", ".join(f"{e['name']} at {e['url']}" for e in plan))
        else:
            ports = ", ".join(f"{e['name']} on port {e['port'] or 'any free'}" for e in plan)
            self.log.info("Launching %d %s engine(s): %s", len(plan), cfg.engine, ports)
        return plan


class SGLangServerOperator(BaseOperator):
    """Start one engine of this run (SGLang with the capture hook, or the reference engine):
    :func:`eagleflow.run.launch.launch_engine`, which ``python -m eagleflow launch`` runs too.

    The server runs in its own session and outlives this task; its output goes to
    ``<run>/server/<engine>.log``. If that engine is already up (a retry, or a cleared shard
    re-running its setups while the old one still runs) it is reused. An SGLang engine that
    shares its machine with engines of the same run already running there takes the GPUs after
    theirs (``--base-gpu-id``).

    With the ``server_urls`` Param set (remote mode) nothing is launched: the task
    short-circuits and returns that engine's address. It succeeds rather than skips because
    Airflow requires the tasks after a setup to run on ``all_success``: a skipped launch
    would skip the readiness wait and every shard. Likewise when every shard of the run is
    complete (a finished shard cleared: :func:`operators.extract.nothing_to_extract`) no engine
    is started: the XCom carries :data:`NOT_LAUNCHED_KEY` with the reason.

    :param engine: one entry of plan_engines' list, ``{name, index, url, port}`` (templated; mapped over).

    Returns ``{url, pid, host, log_path, dump_dir, name}``.
    """

    template_fields: Sequence[str] = ("engine",)

    def __init__(self, *, engine: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine = engine

    def execute(self, context: Context) -> dict[str, Any]:
        from eagleflow.engine import ServerInfo
        from eagleflow.run import launch_engine
        from operators.extract import nothing_to_extract

        cfg = pipeline_config(context)
        name = str(self.engine["name"])
        idle = None if cfg.remote else nothing_to_extract(cfg, context)
        if idle:
            self.log.info("Not launching %s: %s", name, idle)
            unstarted = ServerInfo(
                url=str(self.engine.get("url") or ""), pid=None, host="", log_path="", dump_dir=str(cfg.layout.dump_dir), name=name
            )
            return {**unstarted.as_dict(), NOT_LAUNCHED_KEY: idle}
        return launch_engine(cfg, name, say=self.log.info, sample_store=connection_store(cfg)).as_dict()


def connection_store(cfg: PipelineConfig) -> StoreAddress | None:
    """The Mooncake Store the Param ``sample_store_conn_id`` names (None: no connection given)."""
    if cfg.sample_transport != "mooncake" or not cfg.sample_store_conn_id:
        return None
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    from eagleflow.run.launch import store_namespace
    from eagleflow.engine.sample_store_service import address_from_connection
    from eagleflow.errors import UserError

    try:
        conn = BaseHook.get_connection(cfg.sample_store_conn_id)
    except AirflowNotFoundException as exc:
        raise AirflowFailException(f"Param sample_store_conn_id: no Airflow connection {cfg.sample_store_conn_id!r}") from exc
    try:
        return address_from_connection(cfg.sample_store_conn_id, conn.host or "", conn.port, conn.extra, store_namespace(cfg))
    except UserError as exc:
        raise AirflowFailException(str(exc)) from None  # the message is the report; the same connection fails alike


class StopServerOperator(BaseOperator):
    """Teardown: stop one engine of the run and its whole process group (TERM, then KILL), with
    :func:`eagleflow.run.launch.stop_engine` (``python -m eagleflow stop``).

    Finds the engine's process in ``<run>/server/<engine>.json``, which launch wrote, so it works
    whatever launch pushed or whether it failed.

    Online (``hidden_states_source`` engine) the engines serve training too: the teardown after
    extraction leaves them running, and the instance with ``after_training`` (after
    train_drafter, whatever its outcome) stops them.

    :param engine: one entry of plan_engines' list (templated; mapped over).
    :param grace_seconds: how long SIGTERM gets before SIGKILL.
    :param after_training: this instance follows training (it stops only online runs' engines).
    """

    template_fields: Sequence[str] = ("engine",)

    def __init__(self, *, engine: Any = None, grace_seconds: float = 30.0, after_training: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine = engine
        self.grace_seconds = grace_seconds
        self.after_training = after_training

    def execute(self, context: Context) -> str:
        from eagleflow.run import EngineElsewhere, stop_engine

        cfg = pipeline_config(context, check_model=False)  # the teardown must work whatever the Params say
        name = str(self.engine["name"])
        if not cfg.remote and cfg.online != self.after_training:
            when = "after training" if cfg.online else "after extraction"
            self.log.info("hidden_states_source %s: %s is stopped %s, not here", "engine" if cfg.online else "disk", name, when)
            return f"left for the stop {when}"
        try:
            message = stop_engine(cfg, name, self.grace_seconds)
        except EngineElsewhere as exc:
            raise AirflowException(str(exc)) from exc
        self.log.info("%s: %s", name, message)
        return message


class ServerReadyTrigger(BaseTrigger):
    """Polls the engine's readiness without holding a worker slot.

    Fires ``{"status": "ready"}`` when ``/health_generate`` answers 200, ``{"status": "dead"}``
    as soon as the engine process is gone, ``{"status": "timeout"}`` at the deadline, and
    ``{"status": "running", "log_offset": n}`` every so often so the task can show the
    warmup's log lines and defer again. A refused connection is "not ready yet" (the stock
    HttpSensorTrigger fails on it).

    :param server: the engine's ``ServerInfo`` dict.
    :param deadline: absolute epoch seconds after which the wait fails.
    :param poll_interval: seconds between probes.
    :param log_offset: byte offset of the server log already shown.
    :param report_every: seconds between ``running`` events.
    """

    def __init__(
        self,
        server: dict[str, Any],
        deadline: float,
        poll_interval: float = 5.0,
        log_offset: int = 0,
        report_every: float = LOG_REPORT_SECONDS,
    ) -> None:
        super().__init__()
        self.server = server
        self.deadline = deadline
        self.poll_interval = poll_interval
        self.log_offset = log_offset
        self.report_every = report_every

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            "operators.server.ServerReadyTrigger",
            {
                "server": self.server,
                "deadline": self.deadline,
                "poll_interval": self.poll_interval,
                "log_offset": self.log_offset,
                "report_every": self.report_every,
            },
        )

    def _event(self, status: str, message: str) -> dict[str, Any]:
        return {"status": status, "message": message, "log_offset": self.log_offset, "deadline": self.deadline}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from eagleflow.engine.process import Readiness, ServerInfo, check_ready

        info = ServerInfo.from_dict(self.server)
        report_at = time.time() + self.report_every
        while True:
            check = await asyncio.to_thread(check_ready, info)
            if check.state is Readiness.READY:
                yield TriggerEvent(self._event("ready", check.message))
                return
            if check.state is Readiness.DEAD:
                yield TriggerEvent(self._event("dead", check.message))
                return
            now = time.time()
            if now >= self.deadline:
                yield TriggerEvent(self._event("timeout", check.message))
                return
            if now >= report_at:
                yield TriggerEvent(self._event("running", check.message))
                return
            await asyncio.sleep(min(self.poll_interval, max(self.deadline - now, 0.0)))


class ServerReadySensor(BaseSensorOperator):
    """Waits out the engine's warmup (about 9 minutes for Kimi-K2.5 on 8 GPUs).

    Keeps :class:`BaseSensorOperator`'s contract, as the http provider's ``HttpSensor`` does:
    with ``deferrable`` (the default) it pokes once and, if the engine is not ready, defers to
    :class:`ServerReadyTrigger` (no worker slot held) with the remaining time as the deferral's
    timeout; with ``deferrable=False`` it is a plain sensor whose ``mode`` (``poke`` or
    ``reschedule``), ``poke_interval`` and ``exponential_backoff`` apply. ``timeout`` bounds
    the wait: given to the operator, it is used as given; left out, the run's
    ``warmup_timeout`` Param (seconds) sets it. A timeout raises ``AirflowSensorTimeout``, and
    ``soft_fail`` turns it (and a dead engine) into a skip, as for any sensor.

    Fails at once when the engine process dies: the engine's own last error line first, then the
    last 50 lines of the server log.
    Returns (as XCom) the engine's ``{url, pid, host, log_path, dump_dir, name}``.

    :param server: one launch_server instance's XCom (templated; mapped over, one sensor per engine).
    :param poll_interval: seconds between probes (the sensor's ``poke_interval``).
    :param deferrable: wait in the triggerer instead of a worker.
    """

    template_fields: Sequence[str] = ("server",)

    def __init__(
        self, *, server: Any = None, poll_interval: float = 5.0, deferrable: bool = True, timeout: float | None = None, **kwargs: Any
    ) -> None:
        super().__init__(poke_interval=poll_interval, timeout=timeout, **kwargs)
        self.server = server
        self.poll_interval = poll_interval
        self.deferrable = deferrable
        self.timeout_from_params = timeout is None

    def _server_info(self) -> dict[str, Any]:
        if not isinstance(self.server, dict):
            raise AirflowException("no engine info from launch_server; did it run?")
        return dict(self.server)

    def poke(self, context: Context) -> PokeReturnValue:
        from eagleflow.engine.process import Readiness, ServerInfo, check_ready

        server = self._server_info()
        check = check_ready(ServerInfo.from_dict(server))
        if check.state is Readiness.DEAD:
            self._fail("dead", check.message, server)
        if check.state is Readiness.READY:
            self.log.info("%s is ready (%s)", ServerInfo.from_dict(server).describe(), check.message)
        return PokeReturnValue(is_done=check.state is Readiness.READY, xcom_value=server)

    def execute(self, context: Context) -> Any:
        if isinstance(self.server, dict) and self.server.get(NOT_LAUNCHED_KEY):
            self.log.info("%s was not launched (%s): nothing to wait for", self.server.get("name"), self.server[NOT_LAUNCHED_KEY])
            return dict(self.server)
        if self.timeout_from_params:
            self.timeout = pipeline_config(context, check_model=False).warmup_timeout
        if not self.deferrable:
            return super().execute(context)
        ready = self.poke(context)
        if ready:
            return ready.xcom_value
        from eagleflow.engine.server_log import last_start_offset, last_start_time

        server = self._server_info()
        offset = last_start_offset(server["log_path"]) if server.get("log_path") else 0
        # The warmup counts from the engine's start (its log says when), so a retry of this wait waits only what is left.
        started = (last_start_time(server["log_path"]) if server.get("log_path") else None) or time.time()
        self._defer(server, min(started, time.time()) + self.timeout, offset)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        """Resume point: show the new server log lines, then finish, fail, or wait again.

        Needs nothing from ``context``: the deadline travels in the event.
        """
        server = self._server_info()
        offset = self._show_new_log(server, int(event.get("log_offset", 0)))
        status = event.get("status")
        if status == "ready":
            self.log.info("Engine %s at %s is ready (%s)", server.get("name"), server["url"], event.get("message"))
            return server
        if status == "running":
            self.log.info("Engine still warming up: %s", event.get("message"))
            self._defer(server, float(event["deadline"]), offset)
        self._fail(str(status), str(event.get("message")), server)

    def _defer(self, server: dict[str, Any], deadline: float, log_offset: int) -> None:
        trigger = ServerReadyTrigger(server=server, deadline=deadline, poll_interval=self.poll_interval, log_offset=log_offset)
        # The trigger itself reports the deadline (with the log tail); Airflow's own deferral
        # timeout, a little later, covers a triggerer that went away.
        self.defer(
            trigger=trigger,
            method_name="execute_complete",
            timeout=timedelta(seconds=max(deadline - time.time(), 0) + DEFERRAL_GRACE_SECONDS),
        )

    def _show_new_log(self, server: dict[str, Any], offset: int) -> int:
        from eagleflow.engine.server_log import read_log_from

        if not server.get("log_path"):
            return offset
        text, offset = read_log_from(server["log_path"], offset)
        for line in text.splitlines():
            self.log.info("[server] %s", line)
        return offset

    def _fail(self, status: str, message: str, server: dict[str, Any]) -> None:
        from eagleflow.engine.server_log import engine_error_line, log_tail

        log_path = server.get("log_path")
        tail = log_tail(log_path) if log_path else "(remote server: no local log)"
        error = engine_error_line(log_path) if log_path else None
        reason = {"dead": "the engine process died", "timeout": "the engine was not ready in time"}.get(status, status)
        # The engine's own last error line first (the file it could not load); the tail below it.
        said = f"; its last error: {error}" if error else ""
        text = f"{reason}: {message}{said}\n--- last lines of {log_path or 'the server log'} ---\n{tail}"
        raise (AirflowSensorTimeout if status == "timeout" else AirflowException)(text)
