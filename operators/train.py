"""After extraction: draft vocabulary, drafter training, charts."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from datetime import timedelta

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from operators.drafter import DrafterStepOperator
from operators.links import EagleflowRunLink
from operators.step import EagleflowStepOperator, StepFailed, drafter_config, pipeline_config

if TYPE_CHECKING:
    from airflow.sdk import Context

# One train_drafter instance per drafter and training node, named by both (eagle3, dflash/node-1; a run's
# one drafter: node-0, …), given to partial(), as every map_index_template.
NODE_MAP_INDEX_TEMPLATE = "{{ task.node['name'] }}"
# plot_metrics, export_drafter and evaluate_drafter: one instance per drafter, named by it.
DRAFTER_MAP_INDEX_TEMPLATE = "{{ task.drafter['name'] }}"
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
        # Each size a drafter of the run reads (block drafters read the full vocabulary: none).
        sizes: dict[int, list[str]] = {}
        for drafter in cfg.drafter_plan():
            seen = cfg.for_drafter(drafter)
            if not seen.drafter_family().block:
                sizes.setdefault(int(seen.step_param("draft_vocab_size")), []).append(drafter["name"])
        if not sizes:  # succeeds with nothing to do: training follows it
            reason = "block drafters train the verifier's full vocabulary: no draft vocabulary to build"
            self.log.info(reason)
            return {"skipped": reason}
        from eagleflow.config import model_to_argv

        results = {}
        for size, names in sorted(sizes.items()):
            self.log.info("Draft vocabulary of %d ids, for %s", size, ", ".join(names))
            vocab = cfg.vocab_config().model_copy(update={"draft_vocab_size": size})
            results[str(size)] = self.run_step(self.step, model_to_argv(vocab))
        return results if len(results) > 1 else next(iter(results.values()))


class PlanDraftersOperator(BaseOperator):
    """The run's drafters, ``[{name, folder, settings}]`` (``drafters`` Param): export, evaluation and charts are mapped over them."""

    def execute(self, context: Context) -> list[dict[str, Any]]:
        drafters = pipeline_config(context, check_model=False).drafter_plan()
        self.log.info("Drafters: %s", ", ".join(d["name"] for d in drafters))
        return drafters


class PlanTrainNodesOperator(BaseOperator):
    """Each drafter's training nodes, ``[{name, rank, drafter}]`` (``train_nodes`` Param): train_drafter is mapped over them.

    :param drafters: the run's drafters (templated; ``plan_drafters``' XCom).
    """

    template_fields: Sequence[str] = ("drafters",)

    def __init__(self, *, drafters: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.drafters = drafters

    def execute(self, context: Context) -> list[dict[str, Any]]:
        from eagleflow.train.config import TrainConfig
        from eagleflow.train.nodes import drafter_node_plan

        cfg = pipeline_config(context, check_model=False)
        count = cfg.step_values(TrainConfig).get("train_nodes", TrainConfig.model_fields["train_nodes"].default)
        nodes = drafter_node_plan(list(self.drafters or cfg.drafter_plan()), count)
        if len(nodes) > 1:
            self.log.info("Training instances: %s; the gpu pool needs a slot for each", ", ".join(n["name"] for n in nodes))
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
    :param node: this instance's training node ``{name, rank, drafter}`` (templated; one of ``plan_train_nodes``).
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
        from eagleflow.run.launch import revive_sample_store
        from eagleflow.engine.pool import engines_from_xcom, unreachable_reason

        cfg = drafter_config(context, (self.node or {}).get("drafter"))
        if not cfg.online:
            return model_to_argv(cfg.train_config(node_rank=int((self.node or {}).get("rank", 0))))
        revive_sample_store(cfg, say=self.log.info)
        engines = engines_from_xcom(self.engines)
        reachable = [e for e in engines if unreachable_reason(e) is None]
        for engine in engines:
            if engine not in reachable:
                self.log.warning("Passing over %s", unreachable_reason(engine))
        if not reachable:
            raise AirflowException("online training: none of the run's engines can be reached from this worker")
        self.log.info("Training from the engines: %s", ", ".join(e.describe() for e in reachable))
        return model_to_argv(cfg.train_config(reachable))


class PlotOperator(DrafterStepOperator):
    """A drafter's loss and accuracy charts (PNG + SVG) under its ``train-progress/`` (``plot``), once its training finished."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="plot", **kwargs)

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv

        return model_to_argv(drafter_config(context, self.drafter).plot_config())
