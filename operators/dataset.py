"""Work done during the engine warmup: prepare the dataset, size it, check the disk, plan shards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from operators.step import EagleflowStepOperator, pipeline_config

if TYPE_CHECKING:
    from airflow.sdk import Context


class PrepareDatasetOperator(EagleflowStepOperator):
    """Tokenize the input into ``<run>/dataset`` (``prepare-dataset``); returns rows/tokens/truncated."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="prepare-dataset", **kwargs)

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv

        return model_to_argv(pipeline_config(context).prepare_config())


class RegenerateOperator(EagleflowStepOperator):
    """With ``regenerate_responses``: the verifier rewrites the assistant turns through one of the run's engines (``regenerate``).

    It uses the first engine this worker reaches (engine-0 unless that one was launched on
    another node), not all of them: regeneration is one pass before any shard, and it waits
    for that engine's warmup itself, so with regeneration off it returns at once and
    preparation still runs beside the warmup. Returns ``{regenerated, rows, skipped_rows,
    shortened_conversations, dropped_turns, source}`` or ``{"regenerated": None}``.

    :param engines: the mapped launch task's XCom, the engine list of
        :mod:`eagleflow.engine.pool` (templated).
    """

    template_fields: Sequence[str] = ("engines",)

    def __init__(self, *, engines: Any = None, **kwargs: Any) -> None:
        super().__init__(step="regenerate", **kwargs)
        self.engines = engines

    def execute(self, context: Context) -> Any:
        cfg = pipeline_config(context)
        if not cfg.regenerate_responses:
            self.log.info("Regeneration is off: preparation reads %s as it is", cfg.dataset_input)
            return {"regenerated": None, "source": cfg.dataset_input}
        return super().execute(context)

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv
        from eagleflow.engine.pool import NoEngineReady, engines_from_xcom, first_reachable

        try:
            server = first_reachable(engines_from_xcom(self.engines))
        except NoEngineReady as exc:
            raise AirflowException(str(exc)) from exc
        self.log.info("Regenerating through %s", server.describe())
        pid = server.pid if server.is_local else None
        return model_to_argv(pipeline_config(context).regenerate_config(server.url, pid))


class DatasetStatsOperator(EagleflowStepOperator):
    """Rows, tokens and estimated hidden-state bytes (``dataset-stats``), as a table in the log."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="dataset-stats", **kwargs)

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv

        return model_to_argv(pipeline_config(context).stats_config())


class CheckDiskOperator(EagleflowStepOperator):
    """Fail before any extraction when free space < estimate × margin (``check-disk``).

    :param stats: the dataset-stats XCom (templated).
    """

    template_fields: Sequence[str] = ("stats",)

    def __init__(self, *, stats: Any = None, **kwargs: Any) -> None:
        super().__init__(step="check-disk", **kwargs)
        self.stats = stats

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv

        cfg = pipeline_config(context)
        needed = int(self.stats["estimated_bytes"])
        folder = cfg.layout.hidden_states
        if cfg.online:
            # Online the disk holds the window fetched ahead of the trainer and the cache, not the dataset.
            from eagleflow.train.online.settings import online_cache_bytes, online_window_bytes

            train = cfg.train_config()
            needed = online_window_bytes(train) + online_cache_bytes(train)
            folder = cfg.layout.train.online
            self.log.info("Online training: the disk holds at most the window and the cache, %d bytes", needed)
        return model_to_argv(cfg.disk_check_config(folder, needed))


class PlanShardsOperator(BaseOperator):
    """Split the prepared rows into shards of ``shard_size``: ``[{name, start, end}, …]``.

    :param prepared: the prepare-dataset XCom (templated), which holds the row count.
    """

    template_fields: Sequence[str] = ("prepared",)

    def __init__(self, *, prepared: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.prepared = prepared

    def execute(self, context: Context) -> list[dict[str, Any]]:
        from eagleflow.layout import plan_shards

        cfg = pipeline_config(context)
        shards = plan_shards(int(self.prepared["rows"]), cfg.shard_size)
        self.log.info("%d rows -> %d shards of up to %d rows: %s", self.prepared["rows"], len(shards), cfg.shard_size,
                      ", ".join(str(s["name"]) for s in shards))
        return shards
