"""After extraction: draft vocabulary, drafter training, charts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from datetime import timedelta

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from operators.links import EagleflowRunLink
from operators.step import EagleflowStepOperator, StepFailed, pipeline_config

if TYPE_CHECKING:
    from airflow.sdk import Context

# One train_drafter instance per training node, named node-0, node-1, … (given to partial(), as every map_index_template).
NODE_MAP_INDEX_TEMPLATE = "{{ task.node['name'] }}"
# A stopped or failed training resumes from its last checkpoint; with several nodes every node's
# instance fails when one stops, and their retries meet again.
TRAIN_RETRIES = 2
TRAIN_RETRY_DELAY = timedelta(seconds=15)
EXIT_BAD_INPUT = 2  # python -m eagleflow's status for bad input or settings: another try would fail alike


class BuildVocabOperator(EagleflowStepOperator):
    """Token frequencies over loss-masked tokens -> d2t/t2d in the dataset folder (``build-vocab``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="build-vocab", **kwargs)

    def execute(self, context: Context) -> Any:
        cfg = pipeline_config(context)
        if cfg.stop_after_extraction:
            from airflow.sdk.exceptions import AirflowSkipException

            # Skipped, not failed: training, export and evaluation are skipped after it and the run succeeds.
            raise AirflowSkipException(
                f"stop_after_extraction: the hidden states are in {cfg.layout.hidden_states}; trigger a run with "
                f"run_name {cfg.layout.root.name!r} and stop_after_extraction off to train from them"
            )
        family = cfg.drafter_family()
        if family.block:  # succeeds with nothing to do: training follows it
            reason = f"draft_algorithm {family.name} trains the verifier's full vocabulary: no draft vocabulary to build"
            self.log.info(reason)
            return {"skipped": reason}
        return super().execute(context)

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv

        return model_to_argv(pipeline_config(context).vocab_config())


class PlanTrainNodesOperator(BaseOperator):
    """The training nodes, ``[{name, rank}]`` (``train_nodes`` Param): train_drafter is mapped over them."""

    def execute(self, context: Context) -> list[dict[str, Any]]:
        from eagleflow.train.config import TrainConfig
        from eagleflow.train.nodes import node_plan

        cfg = pipeline_config(context, check_model=False)
        nodes = node_plan(cfg.step_values(TrainConfig).get("train_nodes", TrainConfig.model_fields["train_nodes"].default))
        if len(nodes) > 1:
            self.log.info("Training on %d nodes (%s): the gpu pool needs a slot for each", len(nodes), ", ".join(n["name"] for n in nodes))
        return nodes


class TrainOperator(EagleflowStepOperator):
    """Train the drafter (``draft_algorithm``'s family) with speculators (``python -m eagleflow train``), one instance per node.

    From the extracted files, or (``hidden_states_source`` engine) from the run's engines, asked
    for each sample while training runs; only engines this worker can reach are given. A retry
    with the same run folder resumes from the newest checkpoint. Returns ``{checkpoint_dir,
    best_checkpoint, metrics_path, log_path}`` (online: and ``online``, the feed's figures; a
    node other than node-0: and ``node``). Bad input fails without a retry.

    :param engines: every engine's ``{url, pid, host, log_path, dump_dir, name}`` from the
        readiness sensors (templated; used online).
    :param node: this instance's training node ``{name, rank}`` (templated; one of ``plan_train_nodes``).
    """

    template_fields: Sequence[str] = ("engines", "node")
    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, *, engines: Any = None, node: Any = None, **kwargs: Any) -> None:
        super().__init__(step="train", **kwargs)
        self.engines = engines
        self.node = node

    def run_step(self, step: str, argv: list[str]) -> dict[str, Any] | None:
        try:
            return super().run_step(step, argv)
        except StepFailed as exc:
            if exc.returncode == EXIT_BAD_INPUT:
                raise AirflowFailException(str(exc)) from exc
            raise

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv
        from eagleflow.engine.pool import engines_from_xcom, unreachable_reason

        cfg = pipeline_config(context)
        if not cfg.online:
            return model_to_argv(cfg.train_config(node_rank=int((self.node or {}).get("rank", 0))))
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
        from eagleflow.config import model_to_argv

        return model_to_argv(pipeline_config(context).plot_config())
