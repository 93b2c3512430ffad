"""After extraction: draft vocabulary, drafter training, charts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from airflow.sdk.exceptions import AirflowException

from operators.links import EagleflowRunLink
from operators.step import EagleflowStepOperator, pipeline_config

if TYPE_CHECKING:
    from airflow.sdk import Context

class BuildVocabOperator(EagleflowStepOperator):
    """Token frequencies over loss-masked tokens -> d2t/t2d in the dataset folder (``build-vocab``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="build-vocab", **kwargs)

    def step_argv(self, context: Context) -> list[str]:
        train = pipeline_config(context).train_config()
        return ["--dataset", str(train.dataset), "--verifier", str(train.verifier), "--draft-vocab-size", str(train.draft_vocab_size)]


class TrainOperator(EagleflowStepOperator):
    """Train the EAGLE-3 drafter with speculators (``python -m eagleflow train``).

    From the extracted files, or (``hidden_states_source`` engine) from the run's engines, asked
    for each sample while training runs; only engines this worker can reach are given. A retry
    with the same run folder resumes from the newest checkpoint. Returns ``{checkpoint_dir,
    best_checkpoint, metrics_path, log_path}`` (online: and ``online``, the feed's figures).

    :param engines: every engine's ``{url, pid, host, log_path, dump_dir, name}`` from the
        readiness sensors (templated; used online).
    """

    template_fields: Sequence[str] = ("engines",)
    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, *, engines: Any = None, **kwargs: Any) -> None:
        super().__init__(step="train", **kwargs)
        self.engines = engines

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv
        from eagleflow.engine.pool import engines_from_xcom, unreachable_reason

        cfg = pipeline_config(context)
        if not cfg.online:
            return model_to_argv(cfg.train_config())
        engines = engines_from_xcom(self.engines)
        reachable = [e for e in engines if unreachable_reason(e) is None]
        for engine in engines:
            if engine not in reachable:
                self.log.warning("Passing over %s", unreachable_reason(engine))
        if not reachable:
            raise AirflowException("online training: none of the run's engines can be reached from this worker")
        self.log.info("Training from the engines: %s", ", ".join(e.describe() for e in reachable))
        return model_to_argv(cfg.train_config(reachable))


class PlotOperator(EagleflowStepOperator):
    """Loss and accuracy charts (PNG + SVG) under ``<run>/train-progress/`` (``plot``)."""

    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="plot", **kwargs)

    def step_argv(self, context: Context) -> list[str]:
        layout = pipeline_config(context).layout
        return ["--metrics", str(layout.train.metrics), "--out", str(layout.charts)]
