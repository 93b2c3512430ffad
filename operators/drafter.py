"""After training: each drafter exported for its serving engines, measured on held-out prompts, and compared.

export_drafter, evaluate_drafter and plot_metrics have one instance per drafter and run whatever
the other drafters' outcome (``all_done``): Airflow relates their instances to no particular
``train_drafter`` instance (a mapped task group cannot hold a task mapped over nodes), so each
instance checks its own drafter's upstream result itself (its XCom, which a failed or cleared
try never has) and is skipped, saying which instance did not finish, when it is missing.
compare_drafters, the run's last task, fails the run when a drafter was not measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from operators.links import EagleflowRunLink
from operators.step import EagleflowStepOperator, drafter_config, pipeline_config

if TYPE_CHECKING:
    from airflow.sdk import Context


TRAIN_TASK_ID, EXPORT_TASK_ID, EVALUATE_TASK_ID = "train_drafter", "export_drafter", "evaluate_drafter"
PLAN_TRAIN_NODES_TASK_ID = "plan_train_nodes"


def unfinished(context: Context, task_id: str, drafter: dict[str, Any], index: int) -> list[str]:
    """The instances of ``task_id`` for ``drafter`` (plan index ``index``) without a result in this run, by name."""
    ti = context["ti"]
    if task_id == TRAIN_TASK_ID:  # one instance per drafter and node
        nodes = ti.xcom_pull(task_ids=PLAN_TRAIN_NODES_TASK_ID, map_indexes=-1) or []
        mine = [(i, n["name"]) for i, n in enumerate(nodes) if (n.get("drafter") or {}).get("name") == drafter["name"]]
    else:  # one instance per drafter, in the plan's order
        mine = [(index, drafter["name"])]
    if not mine:
        return [f"{task_id} (never planned)"]
    return [f"{task_id} [{name}]" for i, name in mine if ti.xcom_pull(task_ids=task_id, map_indexes=i) is None]


class DrafterStepOperator(EagleflowStepOperator):
    """A step of one drafter of the run; mapped over ``plan_drafters``, it runs once ``after`` gave this drafter its result.

    :param drafter: the drafter ``{name, folder, settings}`` (templated; one of ``plan_drafters``).
    """

    template_fields: Sequence[str] = ("drafter",)
    operator_extra_links = (EagleflowRunLink(),)
    after = TRAIN_TASK_ID

    def __init__(self, *, drafter: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.drafter = drafter

    def execute(self, context: Context) -> Any:
        self.skip_unless_upstream_finished(context)
        return super().execute(context)

    def skip_unless_upstream_finished(self, context: Context) -> None:
        """Skip (saying which instance did not finish) when this drafter's ``after`` step has no result in this run:
        before anything else, so a run refused by its first tasks skips here rather than failing again."""
        missing = unfinished(context, self.after, self.drafter or {}, context["ti"].map_index)
        if missing:
            from airflow.sdk.exceptions import AirflowSkipException

            raise AirflowSkipException(
                f"drafter {(self.drafter or {}).get('name')}: {', '.join(missing)} did not finish in this run; "
                "clear it (with its downstream tasks) to carry this drafter on"
            )


class ExportOperator(DrafterStepOperator):
    """The drafter's best checkpoint -> its ``drafter/{sglang,speculators}`` (``python -m eagleflow export``).

    Returns ``{drafter, sglang}``: the drafter folder and SGLang's folder inside it (None when the
    checkpoint cannot be served by SGLang and ``serve_with`` is vllm).
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="export", **kwargs)

    def step_argv(self, context: Context) -> list[str]:
        from eagleflow.config import model_to_argv

        return model_to_argv(drafter_config(context, self.drafter).export_config())


class EvaluateOperator(DrafterStepOperator):
    """Serve the drafter, decode held-out prompts with and without it (``python -m eagleflow evaluate``).

    Returns ``{report, accept_length, speedup, fastest}``. In remote mode (``server_urls``) there is no engine
    of this run to relaunch with the drafter: the task is skipped and says so.
    """

    after = EXPORT_TASK_ID

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(step="evaluate", **kwargs)

    def execute(self, context: Context) -> Any:
        self.skip_unless_upstream_finished(context)
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

        return model_to_argv(drafter_config(context, self.drafter).evaluate_config())


class CompareOperator(EagleflowStepOperator):
    """Every drafter of the run side by side (``python -m eagleflow compare``): ``<run>/eval/compare.json`` and its chart.

    Runs whatever the evaluations' outcome (``all_done``): the drafters measured in this run are
    compared, then, when one was not (its training, export or evaluation did not finish), the task
    fails naming it, and so does the run. Skipped in remote mode and with stop_after_extraction,
    which measure nothing by design. Returns ``{compare, winner, png, svg}``.

    :param drafters: the run's drafters (templated; ``plan_drafters``' XCom).
    """

    template_fields: Sequence[str] = ("drafters",)
    operator_extra_links = (EagleflowRunLink(),)

    def __init__(self, *, drafters: Any = None, **kwargs: Any) -> None:
        super().__init__(step="compare", **kwargs)
        self.drafters = drafters

    def execute(self, context: Context) -> Any:
        from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

        cfg = pipeline_config(context, check_model=False)
        drafters = list(self.drafters or cfg.drafter_plan())
        missing = {d["name"]: unfinished(context, EVALUATE_TASK_ID, d, i) for i, d in enumerate(drafters)}
        measured = [d for d in drafters if not missing[d["name"]]]
        result = None
        if measured:
            from eagleflow.config import model_to_argv

            result = self.run_step(self.step, model_to_argv(cfg.compare_config(measured)))
        # The tasks before it run whatever another drafter's outcome (all_done): a failure anywhere in the run
        # must still fail the run, and this is its last task.
        failed = failed_tasks(context)
        compared = f"compared the others in {result['compare']}" if result else "nothing compared"
        not_measured = ", ".join(name for name, why in missing.items() if why)
        if failed:
            raise AirflowFailException(
                f"failed in this run: {', '.join(failed)}" + (f"; not measured in this run: {not_measured}" if not_measured else "")
                + f"; {compared}"
            )
        if cfg.remote or cfg.stop_after_extraction:
            raise AirflowSkipException("no drafter is measured in remote mode or with stop_after_extraction: nothing to compare")
        if not_measured:
            raise AirflowFailException(
                f"not measured in this run: {not_measured} (its evaluate_drafter instance did not finish; see its training, "
                f"export and evaluation instances); {compared}"
            )
        return result


FIRST_TASK_ID = "plan_engines"  # checks every Param before anything starts (operators.server.PlanEnginesOperator)


def failed_tasks(context: Context) -> list[str]:
    """This run's failed task instances (``task`` or ``task_<map index>``, as Airflow's execution API lists them),
    then how many could not run after them."""
    from operators.step import REFUSAL_XCOM

    ti = context["ti"]
    states = ti.get_task_states(dag_id=ti.dag_id, run_ids=[ti.run_id]).get(ti.run_id, {})
    failed = sorted(key for key, state in states.items() if state == "failed" and key != ti.task_id)
    after = sum(state == "upstream_failed" for key, state in states.items() if key != ti.task_id)
    if FIRST_TASK_ID in failed and (refusal := ti.xcom_pull(task_ids=FIRST_TASK_ID, key=REFUSAL_XCOM)):
        # The run's Params were refused: that sentence is the reason, and nothing after the first task ran.
        failed[failed.index(FIRST_TASK_ID)] = f"{FIRST_TASK_ID} (refused the run's Params: {refusal})"
    return failed + ([f"{after} task(s) that could not run after them"] if after and failed else [])
