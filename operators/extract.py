"""Extraction in the DAG: the capture check on the live engine, then one mapped task per shard of rows."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from operators.links import EagleflowRunLink
from operators.step import EagleflowStepOperator, StepFailed, pipeline_config

if TYPE_CHECKING:
    from airflow.sdk import Context

# Names each mapped instance after its shard in the UI; pass it to .partial(): a mapped
# task takes map_index_template only from there.
SHARD_MAP_INDEX_TEMPLATE = "{{ task.shard['name'] }}"

# A shard whose engine or worker went away is tried again (on an engine that is up); the
# retry skips every row already complete. Give both to .partial(): the scheduler reads them there.
SHARD_RETRIES = 2
SHARD_RETRY_DELAY = timedelta(seconds=15)


class VerifyCaptureOperator(EagleflowStepOperator):
    """Check one engine's capture on the dataset's first rows before any shard (``python -m eagleflow verify-capture``).

    A setup of the engines (one instance per engine), so clearing a shard re-checks a restarted
    engine. Fails, naming the check, slot, worst error and likely cause, when the captured states
    are not what training needs; writes ``<run>/verify/<engine>/report.json`` either way. Returns
    ``{passed, report, worst_logprob_error, top1_agreement, findings}``.

    :param server: one engine's ``{url, pid, host, log_path, dump_dir, name}`` from its readiness
        sensor (templated; mapped over).
    """

    template_fields: Sequence[str] = ("server",)
    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, *, server: Any = None, **kwargs: Any) -> None:
        super().__init__(step="verify-capture", **kwargs)
        self.server = server

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv
        from eagleflow.engine.pool import unreachable_reason
        from eagleflow.engine.process import ServerInfo

        server = ServerInfo.from_dict(self.server)
        reason = unreachable_reason(server)
        if reason:  # another GPU node's launched engine: a retry may land on that node's worker
            raise AirflowException(f"cannot check {reason}")
        self.log.info("Checking the capture of %s", server.describe())
        return model_to_argv(pipeline_config(context).verify_capture_config(server.url, server.dump_dir, server.name))


class ShardExtractOperator(EagleflowStepOperator):
    """Extract the hidden states of one shard from one of the run's engines (``python -m eagleflow extract``).

    The shard uses its own engine (map index modulo the engines) while that one is ready, else
    one of the ready ones (:func:`eagleflow.engine.pool.choose_engine`); the log and the shard's
    manifest name it. Rows already complete are skipped, so a retry or a cleared instance redoes
    only what is missing. Airflow retries a shard whose engine went away (or whose step was
    killed); rows the engine refused or that failed their checks fail it for good, naming them.
    Returns ``{name, done, skipped, failed, tokens, bytes, seconds, manifest}`` (this attempt's
    figures) plus ``total_rows``, ``total_tokens`` and ``total_bytes``: the shard's over every attempt.

    :param shard: ``{name, start, end}`` from plan_shards (templated; mapped over).
    :param engines: every engine's ``{url, pid, host, log_path, dump_dir, name}`` from the
        readiness sensors (templated).
    """

    template_fields: Sequence[str] = ("shard", "engines")
    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, *, shard: Any = None, engines: Any = None, **kwargs: Any) -> None:
        super().__init__(step="extract", **kwargs)
        self.shard = shard
        self.engines = engines

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv
        from eagleflow.engine.pool import NoEngineReady, choose_engine, engines_from_xcom

        cfg = pipeline_config(context)
        if cfg.online:
            raise AirflowSkipException(
                f"hidden_states_source engine: training asks the engines for {self.shard['name']} itself; nothing is extracted"
            )
        engines = engines_from_xcom(self.engines)
        shard_index = max(int(getattr(context.get("ti"), "map_index", 0) or 0), 0)
        try:
            server, passed_over = choose_engine(engines, shard_index)
        except NoEngineReady as exc:
            raise AirflowException(str(exc)) from exc
        for reason in passed_over:
            self.log.warning("Passing over %s", reason)
        self.log.info("Shard %s uses %s", self.shard["name"], server.describe())
        return model_to_argv(cfg.extract_config(server, self.shard))

    def run_step(self, step: str, argv: list[str]) -> dict[str, Any] | None:
        from eagleflow.extract.shard import EXIT_ENGINE_GONE

        try:
            return super().run_step(step, argv)
        except StepFailed as exc:
            # Killed by a signal or left by its engine: another try may well succeed. Anything
            # else (rows the engine refused or that failed their checks, bad input) would fail again.
            if exc.returncode == EXIT_ENGINE_GONE or exc.returncode < 0:
                raise
            raise AirflowFailException(str(exc)) from exc
