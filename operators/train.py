"""After extraction: draft vocabulary, drafter training, charts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

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

    A retry with the same run folder resumes from the newest checkpoint. Returns
    ``{checkpoint_dir, best_checkpoint, metrics_path, log_path}``.
    """

    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="train", **kwargs)

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv

        return model_to_argv(pipeline_config(context).train_config())


class PlotOperator(EagleflowStepOperator):
    """Loss and accuracy charts (PNG + SVG) under ``<run>/train-progress/`` (``plot``)."""

    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="plot", **kwargs)

    def step_argv(self, context: Context) -> list[str]:
        layout = pipeline_config(context).layout
        return ["--metrics", str(layout.train.metrics), "--out", str(layout.charts)]
