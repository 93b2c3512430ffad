"""Extraction in the DAG: the capture check on the live engine, then one mapped task per shard of rows."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException, AirflowSkipException

from operators.links import EagleflowRunLink, push_run_name
from operators.server import NOT_LAUNCHED_KEY
from operators.step import EagleflowStepOperator, StepFailed, pipeline_config

if TYPE_CHECKING:
    from airflow.sdk import Context

    from eagleflow.run.pipeline import PipelineConfig

# The task that plans the shards (its XCom: [{name, start, end}, ...]); the DAG names it so.
PLAN_SHARDS_TASK_ID = "plan_shards"

# Names each mapped instance after its shard in the UI; pass it to .partial(): a mapped
# task takes map_index_template only from there.
SHARD_MAP_INDEX_TEMPLATE = "{{ task.shard['name'] }}"

# A shard whose engine or worker went away is tried again (on an engine that is up); the
# retry skips every row already complete. Give both to .partial(): the scheduler reads them there.
SHARD_RETRIES = 2
SHARD_RETRY_DELAY = timedelta(seconds=15)


def nothing_to_extract(cfg: PipelineConfig, context: Context) -> str | None:
    """Why the run's engines are not needed, or None: every planned shard is complete and none is to be redone.

    That is the case when a finished shard is cleared: its engine setups run again with it, and
    without this the engine would be launched and warmed up for a shard that extracts nothing.
    Online training and regeneration need the engines whatever the shards; before plan_shards has
    run (a run's first pass), nothing is known and the engines start.
    """
    from eagleflow.extract import incomplete_shards

    ti = context.get("ti")
    if cfg.online or cfg.regenerate_responses or cfg.step_param("reextract_complete_shards") or ti is None:
        return None
    shards = ti.xcom_pull(task_ids=PLAN_SHARDS_TASK_ID, map_indexes=-1)
    if not shards or incomplete_shards(cfg.layout, shards):
        return None
    return (
        f"every shard of run {cfg.run_name} is complete ({len(shards)} shards, rows 0:{shards[-1]['end']}); "
        "nothing to extract (Param reextract_complete_shards re-extracts cleared shards)"
    )


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

    def execute(self, context: Context) -> Any:
        not_launched = (self.server or {}).get(NOT_LAUNCHED_KEY)
        if not_launched:
            self.log.info("No capture check: %s was not launched: %s", self.server.get("name"), not_launched)
            return {"passed": None, NOT_LAUNCHED_KEY: not_launched}
        return super().execute(context)

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv
        from eagleflow.engine.pool import unreachable_reason
        from eagleflow.engine.process import ServerInfo

        server = ServerInfo.from_dict(self.server)
        reason = unreachable_reason(server)
        if reason:  # another GPU node's launched engine: a retry may land on that node's worker
            raise AirflowException(f"cannot check {reason}")
        self.log.info("Checking the capture of %s", server.describe())
        return model_to_argv(pipeline_config(context).verify_capture_config(server))


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

    def execute(self, context: Context) -> Any:
        """A complete shard (a finished one, cleared) says so and extracts nothing, unless the run re-extracts complete shards."""
        from eagleflow.extract import already_complete_message, complete_shard
        from eagleflow.run.pipeline import param_name

        cfg = pipeline_config(context)
        if not cfg.online and not cfg.step_param("reextract_complete_shards"):
            start, end, name = int(self.shard["start"]), int(self.shard["end"]), str(self.shard["name"])
            manifest_path = cfg.layout.shard_manifest(name)
            done = complete_shard(manifest_path, cfg.layout.hidden_states, start, end)
            if done is not None:
                push_run_name(context, str(cfg.run_name))
                self.log.info(
                    "%s", already_complete_message(done, manifest_path, cfg.layout.hidden_states, param_name("reextract_complete_shards"))
                )
                return done.result(manifest_path)
        return super().execute(context)

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv
        from eagleflow.engine.pool import NoEngineReady, choose_engine, engines_from_xcom

        cfg = pipeline_config(context)
        if cfg.online:
            raise AirflowSkipException(
                f"hidden_states_source engine: training asks the engines for {self.shard['name']} itself; nothing is extracted"
            )
        not_launched = [e[NOT_LAUNCHED_KEY] for e in self.engines or [] if isinstance(e, dict) and e.get(NOT_LAUNCHED_KEY)]
        if not_launched:  # the shards were complete when the engines were to start; this one is not any more
            raise AirflowFailException(
                f"shard {self.shard['name']} is not complete, but the engines were not launched ({not_launched[0]}); "
                "clear this shard again to launch them"
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
