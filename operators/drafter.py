"""After training: the drafter exported for its serving engines, then measured on held-out prompts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from operators.links import EagleflowRunLink
from operators.step import EagleflowStepOperator, pipeline_config

if TYPE_CHECKING:
    from airflow.sdk import Context


class ExportOperator(EagleflowStepOperator):
    """The best checkpoint -> ``<run>/drafter/{sglang,speculators}`` (``python -m eagleflow export``).

    Returns ``{drafter, sglang}``: the drafter folder and SGLang's folder inside it (None when the
    checkpoint cannot be served by SGLang and ``serve_with`` is vllm).
    """

    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="export", **kwargs)

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv

        return model_to_argv(pipeline_config(context).export_config())


class EvaluateOperator(EagleflowStepOperator):
    """Serve the drafter, decode held-out prompts with and without it (``python -m eagleflow evaluate``).

    Returns ``{report, accept_length, speedup, fastest}``. In remote mode (``server_urls``) there is no engine
    of this run to relaunch with the drafter: the task is skipped and says so.
    """

    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="evaluate", **kwargs)

    def execute(self, context: Context) -> Any:
        cfg = pipeline_config(context)
        if cfg.remote:
            from airflow.sdk.exceptions import AirflowSkipException

            raise AirflowSkipException(
                f"remote mode: the engines at {', '.join(cfg.server_urls)} are not this run's to relaunch with the drafter; "
                "serve <run>/drafter as the README shows to measure it"
            )
        return super().execute(context)

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv

        return model_to_argv(pipeline_config(context).evaluate_config())
