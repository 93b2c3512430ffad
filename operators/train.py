"""After extraction: draft vocabulary, drafter training, charts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from operators.links import EagleflowRunLink
from operators.step import EagleflowStepOperator, pipeline_config

if TYPE_CHECKING:
    from airflow.sdk import Context

# Training knobs offered in the Params form; their defaults and help come from TrainConfig.
TRAIN_PARAMS = (
    "epochs",
    "lr",
    "total_seq_len",
    "ttt_steps",
    "noise_std",
    "scheduler_type",
    "scheduler_warmup_ratio",
    "num_workers",
    "draft_vocab_size",
    "num_layers",
    "draft_config",
    "train_data_ratio",
    "device",
    "gpus",
    "restart",
)


class BuildVocabOperator(EagleflowStepOperator):
    """Token frequencies over loss-masked tokens -> d2t/t2d in the dataset folder (``build-vocab``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="build-vocab", **kwargs)

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.pipeline import model_dir

        cfg = pipeline_config(context)
        size = context["params"].get("draft_vocab_size", 32000)
        return ["--dataset", str(cfg.layout.dataset), "--verifier", str(model_dir(cfg)), "--draft-vocab-size", str(size)]


class TrainOperator(EagleflowStepOperator):
    """Train the EAGLE-3 drafter with speculators (``python -m eagleflow train``).

    A retry with the same run folder resumes from the newest checkpoint. Returns
    ``{checkpoint_dir, best_checkpoint, metrics_path, log_path}``.
    """

    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="train", **kwargs)

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_from_args, model_to_argv
        from eagleflow.pipeline import model_dir
        from eagleflow.train import TrainConfig

        cfg = pipeline_config(context)
        values = {name: context["params"][name] for name in TRAIN_PARAMS if context["params"].get(name) is not None}
        values.update(
            dataset=cfg.layout.dataset,
            verifier=model_dir(cfg),
            out=cfg.layout.train,
            aux_layer_ids=cfg.resolved_aux_layer_ids(),
        )
        return model_to_argv(model_from_args(TrainConfig, values))


class PlotOperator(EagleflowStepOperator):
    """Loss and accuracy charts (PNG + SVG) under ``<run>/train-progress/`` (``plot``)."""

    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="plot", **kwargs)

    def step_argv(self, context: Context) -> list[str]:
        layout = pipeline_config(context).layout
        return ["--metrics", str(layout.metrics), "--out", str(layout.charts)]


def train_param_schemas() -> dict[str, dict[str, Any]]:
    """JSON schemas of the training Params, taken from :class:`eagleflow.train.TrainConfig`."""
    from eagleflow.pipeline import schemas_of
    from eagleflow.train import TrainConfig

    return schemas_of(TrainConfig, TRAIN_PARAMS)
